"""Checking user buffers before any byte moves: a bad buffer is the caller's
error, raised on the calling rank, never a corrupted result on another."""
from __future__ import annotations

import numpy as np

from ringcomm.kernels.host import SUPPORTED_DTYPES


def host_array(buf, what: str, *, writable: bool) -> np.ndarray:
    """The buffer as a flat 1-D view (no copy), or a TypeError / ValueError that says why not."""
    if not isinstance(buf, np.ndarray):
        if hasattr(buf, "__cuda_array_interface__"):
            raise TypeError(f"{what} is a device (CUDA) buffer; this build of ringcomm handles host "
                            f"(numpy) buffers only")
        raise TypeError(f"{what} must be a numpy array, got {type(buf).__name__}")
    if buf.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what} has dtype {buf.dtype}, which ringcomm does not reduce; supported: {names}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous (strides {buf.strides}); pass np.ascontiguousarray(...)")
    if writable and not buf.flags.writeable:
        raise ValueError(f"{what} is read-only, but the collective writes into it")
    return buf.reshape(-1)


def same_dtype(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: dtypes differ ({a.dtype} and {b.dtype}); ringcomm does not convert")


def expect_size(arr: np.ndarray, size: int, what: str) -> None:
    if arr.size != size:
        raise ValueError(f"{what} has {arr.size} elements, expected {size}")
