"""Reproducible-sum kernels under numba's CUDA simulator, against the host kernels bit for bit.

Not collected by the normal run: tests/test_reproducible_device.py runs it with NUMBA_ENABLE_CUDASIM=1
(the simulator replaces numba.cuda for the whole process). The simulator runs the very kernel bodies
the GPU compiles (only cuda.clz has a Python twin), one Python thread per CUDA thread.
"""
import numpy as np
import pytest
from numba import cuda

from exact import bits, passes
from ringcomm.kernels import device_reproducible as DR
from ringcomm.kernels import reproducible as R

pytestmark = [pytest.mark.skipif(not DR.SIMULATOR,
                                 reason="run by test_reproducible_device.py with NUMBA_ENABLE_CUDASIM=1"),
              pytest.mark.no_ranks]


def inputs(dt, n, m, seed):
    """Random magnitudes over 16 binades, specials, zeros and subnormals in the first elements."""
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(m) * 2.0 ** rng.integers(-8, 8, m)).astype(dt) for _ in range(n)]
    edge = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-45, -3e-39, 1e38], np.float64)
    for r, x in enumerate(xs):
        x[:edge.size] = np.roll(edge, r)[:m].astype(dt)
    return xs


@pytest.mark.parametrize("dt", R.DTYPES, ids=[str(d) for d in R.DTYPES])
@pytest.mark.parametrize("m", [1, 70])            # 70: not a multiple of the simulator's 32-thread block
def test_device_kernels_equal_host_kernels(dt, m):
    xs = inputs(dt, 3, m, seed=m)
    codes, cmax, limbs = passes(xs)
    fmt = R.format_of(dt)
    got = cuda.to_device(np.zeros(m, np.uint8))
    DR.exponent_codes(cuda.to_device(xs[0]), got)
    assert np.array_equal(got.copy_to_host(), codes[0])
    got = cuda.to_device(np.zeros(fmt.NL * m, fmt.limb))
    DR.encode(cuda.to_device(xs[1]), cuda.to_device(cmax), got)
    assert np.array_equal(got.copy_to_host(), limbs[1])
    with np.errstate(over="ignore"):
        total = limbs[0] + limbs[1] + limbs[2]
    got = cuda.to_device(np.zeros(m, dt))
    DR.decode(cuda.to_device(total), cuda.to_device(cmax), got)
    want = R.decode(total, cmax, np.empty(m, dt))
    assert np.array_equal(bits(got.copy_to_host()), bits(want))
    got = cuda.to_device(xs[2])
    DR.canonical(got)
    assert np.array_equal(bits(got.copy_to_host()), bits(R.canonical(xs[2].copy())))
