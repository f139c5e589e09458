"""Device (numba.cuda) kernels of reproducible sums: ringcomm.kernels.reproducible's, on a GPU stream.

    exponent_codes(x, codes, stream=None)
    encode(x, codes, limbs, stream=None)
    decode(sums, codes, out, stream=None)
    canonical(x, stream=None)

The kernel bodies are the host's (ringcomm.kernels.reproducible.make_*, built with DEVICE=True): integer
arithmetic on the floats' bit patterns only, so a GPU gives the host's bits. numba.cuda cannot call a
device function from a kernel compiled with compile_ptx on a machine without a GPU (see device.py), so
each body is one function; its only primitive is cuda.clz. Work is queued on ``stream`` like
ringcomm.kernels.device's kernels (a numba / cupy / torch stream or a raw handle; None: the legacy one).
"""
from __future__ import annotations

import threading

import numpy as np

from . import device as _device
from . import reproducible as _host
from .device import cuda

SIMULATOR = _device.SIMULATOR
_host.cuda = cuda                       # the name the kernel bodies use for the grid (see reproducible.py)


def _clz64(v):                          # the simulator's cuda.clz counts in 32 bits
    return 64 - int(v).bit_length()


def _make(name: str, fmt):
    if name == "decode":
        return _host.make_decode(fmt, True, _clz64 if SIMULATOR else None)
    return _host._MAKERS[name](fmt, True)
_cache: dict = {}
_lock = threading.Lock()


def kernel_source(name: str, dt):
    """(python kernel, numba argument types) of one kernel for one dtype: what the tests compile for sm_90."""
    from numba.core import types
    from numba.np.numpy_support import from_dtype
    fmt = _host.format_of(dt)
    floats = types.Array(from_dtype(fmt.bits), 1, "C")
    codes = types.Array(types.uint8, 1, "C")
    limbs = types.Array(from_dtype(fmt.limb), 1, "C")
    args = {"codes": (floats, codes), "encode": (floats, codes, limbs), "decode": (limbs, codes, floats),
            "canon": (floats,)}[name]
    return _make(name, fmt), args


def _kernel(name: str, dt: np.dtype):
    key = (name, dt)
    k = _cache.get(key)
    if k is None:
        with _lock:
            k = _cache.get(key)
            if k is None:
                fn = _make(name, _host.format_of(dt))
                fn.__name__ = fn.__qualname__ = f"ringcomm_repro_{name}_{dt}"
                k = _cache[key] = cuda.jit(fn)
    return k


def _launch(name, dt, n, stream, *arrays):
    if n == 0:
        return
    blocks, threads = _device.launch_config(n)
    _kernel(name, dt)[blocks, threads, _device.as_stream(stream)](*arrays)


def _bits(arr, fmt):
    return _device.as_device_array(arr).view(fmt.bits)


def exponent_codes(x, codes, stream=None):
    """codes (uint8, x.size) <- each element's scale class."""
    fmt = _host.format_of(x.dtype)
    _launch("codes", np.dtype(x.dtype), x.size, stream, _bits(x, fmt), _device.as_device_array(codes))
    return codes


def encode(x, codes, limbs, stream=None):
    """limbs (NL per element) <- x at the scale of codes (the MAX over ranks)."""
    fmt = _host.format_of(x.dtype)
    _launch("encode", np.dtype(x.dtype), x.size, stream, _bits(x, fmt), _device.as_device_array(codes),
            _device.as_device_array(limbs))
    return limbs


def decode(sums, codes, out, stream=None):
    """out <- the floats whose limbs, summed over the ranks, are ``sums``."""
    fmt = _host.format_of(out.dtype)
    _launch("decode", np.dtype(out.dtype), out.size, stream, _device.as_device_array(sums),
            _device.as_device_array(codes), _bits(out, fmt))
    return out


def canonical(x, stream=None):
    """x <- x with NaNs made the canonical quiet NaN and -0.0 made +0.0, in place."""
    fmt = _host.format_of(x.dtype)
    _launch("canon", np.dtype(x.dtype), x.size, stream, _bits(x, fmt))
    return x
