"""Reduction bodies for compiled (numba nopython) code: the host kernels' arithmetic, callable from a jitted loop.

    reduce_into(out, a, b, op, kind16)   out = a op b elementwise (out may be a or b)
    avg_into(arr, n, kind16)             AVG's division of a finished value, in place
    compiled()                           the two, compiled with numba (first call: import numba)

Arrays are 1-D and of one numba dtype; float16 and bfloat16 arrive as their uint16 bit patterns with
``kind16`` = KIND_F16 or KIND_BF16 (0 for every other dtype). Opcodes are OPCODES[op].

Same bits as ringcomm.kernels.host, by construction rather than by re-derivation:
- float16 / bfloat16 call host's own 16-bit code (_loop16: float32 arithmetic rounded once).
- float32 / float64 SUM and PROD are one IEEE operation per element, as numpy's ufuncs; integers wrap
  (numba widens the operands and the store truncates: the bits of the wrapped result).
- MIN / MAX on floats drop NaNs like np.fmin / np.fmax: ``a if a < b or b is NaN else b`` -- the rule of
  host's 16-bit kernel, and what numpy's own SIMD loops compute. (numpy's scalar tail loops pick the
  other zero of min(+0.0, -0.0) and the other payload of min(NaN, NaN): host.py leaves both unspecified.)
- AVG divides once at the end: floats by n in their own type (NEP 50: np.divide(arr, n)), integers by
  truncation toward zero of the wrapped sum (NCCL's FuncSumPostDiv, host._int_avg).
"""
from __future__ import annotations

import threading

import numpy as np

from . import host

OPCODES = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 0}   # AVG reduces as SUM; avg_into finishes it
KIND_F16, KIND_BF16 = 1, 2


def kind16(dtype) -> int:
    """KIND_F16 / KIND_BF16 for the 16-bit floats, else 0."""
    dtype = np.dtype(dtype)
    return KIND_F16 if dtype == host.FLOAT16 else KIND_BF16 if host.is_bfloat16(dtype) else 0


def storage(dtype) -> np.dtype:
    """The dtype the compiled code sees: uint16 bit patterns for the 16-bit floats."""
    return np.dtype(np.uint16) if kind16(dtype) else np.dtype(dtype)


def supported(dtype) -> bool:
    """Whether the compiled bodies give host's bits for ``dtype`` here: float16 needs the CPU's
    half conversions (host falls back to numpy's loops without them, and so do we, to Python)."""
    dtype = np.dtype(dtype)
    if not host.supported(dtype):
        return False
    return dtype != host.FLOAT16 or host._kernel16()[1]


# Plain Python below, compiled by compiled(): importing this module does not import numba.

def _reduce16(out, a, b, op, kind16):
    _loop16(out, a, b, op, kind16 == 1, np.float32(1))


def _reduce_plain(out, a, b, op, kind16):
    if out.ctypes.data == a.ctypes.data:
        _reduce_onto(out, b, op)
        return
    n = out.size
    # One loop per op: a switch inside the loop would stop LLVM from vectorising it.
    if op == 0:
        for i in range(n):
            out[i] = a[i] + b[i]
    elif op == 1:
        for i in range(n):
            out[i] = a[i] * b[i]
    elif op == 2:
        for i in range(n):
            x, y = a[i], b[i]
            out[i] = x if (x < y) | (y != y) else y      # y != y only for a float NaN
    else:
        for i in range(n):
            x, y = a[i], b[i]
            out[i] = x if (x > y) | (y != y) else y


def _reduce_onto(out, b, op):
    """out = out op b, as _reduce_plain with a = out: an in-place step's reduction, and every
    further source of a multi-source step (it folds onto the value). Its own loops because LLVM
    vectorises a loop only where a run-time check finds the arrays apart, and out = a fails it:
    float32 sums of 32 KiB took 2.0 us instead of 0.7 (0.6 now). On the 2-core VM no collective
    showed it (2-rank in-place all_reduce and reduce_scatter, 3-rank one-shot, A/B within noise)."""
    n = out.size
    if op == 0:
        for i in range(n):
            out[i] = out[i] + b[i]
    elif op == 1:
        for i in range(n):
            out[i] = out[i] * b[i]
    elif op == 2:
        for i in range(n):
            x, y = out[i], b[i]
            out[i] = x if (x < y) | (y != y) else y
    else:
        for i in range(n):
            x, y = out[i], b[i]
            out[i] = x if (x > y) | (y != y) else y


def _avg16(arr, n, kind16):
    _loop16(arr, arr, arr, 4, kind16 == 1, np.float32(n))


def _avg_float(arr, d):
    # d is n in the array's own float type, as np.divide(arr, n) converts it (NEP 50)
    for i in range(arr.size):
        arr[i] = arr[i] / d


def _avg_signed(arr, n):
    # host._int_avg: divide the magnitude (formed in the unsigned type, so INT_MIN works), sign back.
    # int64 holds every narrower value; for int64 itself the unsigned magnitude of INT64_MIN is 2**63.
    un = np.uint64(n)
    for i in range(arr.size):
        x = np.int64(arr[i])
        mag = np.uint64(-x) if x < 0 else np.uint64(x)
        q = mag // un
        arr[i] = -np.int64(q) if x < 0 else np.int64(q)


def _avg_unsigned(arr, n):
    un = np.uint64(n)
    for i in range(arr.size):
        arr[i] = np.uint64(arr[i]) // un


_lock = threading.Lock()
_compiled = None
_loop16 = None                                  # set by compiled(): host's 16-bit loop, jitted


def compiled():
    """(reduce_into, avg_into) as numba functions, callable from other jitted code. Compiled lazily
    for each signature a caller needs, and linked into the caller, whose disk cache holds them."""
    global _compiled
    if _compiled is None:
        with _lock:
            if _compiled is None:
                _compiled = _compile()
    return _compiled


def _compile():
    import numba
    from numba.core import types
    from numba.extending import overload

    # host's own compiled 16-bit loop (and its disk cache): called with the signature host uses.
    globals()["_loop16"] = host._kernel16()[0]
    jit = numba.njit(error_model="numpy")      # LLVM inlines these into the caller
    globals()["_reduce_onto"] = jit(_reduce_onto)   # what _reduce_plain calls, found when it compiles
    r16, rplain = jit(_reduce16), jit(_reduce_plain)
    a16, afloat, asigned, aunsigned = jit(_avg16), jit(_avg_float), jit(_avg_signed), jit(_avg_unsigned)

    # The body is picked by element type when the caller is compiled: uint16 storage is always a
    # 16-bit float (ringcomm has no uint16), and only that branch may call host's 16-bit code.
    def reduce_into(out, a, b, op, kind16):
        pass

    def avg_into(arr, n, kind16):
        pass

    @overload(reduce_into)
    def _reduce_impl(out, a, b, op, kind16):
        if out.dtype == types.uint16:
            return lambda out, a, b, op, kind16: r16(out, a, b, op, kind16)
        return lambda out, a, b, op, kind16: rplain(out, a, b, op, kind16)

    @overload(avg_into)
    def _avg_impl(arr, n, kind16):
        dt = arr.dtype
        if dt == types.uint16:
            return lambda arr, n, kind16: a16(arr, n, kind16)
        if dt == types.float32:
            return lambda arr, n, kind16: afloat(arr, np.float32(n))
        if dt == types.float64:
            return lambda arr, n, kind16: afloat(arr, np.float64(n))
        if isinstance(dt, types.Integer) and dt.signed:
            return lambda arr, n, kind16: asigned(arr, n)
        return lambda arr, n, kind16: aunsigned(arr, n)

    return reduce_into, avg_into
