"""Device (CUDA) reduction kernels, numba.cuda: the same arithmetic as ringcomm.kernels.host, bit for bit.

    reduce_copy(out, a, b, op, stream=None)   out = a op b, elementwise (out may be a or b)
    reduce(dst, src, op, stream=None)         dst = dst op src
    postprocess(arr, op, n, stream=None)      finish a fully reduced value in place (AVG divides by n)
    copy(dst, src, stream=None)               dst = src, a device-to-device cudaMemcpyAsync

Arrays are 1-D device arrays of one dtype and length: numba device arrays, or anything with
``__cuda_array_interface__`` (cupy, torch; taken without synchronising, see below). The work is queued on
``stream`` (a numba stream, a cupy or torch stream, or a raw ``cudaStream_t`` as an int; None is the
legacy default stream) and nothing waits for it: order it against the arrays' producers yourself.

Per dtype (every rule is host.py's; its docstring says why each one is NCCL's):
- int8 ... uint64: integer arithmetic, SUM and PROD wrap modulo 2**bits. AVG's division is NCCL's
  FuncSumPostDiv: the magnitude in uint64, divided, the sign put back (truncation toward zero).
- float32, float64: IEEE round-to-nearest-even; numba compiles without fast-math, so no flush to zero,
  no contraction and an exactly rounded division.
- float16 (numba float16) and bfloat16 (no numba type: carried as its uint16 bit pattern) are widened to
  float32 (exactly), computed there and rounded once to nearest even: correctly rounded, since float32 has
  24 >= 2 * 11 + 2 bits. float16 narrows with the hardware's cvt.rn.f16.f32; bfloat16 rounds its bits
  here with the same integer trick as host.py, NaNs becoming a quiet NaN of their sign as ml_dtypes does.
- MIN / MAX drop NaN like fminf / fmaxf: the result is NaN only where both operands are.

One kernel body serves every (op, dtype); the op and the dtype's kind are closure constants, so numba
folds the other branches away and each compiled kernel is straight-line code inside a grid-stride loop.
Kernels compile on first use (about 0.3 s each), or ahead of it for explicit argument types with
prepare(op, dtype) (the device path does so before a call's first slice), and stay cached in this process.

Why no device functions: numba compiles a called @cuda.jit(device=True) function for the *current*
device, so compile_ptx (used by the tests to build every kernel for sm_90 on machines without a GPU)
fails on one. The only primitives that need code of their own, the float32 <-> bits casts, are
intrinsics (a bitcast in LLVM IR), with numpy twins under the CUDA simulator.
"""
from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

try:
    from numba import config as _numba_config
    from numba import cuda
except ImportError as e:                            # numba >= 0.61 no longer ships numba.cuda itself
    raise ImportError("ringcomm's device kernels need numba-cuda: pip install 'ringcomm[cuda]'") from e

OPS = ("sum", "prod", "min", "max", "avg")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
    np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64))
SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)


def _restore_row_stack() -> None:
    """numba-cuda up to at least 0.30.4 registers a CUDA overload for ``np.row_stack`` when it compiles its
    first kernel; NumPy 2.5 removed that name (an alias of ``np.vstack`` since 2.0), so on NumPy 2.5 every
    kernel compile fails with "module 'numpy' has no attribute 'row_stack'" (seen on an H200 with
    numpy 2.5.2 and numba-cuda 0.30.4; numba itself guards the same line). Put the alias back, only where it
    is missing."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


_restore_row_stack()

SUM, PROD, MIN, MAX, DIV = range(5)                 # opcodes; AVG reduces as SUM, DIV is its postprocess
_OPCODE = {"sum": SUM, "avg": SUM, "prod": PROD, "min": MIN, "max": MAX}
INT, UINT, FLOAT, F16, BF16 = range(5)              # how a dtype computes


def _kind(dt: np.dtype) -> int:
    if dt == BFLOAT16:
        return BF16
    if dt == np.float16:
        return F16
    return {"i": INT, "u": UINT, "f": FLOAT}[dt.kind]


# --- float32 <-> bit pattern ---------------------------------------------------------------------------
if SIMULATOR:
    _NumbaStream = type(None)

    def _u2f(u):                                    # low 32 bits -> the float32 with that pattern
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)

    def _f2u(f):                                    # float32 -> its pattern, a non-negative int
        return int(np.float32(f).view(np.uint32))
else:
    from llvmlite import ir
    from numba.cuda.cudadrv.driver import Stream as _NumbaStream
    try:
        from numba.cuda import types
        from numba.cuda.extending import intrinsic
    except ImportError:                             # older numba-cuda: numba core's extension API
        from numba.core import types
        from numba.core.extending import intrinsic

    @intrinsic
    def _u2f(typingctx, u):
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v, width = args[0], u.bitwidth
            if width > 32:
                v = builder.trunc(v, ir.IntType(32))
            elif width < 32:
                v = builder.zext(v, ir.IntType(32))
            return builder.bitcast(v, ir.FloatType())
        return types.float32(u), codegen

    @intrinsic
    def _f2u(typingctx, f):
        if f != types.float32:
            return None

        def codegen(context, builder, sig, args):   # zero-extended to int64: no sign surprises in >>
            return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))
        return types.int64(f), codegen


# --- the kernel -----------------------------------------------------------------------------------------
def _make_kernel(OP: int, KIND: int):
    """The Python kernel for one (opcode, kind): out[i] = a[i] OP b[i], or a[i] / d for DIV.

    Every element is read before it is written by the same thread, so out may alias a or b."""
    PER = per_thread(KIND)

    def kernel(out, a, b, d):
        # PER elements a trip, PER grid-widths apart: every load stays coalesced, and each thread has
        # PER independent loads in flight (16-bit types: 2, so a thread moves 4 bytes a trip).
        i0 = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i0 < out.size:
            for u in range(PER):
                i = i0 + u * stride
                if i >= out.size:
                    break
                if KIND == INT or KIND == UINT or KIND == FLOAT:
                    x = a[i]
                    y = b[i]
                    if OP == SUM:
                        out[i] = x + y                  # integers: widened, then truncated on store = wrap
                    elif OP == PROD:
                        out[i] = x * y
                    elif OP == MIN:
                        out[i] = x if x < y or y != y else y    # y != y: NaN loses (integers: never)
                    elif OP == MAX:
                        out[i] = x if x > y or y != y else y
                    elif KIND == FLOAT:
                        out[i] = x / d
                    elif KIND == UINT:
                        out[i] = np.uint64(x) // d
                    else:                               # widen first, so INT_MIN's magnitude is exact
                        w = np.int64(x)
                        if w < 0:
                            out[i] = -np.int64(np.uint64(-w) // d)
                        else:
                            out[i] = np.int64(np.uint64(w) // d)
                else:
                    ha = a[i]
                    hb = b[i]
                    if KIND == F16:
                        x = np.float32(ha)
                        y = np.float32(hb)
                    else:                               # bfloat16 is the top half of a float32
                        x = _u2f(np.uint32(ha) << 16)
                        y = _u2f(np.uint32(hb) << 16)
                    if OP == MIN:
                        out[i] = ha if x < y or y != y else hb  # pick the bits: no rounding, NaN payloads kept
                    elif OP == MAX:
                        out[i] = ha if x > y or y != y else hb
                    else:
                        if OP == SUM:
                            r = x + y
                        elif OP == PROD:
                            r = x * y
                        else:
                            r = x / d
                        if KIND == F16:
                            out[i] = np.float16(r)
                        else:
                            u = _f2u(r)
                            if r != r:                  # a quiet NaN with its sign, as ml_dtypes makes
                                out[i] = ((u >> 16) & 0x8000) | 0x7FC0
                            else:                       # just under half an ulp, plus 1 if the kept lsb is
                                out[i] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16   # odd: ties to even
            i0 += stride * PER
    kernel.__name__ = kernel.__qualname__ = f"ringcomm_{_OPNAME[OP]}_{_KINDNAME[KIND]}"
    return kernel


def per_thread(kind: int) -> int:
    """Elements a thread handles per trip of the grid-stride loop: 2 for the 16-bit types."""
    return 2 if kind in (F16, BF16) else 1


_OPNAME = ("sum", "prod", "min", "max", "div")
_KINDNAME = ("int", "uint", "float", "f16", "bf16")


def _scalar(kind: int, dt: np.dtype, n):
    """The d argument: AVG's divisor in the type the kernel divides in (unused by the other ops)."""
    if kind in (INT, UINT):
        return np.uint64(n)
    return np.float32(n) if kind in (F16, BF16) else dt.type(n)


def _carried(dt: np.dtype) -> np.dtype:
    """The dtype the kernel sees: bfloat16 travels as its uint16 bits."""
    return np.dtype(np.uint16) if dt == BFLOAT16 else dt


def _argtypes(kind: int, carried: np.dtype) -> tuple:
    """The kernel's numba argument types: three 1-D C-contiguous arrays of the carried dtype, and d."""
    from numba.core import types as core_types
    from numba.np.numpy_support import from_dtype
    arr = core_types.Array(from_dtype(carried), 1, "C")
    return arr, arr, arr, from_dtype(np.asarray(_scalar(kind, carried, 1)).dtype)


def kernel_source(op_code: int, dt: np.dtype):
    """(python kernel, numba argument types) a launch of (op_code, dt) compiles; for compile_ptx in tests."""
    dt = np.dtype(dt)
    kind = _kind(dt)
    return _make_kernel(op_code, kind), _argtypes(kind, _carried(dt))


_cache: dict = {}
_lock = threading.Lock()


def _kernel(op_code: int, kind: int, carried: np.dtype):
    """The kernel of (op_code, the carried dtype), compiled for its explicit argument types when first
    asked for (about 0.3 s): numba's specialized dispatcher, so a launch goes straight to its one
    overload, with no typing of the arguments per launch. The simulator compiles nothing."""
    key = (op_code, kind, carried)
    k = _cache.get(key)
    if k is None:
        with _lock:
            k = _cache.get(key)
            if k is None:
                fn = _make_kernel(op_code, kind)
                k = _cache[key] = cuda.jit(fn) if SIMULATOR else cuda.jit(_argtypes(kind, carried))(fn)
    return k


def prepare(op, dt) -> None:
    """Compile now, for their explicit argument types, the kernels a call of (op, dt) launches: a device
    call compiles before its first slice, not in the middle of its pipeline (about 0.3 s a kernel).
    The simulator compiles nothing."""
    dt = np.dtype(dt)
    kind = _kind_of(dt, op)
    key = (op, dt)
    if SIMULATOR or key in _prepared:
        return
    for code in entry_kernels("reduce", op, dt) + entry_kernels("postprocess", op, dt):
        _kernel(code, kind, _carried(dt))
    _prepared.add(key)


_prepared: set = set()


# --- launching ------------------------------------------------------------------------------------------
THREADS = 32 if SIMULATOR else 256      # the simulator runs one Python thread per CUDA thread
BLOCKS_PER_SM = 8                       # 2048 resident threads per SM / 256: one full wave
_streams: dict = {}
_sms: int | None = None


def launch_config(n: int) -> tuple[int, int]:
    """(blocks, threads) for n elements: enough blocks to fill every SM once, no more than n needs;
    the grid-stride loop covers the rest, so a launch costs the same whatever the slice size."""
    global _sms
    if _sms is None:                    # asked once: the device query costs more than the launch
        _sms = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", 2)    # the simulator has none
    sms = _sms
    return max(1, min(-(-n // THREADS), sms * BLOCKS_PER_SM)), THREADS


def as_stream(stream):
    """A numba stream for None / 0 (legacy default), a numba, cupy (.ptr) or torch (.cuda_stream)
    stream, or a raw cudaStream_t int."""
    if SIMULATOR or stream is None:
        return 0
    if isinstance(stream, _NumbaStream):
        return stream
    ptr = stream if isinstance(stream, (int, np.integer)) else getattr(stream, "ptr", None)
    if ptr is None:
        ptr = getattr(stream, "cuda_stream", None)
    if ptr is None:
        raise TypeError(f"not a CUDA stream: {stream!r} (expected a numba, cupy or torch stream or an int)")
    ptr = int(ptr)
    if ptr == 0:
        return 0
    s = _streams.get(ptr)
    if s is None:
        s = _streams[ptr] = cuda.external_stream(ptr)
    return s


def as_device_array(x, what: str = "array"):
    """A numba device array viewing x (no copy, no synchronisation)."""
    if getattr(x, "__cuda_ndarray__", False):
        return x
    if not SIMULATOR and hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x, sync=False)
    raise TypeError(f"{what} must be a CUDA device array (numba, cupy, torch), got {type(x).__name__}")


def _check(out, *ins):
    for x in ins:
        if x.dtype != out.dtype:
            raise TypeError(f"reduction operands must share one dtype, got {x.dtype} and {out.dtype}")
        if tuple(x.shape) != tuple(out.shape) or len(out.shape) != 1:
            raise ValueError(f"reduction operands must be 1-D of one length, got {x.shape} and {out.shape}")


def _kind_of(dt: np.dtype, op) -> int:
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {OPS}")
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dt} is not supported; expected one of {[str(d) for d in SUPPORTED_DTYPES]}")
    return _kind(dt)


def _launch(code, kind, out, a, b, d, stream):
    n = out.size
    if n == 0:
        return
    if kind == BF16:
        out, a, b = out.view(np.uint16), a.view(np.uint16), b.view(np.uint16)
    blocks, threads = launch_config(-(-n // per_thread(kind)))
    _kernel(code, kind, np.dtype(out.dtype))[blocks, threads, as_stream(stream)](out, a, b, d)


def reduce_copy(out, a, b, op, stream=None):
    """out = a op b elementwise, queued on stream; return out (out may be a or b)."""
    out, a, b = as_device_array(out, "out"), as_device_array(a, "a"), as_device_array(b, "b")
    _check(out, a, b)
    kind = _kind_of(np.dtype(out.dtype), op)
    _launch(_OPCODE[op], kind, out, a, b, _scalar(kind, out.dtype, 0), stream)
    return out


def reduce(dst, src, op, stream=None):
    """dst = dst op src elementwise, in place, queued on stream; return dst."""
    return reduce_copy(dst, dst, src, op, stream)


def postprocess(arr, op, n, stream=None):
    """Finish a fully reduced value in place: AVG divides by n (host.py's rules); other ops do nothing."""
    arr = as_device_array(arr, "arr")
    kind = _kind_of(np.dtype(arr.dtype), op)
    if op != "avg":
        return arr
    n = int(n)
    if n < 1:
        raise ValueError(f"AVG needs the number of contributions n >= 1, got {n}")
    _launch(DIV, kind, arr, arr, arr, _scalar(kind, arr.dtype, n), stream)
    return arr


def copy(dst, src, stream=None):
    """dst = src, device to device (cudaMemcpyAsync on stream); return dst."""
    dst, src = as_device_array(dst, "dst"), as_device_array(src, "src")
    if dst.dtype != src.dtype or tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy needs one dtype and shape, got {dst.dtype}{dst.shape} and {src.dtype}{src.shape}")
    if dst.size:
        if dst.dtype == BFLOAT16:                   # numba knows no bfloat16: copy the bits
            dst, src = dst.view(np.uint16), src.view(np.uint16)
        dst.copy_to_device(src, stream=as_stream(stream))
    return dst


def entry_kernels(entry: str, op: str, dt) -> list[int]:
    """The opcodes an entry point (reduce, reduce_copy, postprocess) launches for op: what tests compile."""
    _kind_of(np.dtype(dt), op)
    if entry in ("reduce", "reduce_copy"):
        return [_OPCODE[op]]
    if entry == "postprocess":
        return [DIV] if op == "avg" else []
    raise ValueError(f"unknown entry point {entry!r}")
