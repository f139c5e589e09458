"""Large local copies past the caches: ``copy(out, src)`` is ``out[...] = src``, with non-temporal
stores from STREAM_MIN_BYTES.

An ordinary store must first own its cache line: the core reads the line from memory, then
writes it back, so copying N bytes moves 3N over the memory bus. A non-temporal store writes a
whole line without reading it first (2N), and leaves it out of the caches, which a copy far
bigger than the caches would only flush anyway. glibc's memcpy switches to such stores on its
own, but on this VM (AMD EPYC, 32 MiB L3, 2 vCPUs) its large copies run at 11-13 GB/s where one
64-byte vector store per line (native_sync.stream_line) runs at 17-18 GB/s on one core, and
14.6-15.3 against 11.2-11.5 with the other core copying too (docs/06, "Copies past the caches").

Where it is used: the one-copy engine's large copies (read_engine.py, and read_native.py's
compiled calls by address): an out-of-place all_gather's own block, and the copies out of, or
into, a peer's registered buffer; and by its own loop, a reducing step's big output out of place
(fetch_reduce.STREAM, from read_engine.STREAM_OUT_MIN_BYTES, or STREAM_FINAL_OUT_MIN_BYTES where no
step reads an output back), where enabled() says so. Below STREAM_MIN_BYTES memcpy wins: the
buffers then stay in L2/L3, where an ordinary copy runs at ~45 GB/s and the next reader finds the
data in cache. The FIFO slots keep ordinary stores (or their own streaming), and so do
reductions' outputs built by numpy (registered buffers): streamed by a second pass, they measured
slower (docs/06).

x86-64 only (measured there); elsewhere, or for overlapping or non-contiguous arrays, numpy
copies. RINGCOMM_STREAM_COPY=0 turns it off.
"""
from __future__ import annotations

import platform
import threading

import numpy as np

from . import native_sync
from .env import env_switch

STREAM_MIN_BYTES = 8 << 20   # measured, docs/06 "Copies past the caches": 2-rank all_gather, 16 MiB and up
X86 = platform.machine().lower() in ("x86_64", "amd64")

_lock = threading.Lock()
_kernel = None


def enabled() -> bool:
    """RINGCOMM_STREAM_COPY: 1 (default on x86-64) streams large copies, 0 never does."""
    return env_switch("RINGCOMM_STREAM_COPY") and X86


def copy(out: np.ndarray, src: np.ndarray, whole: int = 0) -> None:
    """out[...] = src (same shape and dtype), streamed when it is big (or a piece of a copy of
    ``whole`` bytes that is), contiguous and not overlapping."""
    if (max(out.nbytes, whole) < STREAM_MIN_BYTES or not kernel() or out.shape != src.shape or out.dtype != src.dtype
            or not (out.flags.c_contiguous and src.flags.c_contiguous) or np.may_share_memory(out, src)):
        out[...] = src
        return
    _kernel(out.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))


def kernel():
    """The compiled copy ``(dst, src)`` of two uint8 views (numba, cached on disk: the first process
    on a machine compiles it, ~0.4 s), or False where streaming is off; RINGCOMM_STREAM_COPY is
    read at the first large copy."""
    global _kernel
    if _kernel is not None:
        return _kernel
    with _lock:
        if _kernel is None and not enabled():
            _kernel = False
        elif _kernel is None:
            import numba
            native_sync.intrinsics()
            native_sync.drop_stale_cache(__file__, "_copy_streaming", deps=(native_sync.__file__,))
            globals()["_stream_bytes"] = numba.njit(nogil=True)(native_sync.stream_bytes)
            compiled, memmove = numba.njit(nogil=True, cache=True)(_copy_streaming), native_sync.libc_address("memmove")
            _kernel = lambda dst, src: compiled(dst, src, memmove)   # noqa: E731 - libc's memmove, by address
    return _kernel


_stream_bytes = native_sync.stream_bytes   # compiled by kernel()


def _copy_streaming(dst, src, memmove):
    """dst = src (uint8 views): native_sync.stream_bytes (memmove up to dst's first 64-byte
    boundary, whole lines with non-temporal stores, memmove for the last partial line), then a
    fence, so the streamed lines are in place before any later store (a flag a peer reads)
    becomes visible."""
    _stream_bytes(dst.ctypes.data, src.ctypes.data, dst.size, memmove)
    native_sync.stream_fence()
