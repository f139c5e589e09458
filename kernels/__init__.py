"""Reduction kernels: combine two equal-length buffers elementwise (sum, prod, min, max, avg).

``ringcomm.kernels.host`` works on numpy arrays on the CPU; a device module (numba.cuda) sits beside it.
Nothing here imports the ringcomm core: the executor calls these per slice, they know nothing of
collectives, ranks or transports. Importing this package is cheap; numba is loaded only when a
float16 / bfloat16 kernel is first needed.

``ringcomm.kernels.reproducible`` (and its device twin ``device_reproducible``) turns floats into exact
integer limbs and back, for reproducible sums (ringcomm.reproducible runs the collectives around them).
"""
