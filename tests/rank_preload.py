"""What the forkserver of tests/harness.py imports once, so that every rank forked from it starts
with it: numpy, ringcomm, and the native engine's compiled loop loaded from numba's disk cache
(together ~1 s of CPU per rank on this machine, measured: a 2-rank World cost 1.9 s of CPU)."""
import numpy  # noqa: F401

import ringcomm  # noqa: F401
from ringcomm.engine_native import warm

warm()
