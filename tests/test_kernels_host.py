"""Host reduction kernels against a naive per-element Python reference, numpy and ml_dtypes.

Integers must match exactly (wrapping arithmetic, NCCL's integer AVG); floats exactly too, since one
elementwise op is one rounding. Every test turns warnings into errors itself: a kernel must never warn.
"""
import ast
import pathlib
import warnings

import ml_dtypes
import numpy as np
import pytest

from ringcomm.kernels import host as H

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = H.SUPPORTED_DTYPES
SIZES = [0, 1, 7, 1000, 262147]
ALL16 = np.arange(1 << 16, dtype=np.uint16)


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def ids(values):
    return [str(v) for v in values]


# --- naive per-element reference ------------------------------------------------------------------------

def _wrap(v, dt):
    bits = 8 * dt.itemsize
    v &= (1 << bits) - 1
    return v - (1 << bits) if dt.kind == "i" and v >> (bits - 1) else v


def _round(r, dt):
    """A Python float (double) rounded once to dt; innocuous double rounding, as 53 >= 2 * 24 + 2."""
    with np.errstate(all="ignore"):
        return float(np.array([r], np.float64).astype(dt)[0])


def _py_reduce(values, op, dt):
    """Left-to-right reduction of one element's contributions in Python arithmetic."""
    integer = dt.kind in "iu"
    conv = int if integer else float
    acc = conv(values[0])
    for v in map(conv, values[1:]):
        if op in ("min", "max") and not integer:        # NCCL's fminf/fmaxf: a NaN operand loses
            acc = v if acc != acc else acc if v != v else (min if op == "min" else max)(acc, v)
            continue
        if op in ("min", "max"):
            acc = (min if op == "min" else max)(acc, v)
        else:
            acc = acc * v if op == "prod" else acc + v
        acc = _wrap(acc, dt) if integer else _round(acc, dt)
    if op == "avg":
        n = len(values)
        if integer:                                     # NCCL: truncate the wrapped sum toward zero
            acc = -(-acc // n) if acc < 0 else acc // n
        else:
            acc = _round(acc / n, dt)
    return acc


def _assert_same(got, want):
    """Equal values; NaN where NaN (payloads may differ); -0.0 == 0.0 (min/max may pick either zero)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
        return
    with np.errstate(all="ignore"):             # ml_dtypes flags a signalling NaN when converting
        g, w = got.astype(np.float64), want.astype(np.float64)
    bad = np.flatnonzero((g != w) & ~(np.isnan(g) & np.isnan(w)))
    assert bad.size == 0, f"{bad.size} mismatches, first at {bad[0]}: got {g[bad[0]]!r}, want {w[bad[0]]!r}"


def _random(rng, dt, n):
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dt)
    x = rng.standard_normal(n) * 2.0 ** rng.integers(-12, 12, n)
    fi = ml_dtypes.finfo(dt)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, float(fi.max), float(fi.smallest_subnormal)]
    if n > 20:
        x[rng.integers(0, n, 10)] = rng.choice(specials, 10)
    with np.errstate(all="ignore"):
        return x.astype(dt)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", H.OPS)
@pytest.mark.parametrize("dt", DTYPES, ids=ids(DTYPES))
def test_three_way_reduction_matches_python(dt, op, size):
    rng = np.random.default_rng([size, H.OPS.index(op), DTYPES.index(dt)])
    xs = [_random(rng, dt, size) for _ in range(3)]
    out = np.empty(size, dt)
    assert H.reduce_copy(out, xs[0], xs[1], op) is out
    H.reduce(out, xs[2], op)
    H.postprocess(out, op, 3)
    _assert_same(out, H.reference_reduce(xs, op))
    # per-element Python on every element of small arrays, a sample plus the tail of big ones
    idx = np.arange(size) if size <= 1000 else np.r_[np.arange(0, size, 331), np.arange(size - 64, size)]
    want = np.array([_py_reduce([x[i] for x in xs], op, dt) for i in idx], dtype=object)
    if dt.kind == "f" or dt == BF16:
        with np.errstate(all="ignore"):
            want = want.astype(np.float64).astype(dt)
    else:
        assert out[idx].tolist() == want.tolist()
        return
    _assert_same(out[idx], want)


@pytest.mark.parametrize("op", H.OPS)
@pytest.mark.parametrize("dt", DTYPES, ids=ids(DTYPES))
def test_out_may_alias_inputs(dt, op):
    rng = np.random.default_rng(7)
    a, b = _random(rng, dt, 70001), _random(rng, dt, 70001)
    want = H.reduce_copy(np.empty_like(a), a, b, op)
    for alias in ("a", "b", "both"):
        x, y = a.copy(), b.copy()
        if alias == "a":
            got = H.reduce_copy(x, x, y, op)
        elif alias == "b":
            got = H.reduce_copy(y, x, y, op)
        else:
            got, want2 = H.reduce_copy(x, x, x, op), H.reduce_copy(np.empty_like(a), a, a.copy(), op)
            assert np.array_equal(got.view(np.uint8), want2.view(np.uint8)), alias
            continue
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), alias
    x = a.copy()
    assert H.reduce(x, b, op) is x
    assert np.array_equal(x.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dt", DTYPES, ids=ids(DTYPES))
def test_views_of_a_uint8_slot_and_readonly_inputs(dt):
    # the executor reduces straight out of uint8 shared-memory slots reinterpreted with .view(dtype)
    rng = np.random.default_rng(3)
    n = 1000
    slot = np.zeros(64 + n * dt.itemsize, np.uint8)
    src = slot[64:].view(dt)
    src[:] = _random(rng, dt, n)
    dst = _random(rng, dt, n)
    want = H.reference_reduce([dst, src], "sum")
    src.flags.writeable = False
    _assert_same(H.reduce(dst, src, "sum"), want)


def test_integer_overflow_wraps_silently():
    cases = [(np.int8, 127, 1, "sum", -128), (np.uint8, 255, 1, "sum", 0), (np.int8, -128, -1, "prod", -128),
             (np.int32, 65536, 65536, "prod", 0), (np.uint32, 2**32 - 1, 2, "prod", 2**32 - 2),
             (np.int64, 2**63 - 1, 1, "sum", -2**63), (np.uint64, 2**64 - 1, 2**64 - 1, "sum", 2**64 - 2),
             (np.int64, -2**63, -1, "prod", -2**63)]
    for dt, x, y, op, want in cases:
        a, b = np.full(9, x, dt), np.full(9, y, dt)
        assert H.reduce_copy(np.empty_like(a), a, b, op).tolist() == [want] * 9, (dt, op)
        assert H.reference_reduce([a, b], op).tolist() == [want] * 9, (dt, op)


FLOATS = [F16, BF16, np.dtype(np.float32), np.dtype(np.float64)]


@pytest.mark.parametrize("dt", FLOATS, ids=ids(FLOATS))
def test_nan_and_inf(dt):
    nan, inf, big = np.nan, np.inf, float(ml_dtypes.finfo(dt).max)
    a = np.array([inf, nan, inf, big, 1.0, nan, nan, -inf, 0.0], dt)
    b = np.array([-inf, 1.0, 1.0, big, nan, 1.0, nan, nan, inf], dt)

    def run(op):
        return H.reduce_copy(np.empty_like(a), a, b, op).astype(np.float64).tolist()

    def same(got, want):
        return all(g == w or (g != g and w != w) for g, w in zip(got, want))
    assert same(run("sum"), [nan, nan, inf, inf, nan, nan, nan, nan, inf])
    assert same(run("prod"), [-inf, nan, inf, inf, nan, nan, nan, nan, nan])
    # NCCL's fminf/fmaxf (and __hmin/__hmax): a NaN operand loses; NaN only if both are NaN
    assert same(run("min"), [-inf, 1.0, 1.0, big, 1.0, 1.0, nan, -inf, 0.0])
    assert same(run("max"), [inf, 1.0, inf, big, 1.0, 1.0, nan, -inf, inf])


# --- float16 / bfloat16 bit for bit ---------------------------------------------------------------------

def _bits(x):
    return x.view(np.uint16)


@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_16bit_every_pattern_bit_exact(dt, op):
    # numpy's float16 loops and ml_dtypes' bfloat16 loops compute in float32 and round to nearest even
    ref = {"sum": np.add, "prod": np.multiply, "min": np.fmin, "max": np.fmax}[op]
    rng = np.random.default_rng(11)
    for b_bits in (rng.permutation(ALL16), ALL16[::-1].copy(), ALL16 ^ 0x8000):
        a, b = ALL16.view(dt), b_bits.view(dt)
        got = H.reduce_copy(np.empty_like(a), a, b, op)
        with np.errstate(all="ignore"):
            want = ref(a, b)
        anan, bnan = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
        # NaN + NaN may carry either payload (as on hardware); min/max of +0/-0 may pick either zero
        loose = (anan & bnan) | ((a.astype(np.float32) == 0) & (b.astype(np.float32) == 0))
        assert np.array_equal(_bits(got)[~loose], _bits(want)[~loose])
        _assert_same(got, want)


@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
def test_16bit_ties_denormals_overflow(dt):
    if dt == F16:   # 1 + 2**-11 is halfway between 1 and 1 + 2**-10; 65504 + 16 halfway to 65536 (inf)
        cases = [(0x3C00, 0x1000, 0x3C00), (0x3C01, 0x1000, 0x3C02), (0x0001, 0x0001, 0x0002),
                 (0x8001, 0x0001, 0x0000), (0x7BFF, 0x4C00, 0x7C00), (0x7BFF, 0x4BFF, 0x7BFF)]
    else:           # 1 + 2**-8 is halfway between 1 and 1 + 2**-7
        cases = [(0x3F80, 0x3B80, 0x3F80), (0x3F81, 0x3B80, 0x3F82), (0x0001, 0x0001, 0x0002),
                 (0x8001, 0x0001, 0x0000), (0x7F7F, 0x7F7F, 0x7F80), (0x7FC0, 0x3F80, 0x7FC0)]
    a, b, want = (np.array(c, np.uint16) for c in zip(*cases))
    got = H.reduce_copy(np.empty(len(cases), dt), a.view(dt), b.view(dt), "sum")
    assert [hex(v) for v in _bits(got)] == [hex(v) for v in want]
    with np.errstate(all="ignore"):
        assert np.array_equal(_bits(a.view(dt) + b.view(dt)), want)     # numpy / ml_dtypes agree


@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 1000])
def test_16bit_avg_divides_in_float32_and_rounds_once(dt, n):
    x = ALL16.view(dt).copy()
    with np.errstate(all="ignore"):
        want = (x.astype(np.float32) / np.float32(n)).astype(dt)
    assert np.array_equal(_bits(H.postprocess(x, "avg", n)), _bits(want))


def test_float16_numpy_fallback_agrees(monkeypatch):
    # CPUs without F16C use numpy's float16 loops; force that path and compare
    rng = np.random.default_rng(5)
    a, b = _random(rng, F16, 5000), _random(rng, F16, 5000)
    fast = {op: H.postprocess(H.reduce_copy(np.empty_like(a), a, b, op), op, 2) for op in H.OPS}
    monkeypatch.setattr(H, "_k16", (H._kernel16()[0], False))
    for op in H.OPS:
        slow = H.postprocess(H.reduce_copy(np.empty_like(a), a, b, op), op, 2)
        _assert_same(slow, fast[op])


# --- integer AVG: NCCL's FuncSumPostDiv -----------------------------------------------------------------

def _nccl_divide(x, n, signed):
    """FuncSumPostDiv::divide: magnitude, exact unsigned divide, sign back."""
    if signed and x < 0:
        return -((-x) // n)
    return x // n


@pytest.mark.parametrize("dt", [np.int8, np.uint8], ids=["int8", "uint8"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 127, 128, 200, 255, 256, 1000])
def test_integer_avg_every_8bit_value(dt, n):
    x = np.arange(256, dtype=np.uint8).view(dt)
    want = [_nccl_divide(v, n, x.dtype.kind == "i") for v in x.tolist()]
    assert H.postprocess(x.copy(), "avg", n).tolist() == want


def test_integer_avg_truncates_toward_zero_on_the_wrapped_sum():
    x = np.array([-7, 7, -1, 1, -128, 127, -5, 5], np.int8)
    assert H.postprocess(x.copy(), "avg", 2).tolist() == [-3, 3, 0, 0, -64, 63, -2, 2]   # not floor: -4, -1
    # 100 + 100 wraps to -56 in int8; NCCL divides the wrapped sum: -28 (not 100)
    a = np.array([100], np.int8)
    assert H.postprocess(H.reduce_copy(np.empty_like(a), a, a, "avg"), "avg", 2).tolist() == [-28]
    assert H.reference_reduce([a, a], "avg").tolist() == [-28]
    i64 = np.array([-2**63, 2**63 - 1, -10, -2], np.int64)
    assert H.postprocess(i64.copy(), "avg", 3).tolist() == [-(2**63 // 3), (2**63 - 1) // 3, -3, 0]
    u64 = np.array([2**64 - 1, 10], np.uint64)
    assert H.postprocess(u64.copy(), "avg", 3).tolist() == [(2**64 - 1) // 3, 3]


@pytest.mark.parametrize("dt", [np.int32, np.uint32, np.int64, np.uint64], ids=["i4", "u4", "i8", "u8"])
def test_integer_avg_random_matches_python_and_reference(dt):
    rng = np.random.default_rng(9)
    xs = [_random(rng, np.dtype(dt), 3000) for _ in range(5)]
    out = xs[0].copy()
    for x in xs[1:]:
        H.reduce(out, x, "avg")
    H.postprocess(out, "avg", 5)
    want = [_py_reduce([x[i] for x in xs], "avg", np.dtype(dt)) for i in range(3000)]
    assert out.tolist() == want
    assert H.reference_reduce(xs, "avg").tolist() == want


# --- contract ----------------------------------------------------------------------------------------------

def test_postprocess_only_touches_avg():
    for op in ("sum", "prod", "min", "max"):
        x = np.array([7, -7], np.int32)
        assert H.postprocess(x, op, 4).tolist() == [7, -7]
    x = np.array([3.0, -1.5], np.float32)
    assert H.postprocess(x, "avg", 2).tolist() == [1.5, -0.75]


def test_bad_arguments_are_explained():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="unknown reduction op"):
        H.reduce_copy(a, a, a, "xor")
    with pytest.raises(TypeError, match="one dtype"):
        H.reduce_copy(a, a, np.zeros(4, np.float64), "sum")
    with pytest.raises(ValueError, match="1-D of one length"):
        H.reduce_copy(a, a, np.zeros(5, np.float32), "sum")
    with pytest.raises(TypeError, match="not supported"):
        H.reduce_copy(np.zeros(2, np.int16), np.zeros(2, np.int16), np.zeros(2, np.int16), "sum")
    with pytest.raises(ValueError, match="n >= 1"):
        H.postprocess(a, "avg", 0)
    with pytest.raises(ValueError, match="unknown reduction op"):
        H.reference_reduce([a], "mean")
    assert set(H.OPS) == {"sum", "prod", "min", "max", "avg"}
    assert len(H.SUPPORTED_DTYPES) == 10 and all(isinstance(d, np.dtype) for d in H.SUPPORTED_DTYPES)


def test_kernels_never_import_the_core_and_numba_only_lazily():
    here = pathlib.Path(H.__file__).parent
    for path in here.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            # A relative import may name a sibling kernel module (from . import host), never the core.
            sibling = isinstance(node, ast.ImportFrom) and node.level == 1 and all(
                (here / f"{m}.py").exists() for m in ([node.module] if node.module else [a.name for a in node.names]))
            for name in names:
                assert not (name == "ringcomm" or name.startswith("ringcomm.") or
                            (isinstance(node, ast.ImportFrom) and node.level > 0 and not sibling)), (path.name, name)
        if path.name not in ("__init__.py", "host.py"):
            continue
        top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] in ("numba", "llvmlite") for m in top), path.name


def test_ringcomm_imports_ml_dtypes_only_for_bfloat16():
    """ml_dtypes 0.7.0 takes ~0.5 s to import: `import ringcomm` leaves it out until bfloat16 is asked
    for, and a bfloat16 array, which only a program that imported ml_dtypes can have, still counts."""
    import subprocess
    import sys
    code = "\n".join([
        "import sys, numpy as np, ringcomm",
        "from ringcomm.kernels import host, reproducible",
        "f32 = np.dtype(np.float32)",
        "assert host.supported(f32) and not host.is_bfloat16(f32) and reproducible.format_of(f32)",
        "assert not host.supported(np.dtype(np.complex64)) and not host.is_float16ish(f32)",
        "assert 'ml_dtypes' not in sys.modules, 'imported by ringcomm'",
        "import ml_dtypes",
        "bf = np.dtype(ml_dtypes.bfloat16)",
        "assert host.supported(bf) and host.is_bfloat16(bf) and host.is_float16ish(bf)",
        "assert host.as_dtype('bfloat16') == bf and reproducible.format_of('bfloat16').EB == 8",
        "assert host.SUPPORTED_DTYPES[1] == bf and len(host.SUPPORTED_DTYPES) == len(host.DTYPE_NAMES)",
        "print('ok')",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
