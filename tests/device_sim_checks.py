"""Device kernels under numba's CUDA simulator, against the host kernels and ml_dtypes.

Not collected by the normal run (its name does not start with test_): tests/test_kernels_device.py runs
it in a subprocess with NUMBA_ENABLE_CUDASIM=1, because the simulator replaces numba.cuda for the whole
process. The simulator executes the very kernel bodies the GPU compiles (only the float32 <-> bits
casts have numpy twins), one Python thread per CUDA thread, with the same grid-stride loops.

Results must equal the host kernels bit for bit, except where hardware may differ and NCCL does too:
the payload and sign of a NaN that arithmetic produced (GPUs make a canonical NaN, x86 keeps an input's),
and which zero MIN / MAX of +0 and -0 returns.
"""
import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from ringcomm.kernels import device as D
from ringcomm.kernels import host as H
from device_cases import numba_to_device, numba_to_host

pytestmark = [pytest.mark.skipif(not D.SIMULATOR, reason="run by test_kernels_device.py with NUMBA_ENABLE_CUDASIM=1"),
              pytest.mark.no_ranks]

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = H.SUPPORTED_DTYPES
OPS = H.OPS
SIZES = (0, 1, 33, 200)       # 33 and 200: not multiples of the 32-thread block; 200 spans 7 blocks


def ids(values):
    return [str(v) for v in values]


def make(dt, n, seed):
    """Edge values first (NaN, inf, zeros, extremes), then random data over the whole range."""
    rng = np.random.default_rng(seed)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        edge = np.array([info.min, info.max, 0, 1, info.max, info.min], dt)
        rand = rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
    elif dt.itemsize == 2:                  # float16 / bfloat16: any bit pattern, subnormals and NaNs too
        edge = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, np.nan, 3.0], np.float32).astype(dt)
        rand = rng.integers(0, 1 << 16, size=n, dtype=np.uint16).view(dt)
    else:
        finfo = np.finfo(dt)
        edge = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, finfo.max, finfo.tiny / 4, -1.5], dt)
        rand = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(dt)
    out = rand.copy()
    k = min(n, len(edge))
    out[:k] = np.roll(edge, seed)[:k]      # different edge pairings in a and b
    return out


def assert_same(got, want, op, what=""):
    dt = want.dtype
    bits = np.dtype(f"u{dt.itemsize}")
    ok = got.view(bits) == want.view(bits)
    if dt.kind in "iu":
        bad = ~ok
    else:
        g, w = got.astype(np.float64), want.astype(np.float64)
        ok |= np.isnan(g) & np.isnan(w)
        if op in ("min", "max"):
            ok |= (g == 0) & (w == 0)
        bad = ~ok
    if bad.any():
        i = np.flatnonzero(bad)[:5]
        raise AssertionError(f"{what} {op} {dt}: {bad.sum()} of {bad.size} differ, e.g. at {i.tolist()}: "
                             f"got {got[i]!r} want {want[i]!r}")


def run(fn, *arrays, **kw):
    """Copy to the (simulated) device, run, copy back the first array."""
    dev = [numba_to_device(a) for a in arrays]
    fn(*dev, **kw)
    return numba_to_host(dev[0])


@pytest.mark.parametrize("dt", DTYPES, ids=ids(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_matches_host(op, dt):
    for n in SIZES:
        a, b = make(dt, n, 1), make(dt, n, 2)
        with np.errstate(all="ignore"):
            want = H.reduce_copy(np.empty_like(a), a, b, op)
            got = run(lambda o, x, y: D.reduce_copy(o, x, y, op), np.zeros_like(a), a, b)
            assert_same(got, want, op, f"reduce_copy n={n}")
            got = run(lambda x, y: D.reduce(x, y, op), a.copy(), b)       # in place: out is a
            assert_same(got, want, op, f"reduce n={n}")
            for k in (1, 3, 8):
                want_pp = H.postprocess(want.copy(), op, k)
                got = run(lambda x: D.postprocess(x, op, k), want.copy())
                assert_same(got, want_pp, op, f"postprocess n={n} k={k}")


@pytest.mark.parametrize("dt", [np.dtype(np.float32), BF16, np.dtype(np.int8)], ids=str)
def test_grid_stride_loop_covers_more_than_one_grid(dt):
    n = 4099                                # the simulator's grid is 16 x 32 threads: 9 trips, a ragged end
    blocks, threads = D.launch_config(n)
    assert blocks * threads < n
    a, b = make(dt, n, 3), make(dt, n, 4)
    with np.errstate(all="ignore"):
        want = H.reduce_copy(np.empty_like(a), a, b, "sum")
    assert_same(run(lambda o, x, y: D.reduce_copy(o, x, y, "sum"), np.zeros_like(a), a, b), want, "sum")


def test_launch_config_fits_the_slice():
    assert D.launch_config(1) == (1, D.THREADS)
    assert D.launch_config(D.THREADS + 1) == (2, D.THREADS)
    blocks, _ = D.launch_config(1 << 30)
    assert blocks == 2 * D.BLOCKS_PER_SM     # the simulator reports no SM count: 2 assumed


ALL16 = np.arange(1 << 16, dtype=np.uint16)


@pytest.mark.parametrize("op", ["sum", "prod", "avg"])
def test_bfloat16_rounds_like_ml_dtypes_bit_for_bit(op):
    """Every bfloat16 pattern against a shuffled partner: float32 arithmetic rounded to nearest even
    by ml_dtypes' own float32 -> bfloat16 conversion."""
    a = ALL16.view(BF16)
    b = np.random.default_rng(5).permutation(ALL16).view(BF16)
    x, y = a.astype(np.float32), b.astype(np.float32)
    with np.errstate(all="ignore"):
        if op == "avg":
            want = (x / np.float32(3)).astype(BF16)
            got = run(lambda v: D.postprocess(v, "avg", 3), a.copy())
        else:
            want = (x + y if op == "sum" else x * y).astype(BF16)
            got = run(lambda o, p, q: D.reduce_copy(o, p, q, op), np.zeros_like(a), a, b)
    assert_same(got, want, op)
    finite = np.isfinite(want.astype(np.float32))
    assert np.array_equal(got[finite].view(np.uint16), want[finite].view(np.uint16))


def test_bfloat16_ties_go_to_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -7)             # bfloat16 has 8 significant bits
    # 1 + ulp/2 is a tie between 1 (even) and 1 + ulp (odd): even wins; 1 + ulp + ulp/2 goes up to 1 + 2ulp
    a = np.array([one, one + ulp], np.float32).astype(BF16)
    b = np.array([ulp / 2, ulp / 2], np.float32).astype(BF16)
    got = run(lambda o, p, q: D.reduce_copy(o, p, q, "sum"), np.zeros_like(a), a, b)
    assert got.astype(np.float32).tolist() == [1.0, float(one + 2 * ulp)]


def test_integers_wrap_like_nccl():
    cases = [(np.int8, 127, 1, "sum", -128), (np.uint8, 255, 1, "sum", 0), (np.int8, -128, -1, "prod", -128),
             (np.int64, 2**63 - 1, 1, "sum", -2**63), (np.uint64, 2**64 - 1, 2, "prod", 2**64 - 2),
             (np.int32, -2**31, -1, "sum", 2**31 - 1), (np.uint32, 0, 1, "min", 0)]
    for t, x, y, op, want in cases:
        a, b = np.array([x], t), np.array([y], t)
        with np.errstate(all="ignore"):
            got = run(lambda o, p, q: D.reduce_copy(o, p, q, op), np.zeros_like(a), a, b)
        assert got[0] == t(want), (t, x, y, op, got[0])


def test_integer_avg_truncates_toward_zero_even_at_int_min():
    for t in (np.int8, np.int32, np.int64):
        info = np.iinfo(t)
        a = np.array([info.min, -7, 7, info.max, -1, 1], t)
        for n in (1, 2, 3, 8):
            assert_same(run(lambda v: D.postprocess(v, "avg", n), a.copy()), H.postprocess(a.copy(), "avg", n), "avg")


def test_bad_input_is_a_clear_error():
    f = cuda.to_device(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="dtype"):
        D.reduce(f, cuda.to_device(np.zeros(4, np.float64)), "sum")
    with pytest.raises(ValueError, match="1-D of one length"):
        D.reduce(f, cuda.to_device(np.zeros(5, np.float32)), "sum")
    with pytest.raises(ValueError, match="unknown reduction op"):
        D.reduce(f, f, "mean")
    with pytest.raises(TypeError, match="not supported"):
        D.reduce(cuda.to_device(np.zeros(2, np.complex64)), cuda.to_device(np.zeros(2, np.complex64)), "sum")
    with pytest.raises(TypeError, match="CUDA device array"):
        D.reduce(np.zeros(4, np.float32), f, "sum")
    with pytest.raises(ValueError, match="n >= 1"):
        D.postprocess(f, "avg", 0)
