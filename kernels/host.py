"""Host (CPU) reduction kernels: the arithmetic the executor applies to every slice it reduces.

    reduce_copy(out, a, b, op)   out = a op b, elementwise (out may be a or b)
    reduce(dst, src, op)         dst = dst op src
    postprocess(arr, op, n)      finish a fully reduced value in place (AVG divides by n)
    reference_reduce(arrays, op) naive left-to-right reference for tests

Arrays are 1-D, of one dtype and one length (numpy arrays, or uint8 shared-memory slots viewed as the dtype).
Ops are strings (OPS); one elementwise op is one rounding, so results are reproducible bit for bit.

Per dtype:
- int8 ... uint64: numpy ufuncs with ``out=`` (one pass, GIL released). SUM/PROD wrap modulo 2**bits like
  NCCL's C++ arithmetic, silently (numpy does not check overflow in array loops).
- float32, float64: numpy ufuncs, IEEE round-to-nearest-even. Floating-point warnings (overflow, inf - inf)
  are silenced: a collective must not raise halfway through because the user runs with ``-W error``.
- float16: each op is computed in float32 and rounded once to float16 -- what numpy's float16 loops do, and
  NCCL's __hadd/__hmul (sm_53+) or __float2half(__half2float(x) + ...) (older GPUs). Because float32 has
  24 >= 2*11 + 2 bits, the detour is exact: the result is the correctly rounded float16 sum or product.
- bfloat16 (ml_dtypes): likewise float32, then round-to-nearest-even (24 >= 2*8 + 2), as ml_dtypes' ufuncs
  and NCCL's __hadd (sm_80+) do.
  numpy's float16 loops and ml_dtypes' bfloat16 loops convert one element at a time (0.5 and 1.7 GB/s here,
  against 30+ GB/s for float32), so both run in one numba kernel on the uint16 bit patterns: float16 through
  LLVM's half<->float conversions (F16C vcvtph2ps/vcvtps2ph; numpy's loops where the CPU lacks them),
  bfloat16 by shifting and rounding the bits. ~20-30 GB/s; compiled at first use (not at import) and
  cached on disk. Tests check it bit for bit against numpy and ml_dtypes over every 16-bit pattern; only
  the payload of NaN + NaN may differ (either input's, as on hardware).

MIN/MAX and NaN. NCCL (src/device/reduce_kernel.h, Apply_Reduce<FuncMinMax>) uses fminf/fmaxf for float and
double, and __hmin/__hmax (sm_80+) or fminf on converted values for half and bfloat16. All of these return
the other operand when one is NaN, so NCCL's MIN/MAX drop NaNs. We do the same (np.fmin/np.fmax, and the
16-bit kernel): the result is NaN only where every contribution is NaN. Which zero min(+0.0, -0.0) returns
is not specified (numpy itself differs between float16 and float32).

AVG. NCCL (src/enqueue.cc, hostToDevRedOp) lowers ncclAvg per type:
- integers -> ncclDevSumPostDiv, argument (nRanks << 1 | isSigned). The reduction is plain wrapping SUM; the
  finished value is divided once (reduce_kernel.h, FuncSumPostDiv::divide): if the type is signed and the
  top bit is set, the magnitude is formed in the unsigned type (so INT_MIN works), divided exactly
  (reciprocal multiply plus a fix-up) and negated back. That is truncation toward zero of the wrapped
  signed sum, and plain floor division for unsigned types. Older NCCL (FuncSumPostDiv_IntOnly) computed
  ``T(x) / divisor`` in C++, which also truncates toward zero. We do exactly this.
- float types -> ncclDevPreMulSum with scalar 1/nRanks rounded to the type: every input is multiplied by
  that scalar before the sum (one more rounding per input, and 1/n itself is inexact). Our spec differs on
  purpose: floats sum, then the finished value is divided by n once; float16 and bfloat16 divide in float32
  and round once, which gives the correctly rounded quotient. (Newest NCCL also has a float FuncSumPostDiv,
  for its symmetric kernels, whose post-op multiplies the finished sum by 1/n rather than dividing.)
"""
import sys
import threading

import numpy as np

OPS = ("sum", "prod", "min", "max", "avg")
FLOAT16 = np.dtype(np.float16)
# numpy's own dtypes; bfloat16 is ml_dtypes', which is imported only when asked for (bfloat16(),
# or BFLOAT16 / SUPPORTED_DTYPES from this module): ml_dtypes 0.7.0 takes ~0.47 s to import, and no
# array can be bfloat16 before its owner has imported ml_dtypes (is_bfloat16 looks in sys.modules).
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "uint32", "int64",
               "uint64")
NUMPY_DTYPES = tuple(np.dtype(n) for n in DTYPE_NAMES if n != "bfloat16")
_bf16 = None   # ml_dtypes' bfloat16 as a numpy dtype, once ml_dtypes is imported


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (importing ml_dtypes)."""
    global _bf16
    if _bf16 is None:
        import ml_dtypes
        _bf16 = np.dtype(ml_dtypes.bfloat16)
    return _bf16


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` (a numpy dtype) is ml_dtypes' bfloat16, without importing ml_dtypes."""
    if _bf16 is None:
        if "ml_dtypes" not in sys.modules:
            return False
        bfloat16()
    return dtype == _bf16


def as_dtype(dtype) -> np.dtype:
    """np.dtype(dtype), the name "bfloat16" included (numpy knows it only once ml_dtypes is imported)."""
    return bfloat16() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)


def supported(dtype) -> bool:
    """Whether ringcomm reduces arrays of this numpy dtype."""
    return dtype in NUMPY_DTYPES or is_bfloat16(dtype)


def is_float16ish(dtype) -> bool:
    """float16 or bfloat16: the two types reduced by the 16-bit loops (_run16)."""
    return dtype == FLOAT16 or is_bfloat16(dtype)


def __getattr__(name):
    """BFLOAT16 and SUPPORTED_DTYPES (in DTYPE_NAMES' order), made at first use: they import ml_dtypes."""
    if name == "BFLOAT16":
        return bfloat16()
    if name == "SUPPORTED_DTYPES":
        return tuple(as_dtype(n) for n in DTYPE_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Native dtypes: one ufunc per (dtype, op). AVG reduces like SUM; its division is postprocess's job.
_NATIVE = {}
for _dt in NUMPY_DTYPES[1:]:
    _float = _dt.kind == "f"
    _NATIVE.update({(_dt, "sum"): np.add, (_dt, "avg"): np.add, (_dt, "prod"): np.multiply,
                    (_dt, "min"): np.fmin if _float else np.minimum,     # fmin: NaN-dropping, like fminf
                    (_dt, "max"): np.fmax if _float else np.maximum})
del _dt, _float
_CODE16 = {"sum": 0, "avg": 0, "prod": 1, "min": 2, "max": 3}           # opcodes of _loop16; 4 = divide


def _check(out, *ins):
    for x in ins:
        if x.dtype != out.dtype:
            raise TypeError(f"reduction operands must share one dtype, got {x.dtype} and {out.dtype}")
        if x.shape != out.shape or out.ndim != 1:
            raise ValueError(f"reduction operands must be 1-D of one length, got {x.shape} and {out.shape}")


def _unsupported(op, dtype):
    if op not in OPS:
        return ValueError(f"unknown reduction op {op!r}; expected one of {OPS}")
    return TypeError(f"dtype {dtype} is not supported; expected one of {list(DTYPE_NAMES)}")


def reduce_copy(out, a, b, op):
    """out = a op b elementwise and return out; out may be the very same array as a or b."""
    _check(out, a, b)
    ufunc = _NATIVE.get((out.dtype, op))
    if ufunc is not None:
        if out.dtype.kind == "f":
            with np.errstate(all="ignore"):     # ~0.7 us; NCCL does not trap on overflow or inf - inf
                ufunc(a, b, out=out)
        else:
            ufunc(a, b, out=out)
        return out
    code = _CODE16.get(op)
    if code is None or not is_float16ish(out.dtype):
        raise _unsupported(op, out.dtype)
    _run16(out, a, b, code, np.float32(1))
    return out


def elementwise(op, dtype):
    """The bare function ``f(a, b, out=out)`` computing out = a op b for this dtype: no checks.

    For the executor's hot path, which resolves it once per call, checks shapes itself, and
    silences floating-point warnings once around the whole call (np.errstate costs ~0.7 us).
    """
    dtype = np.dtype(dtype)
    ufunc = _NATIVE.get((dtype, op))
    if ufunc is not None:
        return ufunc
    code = _CODE16.get(op)
    if code is None or not is_float16ish(dtype):
        raise _unsupported(op, dtype)
    one = np.float32(1)

    def f16(a, b, out):
        _run16(out, a, b, code, one)
        return out
    return f16


def reduce(dst, src, op):
    """dst = dst op src elementwise, in place; return dst."""
    return reduce_copy(dst, dst, src, op)


def postprocess(arr, op, n):
    """Finish a fully reduced value in place: AVG divides by n (see the module docstring); others no-op."""
    if op != "avg":
        if op not in OPS:
            raise _unsupported(op, arr.dtype)
        return arr
    n = int(n)
    if n < 1:
        raise ValueError(f"AVG needs the number of contributions n >= 1, got {n}")
    dt = arr.dtype
    if dt.kind in "iu" and dt in NUMPY_DTYPES:
        _int_avg(arr, n)
    elif is_float16ish(dt):
        _run16(arr, arr, arr, 4, np.float32(n))
    elif dt in NUMPY_DTYPES:
        with np.errstate(all="ignore"):
            np.divide(arr, n, out=arr)          # n converts to the array's float type (NEP 50)
    else:
        raise _unsupported(op, dt)
    return arr


def _int_avg(arr, n):
    # NCCL's FuncSumPostDiv::divide: magnitude in the unsigned type, exact divide, sign back. Branch-free
    # with m = x >> (bits-1) (all ones iff x < 0): |x| = (x ^ m) - m, and back the same way.
    u = arr.view(arr.dtype.str.replace("i", "u"))
    if n > np.iinfo(u.dtype).max:               # every |sum| < n: quotient 0 (NCCL: recip 0, then fix-up)
        u[...] = 0
    elif arr.dtype.kind == "u":
        np.floor_divide(u, n, out=u)
    else:
        m = np.right_shift(arr, 8 * arr.itemsize - 1).view(u.dtype)
        for step in (np.bitwise_xor, np.subtract):      # unsigned: INT_MIN -> 2**(bits-1), wraps silently
            step(u, m, out=u)
        np.floor_divide(u, n, out=u)
        for step in (np.bitwise_xor, np.subtract):
            step(u, m, out=u)


def reference_reduce(arrays, op):
    """Naive reference: ((x0 op x1) op x2) ..., then AVG's division; returns a new array.

    Built from plain numpy / ml_dtypes ufuncs (one rounding per op) and an independent integer division,
    not from the kernels above, so tests can compare the two.
    """
    if op not in OPS:
        raise _unsupported(op, None)
    arrays = [np.asarray(x) for x in arrays]
    if not arrays:
        raise ValueError("reference_reduce needs at least one array")
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.fmin, "max": np.fmax}[op]
    acc = arrays[0].copy()
    with np.errstate(all="ignore"):
        for x in arrays[1:]:
            acc = fn(acc, x)
        if op == "avg":
            acc = _reference_avg(acc, len(arrays))
    return acc


def _reference_avg(acc, n):
    dt = acc.dtype
    if dt.kind == "i":                          # truncate toward zero: remove C's remainder, then divide
        w = acc.astype(np.int64)
        return ((w - np.fmod(w, n)) // n).astype(dt)
    if dt.kind == "u":
        return (acc.astype(np.uint64) // np.uint64(n)).astype(dt)
    if dt.itemsize == 2:                        # float16 / bfloat16: float32 quotient, rounded once
        return (acc.astype(np.float32) / np.float32(n)).astype(dt)
    return acc / dt.type(n)


# --- float16 / bfloat16 kernel ------------------------------------------------------------------------
# Plain Python below; _compile16 turns it into numba code on first use, so importing this module does not
# import numba (0.25 s) and nothing is compiled until a 16-bit float is reduced. Integers in these helpers
# are numba's int64, wide enough that no bit manipulation of a 32-bit pattern overflows.
_h2f = _f2h = None          # float16 <-> float32 conversions, LLVM fpext/fptrunc (F16C): set by _compile16


def _u2f(u):                                    # low 32 bits -> the float32 with that bit pattern
    return np.uint32(u).view(np.float32)


def _f2u(f):                                    # float32 -> its bit pattern
    return np.int64(np.float32(f).view(np.uint32))


def _dec16(h, fp16):
    """16-bit pattern -> float32, exactly."""
    if fp16:
        return _h2f(h)
    return _u2f(np.int64(h) << 16)              # bfloat16 is the top half of a float32


def _enc16(f, fp16):
    """float32 -> 16-bit pattern, rounding to nearest, ties to even."""
    if fp16:
        return _f2h(f)                          # IEEE conversion: RNE, overflow to inf, subnormals kept
    u = _f2u(f)
    if f != f:                                  # NaN: a quiet NaN with its sign, as ml_dtypes makes
        return np.uint16(((u >> 16) & 0x8000) | 0x7FC0)
    # Add just under half an ulp, plus one if the kept lsb is odd: ties go to even, and a carry into the
    # exponent is the correct rounding (up to inf).
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def _pick(ha, hb, take_a):
    # Branch-free select of a bit pattern (a branch on random data mispredicts half the time and
    # keeps the loop scalar): the mask is all ones when take_a.
    return np.uint16(hb ^ ((ha ^ hb) & -np.int64(take_a)))


def _apply16(out, a, b, op, fp16, d):
    # One loop per op: a switch inside the loop would stop LLVM from vectorising it.
    n = out.size
    if op == 0:
        for i in range(n):
            out[i] = _enc16(_dec16(a[i], fp16) + _dec16(b[i], fp16), fp16)
    elif op == 1:
        for i in range(n):
            out[i] = _enc16(_dec16(a[i], fp16) * _dec16(b[i], fp16), fp16)
    elif op == 2:                               # fmin: a NaN operand loses, like fminf / __hmin
        for i in range(n):
            x, y = _dec16(a[i], fp16), _dec16(b[i], fp16)
            out[i] = _pick(a[i], b[i], (x < y) | (y != y))
    elif op == 3:
        for i in range(n):
            x, y = _dec16(a[i], fp16), _dec16(b[i], fp16)
            out[i] = _pick(a[i], b[i], (x > y) | (y != y))
    else:                                       # AVG's division (postprocess); b is unused
        for i in range(n):
            out[i] = _enc16(_dec16(a[i], fp16) / d, fp16)


def _loop16(out, a, b, op, fp16, d):
    # Element i of a and b is read before out[i] is written, so out may be a or b. But LLVM vectorises
    # only behind a run-time "no overlap" check, which fails when out *is* a or b: the scalar fallback is
    # 60x slower. So read such an input through out itself (_apply16 is inlined): one pointer, distance 0,
    # vectorised. (Never write through a or b: they may be read-only.)
    same_a = out.ctypes.data == a.ctypes.data and out.strides == a.strides
    same_b = out.ctypes.data == b.ctypes.data and out.strides == b.strides
    if same_a and same_b:
        _apply16(out, out, out, op, fp16, d)
    elif same_a:
        _apply16(out, out, b, op, fp16, d)
    elif same_b:
        _apply16(out, a, out, op, fp16, d)
    else:
        _apply16(out, a, b, op, fp16, d)


def _f16_numpy(out, a, b, op, d):
    # Fallback for CPUs whose LLVM target lacks float16 conversions: numpy's loops, exact but ~0.5 GB/s.
    with np.errstate(all="ignore"):
        if op == 4:
            np.copyto(out, a.astype(np.float32) / d, casting="same_kind")
        else:
            (np.add, np.multiply, np.fmin, np.fmax)[op](a, b, out=out)


def _run16(out, a, b, op, d):
    kernel, hw_f16 = _kernel16()
    if out.dtype == FLOAT16 and not hw_f16:
        return _f16_numpy(out, a, b, op, d)
    kernel(out.view(np.uint16), a.view(np.uint16), b.view(np.uint16), op, out.dtype == FLOAT16, d)


_lock = threading.Lock()
_k16 = None


def _kernel16():
    global _k16
    if _k16 is None:
        with _lock:
            if _k16 is None:
                _k16 = _compile16()
    return _k16


def _compile16():
    import platform

    import llvmlite.binding as llvm
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    # fpext/fptrunc on half are one instruction with x86 F16C or on aarch64; elsewhere LLVM would call a
    # runtime helper the JIT may lack, so float16 falls back to numpy there.
    machine = platform.machine().lower()
    hw_f16 = machine in ("aarch64", "arm64") or (
        machine in ("x86_64", "amd64") and bool(llvm.get_host_cpu_features().get("f16c")))

    @intrinsic
    def h2f(typingctx, h):
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def f2h(typingctx, f):
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen

    g = globals()
    if hw_f16:
        g["_h2f"], g["_f2h"] = h2f, f2h
    else:                                       # never reached for float16 (see _run16); keeps LLVM happy
        g["_h2f"] = numba.njit(lambda h: np.float32(0))
        g["_f2h"] = numba.njit(lambda f: np.uint16(0))
    for name in ("_u2f", "_f2u", "_dec16", "_enc16", "_pick"):  # looked up as globals when compiling
        g[name] = numba.njit(g[name])
    g["_apply16"] = numba.njit(inline="always")(_apply16)
    # nogil: executor threads reduce in parallel; cache: ranks are processes, compile once per machine.
    # error_model="numpy": no ZeroDivisionError check in the division loop, which would stop vectorising.
    return numba.njit(nogil=True, cache=True, error_model="numpy")(_loop16), hw_f16
