"""Checking user buffers before any byte moves: a bad buffer is the caller's
error, raised on the calling rank, never a corrupted result on another.

Host buffers are numpy arrays. Device buffers are CUDA memory: numba device arrays,
cupy arrays, torch CUDA tensors, anything with ``__cuda_array_interface__``, and
DLPack producers on a CUDA device (through cupy). Both become flat 1-D views, no
copy: numpy arrays, or numba device arrays for device memory. One call takes host
buffers or device buffers, never both: ringcomm does not copy between them.

The stream rule (NCCL's): a collective on device buffers is ordered after the work
already queued on the caller's current stream, and its result is ready on that
stream when the call returns -- the host does not wait for the GPU. The caller's
current stream is torch.cuda.current_stream() for a torch tensor, the stream in
``__cuda_array_interface__`` (cupy puts its current stream there), a numba
array's bound stream, else the legacy default stream. Keep the buffers alive and
unchanged until that stream has passed the collective, as with NCCL.
"""
from __future__ import annotations

import importlib
import sys

import numpy as np

from ringcomm.kernels.host import DTYPE_NAMES, as_dtype, supported


def host_array(buf, what: str, *, writable: bool) -> np.ndarray:
    """The buffer as a flat 1-D view (no copy), or a TypeError / ValueError that says why not."""
    if not isinstance(buf, np.ndarray):
        if is_device_buffer(buf):
            return device_array(buf, what, writable=writable)
        raise TypeError(f"{what} must be a numpy array or a CUDA device array (cupy, torch, numba), "
                        f"got {type(buf).__name__}")
    if not supported(buf.dtype):
        raise TypeError(f"{what} has dtype {buf.dtype}, which ringcomm does not reduce; supported: "
                        f"{', '.join(DTYPE_NAMES)}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous (strides {buf.strides}); pass np.ascontiguousarray(...)")
    if writable and not buf.flags.writeable:
        raise ValueError(f"{what} is read-only, but the collective writes into it")
    return buf.reshape(-1)


def same_dtype(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        raise TypeError(f"{what}: one is in host memory and the other on a CUDA device; ringcomm does not "
                        f"copy between them: pass both on the device or both on the host")
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: dtypes differ ({a.dtype} and {b.dtype}); ringcomm does not convert")


def expect_size(arr: np.ndarray, size: int, what: str) -> None:
    if arr.size != size:
        raise ValueError(f"{what} has {arr.size} elements, expected {size}")


def address(arr) -> int:
    """Where a flat view (numpy or device) starts."""
    if isinstance(arr, np.ndarray) or not hasattr(arr, "__cuda_array_interface__"):
        return arr.__array_interface__["data"][0]       # numpy, and the CUDA simulator's arrays
    return arr.__cuda_array_interface__["data"][0]


def overlaps(a, b) -> bool:
    """Whether two flat views share any byte."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    pa, pb = address(a), address(b)
    return a.nbytes > 0 and b.nbytes > 0 and pa < pb + b.nbytes and pb < pa + a.nbytes


# --- device buffers --------------------------------------------------------------------------------------

def _torch_tensor(buf) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


def is_device_buffer(buf) -> bool:
    """Whether buf is CUDA memory, decided without touching the GPU."""
    if _torch_tensor(buf):
        return buf.is_cuda
    if getattr(buf, "__cuda_ndarray__", False) or hasattr(type(buf), "__cuda_array_interface__"):
        return True
    try:
        return buf.__dlpack_device__()[0] == 2      # kDLCUDA
    except (AttributeError, TypeError, ValueError):
        return False


def _extra(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"device buffers need {module}: pip install 'ringcomm[cuda]' ({e})") from e


def device_array(buf, what: str, *, writable: bool):
    """A CUDA buffer as a flat numba device array bound to the caller's stream (no copy, no sync)."""
    if type(buf).__name__ == "FakeCUDAArray":       # numba's CUDA simulator (tests): no pointers, no streams
        _check_device(np.dtype(buf.dtype), buf.is_c_contiguous(), False, what, writable)
        return buf.reshape(buf.size)
    if _torch_tensor(buf):
        desc, dtype = _torch_interface(buf, what)
    else:
        if not hasattr(buf, "__cuda_array_interface__"):
            buf = _extra("cupy").from_dlpack(buf)   # a DLPack producer on a CUDA device
        desc = buf.__cuda_array_interface__
        dtype = getattr(buf, "dtype", None)
        dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(desc["typestr"])
    shape, strides = tuple(desc["shape"]), desc.get("strides")
    size = int(np.prod(shape, dtype=np.int64))
    itemsize = np.dtype(desc["typestr"]).itemsize
    contiguous = strides is None or size <= 1 or tuple(strides) == _c_strides(shape, itemsize)
    _check_device(dtype, contiguous, bool(desc["data"][1]), what, writable)
    flat = {"shape": (size,), "strides": None, "typestr": desc["typestr"], "data": (desc["data"][0], False),
            "version": 3, "stream": desc.get("stream")}
    arr = _extra("numba.cuda").from_cuda_array_interface(flat, owner=buf, sync=False)
    arr = arr if arr.dtype == dtype else arr.view(dtype)
    arr.itemsize = dtype.itemsize                   # numpy's attribute, which the executor reads
    return arr


def _torch_interface(t, what):
    """torch's interface knows neither bfloat16 nor the wider unsigned types, and names no stream: take it from
    a signed-integer view of the same width, and name torch's current stream."""
    import torch
    dtype = next((as_dtype(n) for n in DTYPE_NAMES if getattr(torch, n, None) == t.dtype), None)
    if dtype is None:
        raise TypeError(f"{what} has dtype {t.dtype}, which ringcomm does not reduce")
    t = t.detach()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    desc = dict((t if t.dtype == bits else t.view(bits)).__cuda_array_interface__)
    desc["stream"] = torch.cuda.current_stream(t.device).cuda_stream or None    # 0: the legacy default
    return desc, dtype


def _c_strides(shape, itemsize) -> tuple:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _check_device(dtype, contiguous, readonly, what, writable) -> None:
    if not supported(dtype):
        raise TypeError(f"{what} has dtype {dtype}, which ringcomm does not reduce; supported: "
                        f"{', '.join(DTYPE_NAMES)}")
    if not contiguous:
        raise ValueError(f"{what} is not C-contiguous; pass a contiguous copy")
    if writable and readonly:
        raise ValueError(f"{what} is read-only, but the collective writes into it")
