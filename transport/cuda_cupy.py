"""ringcomm.transport.cuda_rt's runtime on a real GPU: cupy's runtime bindings and the driver's stream memory
operations (through ctypes, as cupy does not bind them).

Works with cupy-cuda12x and cupy-cuda13x alike: only calls both export are used, and the driver entry
points are the versioned ``_v2`` symbols every driver since CUDA 11.7 exports. Every CUDARuntimeError (and
a failing driver call) becomes a CudaError that names the call.
"""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from .cuda_rt import CudaError, Flag, Runtime

CU_STREAM_WAIT_VALUE_GEQ = 0
CU_STREAM_WRITE_VALUE_DEFAULT = 0          # fences the stream's earlier writes (system scope) first
HOST_REGISTER = 1 | 2                      # cudaHostRegisterPortable | cudaHostRegisterMapped
NOT_READY = 600                            # cudaErrorNotReady: the stream or event is still busy


class CupyRuntime(Runtime):
    name = "cupy"
    synchronous = False
    ipc = True

    def __init__(self):
        try:
            import cupy
            from numba import cuda
        except ImportError as e:
            raise ImportError(f"device buffers need cupy and numba-cuda: pip install 'ringcomm[cuda]' "
                              f"(cupy-cuda12x for CUDA 12 drivers, cupy-cuda13x for CUDA 13) ({e})") from e
        self.rt, self.cuda = cupy.cuda.runtime, cuda
        self._error = self.rt.CUDARuntimeError
        self._driver = None
        self._mem_ops: bool | None = None
        self._lock = threading.Lock()

    def _call(self, name: str, fn, *args):
        try:
            return fn(*args)
        except self._error as e:
            raise CudaError(name, str(e), getattr(e, "status", None)) from None

    def _drv(self, name: str, *args) -> None:
        try:
            if self._driver is None:
                self._driver = ctypes.CDLL("libcuda.so.1")
            fn = getattr(self._driver, name)
        except (OSError, AttributeError) as e:
            raise CudaError(name, f"not available from the driver ({e})") from None
        rc = fn(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self._driver.cuGetErrorName(rc, ctypes.byref(text))
            raise CudaError(name, f"{(text.value or b'?').decode()} ({rc})", rc)

    # devices
    def get_device(self):
        return self._call("cudaGetDevice", self.rt.getDevice)

    def set_device(self, device):
        self._call("cudaSetDevice", self.rt.setDevice, device)

    def device_of(self, ptr):
        return self._call("cudaPointerGetAttributes", self.rt.pointerGetAttributes, ptr).device

    def bus_id(self, device):
        return self._call("cudaDeviceGetPCIBusId", self.rt.deviceGetPCIBusId, device).lower()

    def device_with_bus_id(self, bus_id):
        try:
            return self.rt.deviceGetByPCIBusId(bus_id)
        except self._error:
            return None                                 # not visible here (CUDA_VISIBLE_DEVICES)

    def can_access_peer(self, device, peer):
        return device == peer or bool(self._call("cudaDeviceCanAccessPeer", self.rt.deviceCanAccessPeer,
                                                 device, peer))

    def dmabuf_supported(self, device):
        """CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124), through the driver (the runtime names it only in
        recent releases)."""
        handle, value = ctypes.c_int(), ctypes.c_int()
        self._drv("cuDeviceGet", ctypes.byref(handle), ctypes.c_int(device))
        self._drv("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(124), handle)
        return bool(value.value)

    def mem_ops(self):
        """Probe once: write a registered word from a stream and see it land (some virtualised drivers
        refuse stream memory operations; then the host synchronises instead)."""
        with self._lock:
            if self._mem_ops is None:
                self._mem_ops = self._probe()
        return self._mem_ops

    def _probe(self) -> bool:
        page = np.zeros(4096 // 8, np.int64)
        s = None
        try:
            flag = Flag(page[:1], self.host_register(page))
            s = self.stream_create()
            self.write_value(s, flag, 7)
            deadline = time.monotonic() + 2.0
            while not self.stream_idle(s) and time.monotonic() < deadline:
                time.sleep(1e-4)
            ok = page[0] == 7
            self.host_unregister(page)
            return bool(ok)
        except CudaError:
            return False
        finally:
            if s is not None:
                self.stream_destroy(s)

    # streams and events
    def stream_create(self):
        return self._call("cudaStreamCreateWithFlags", self.rt.streamCreateWithFlags, self.rt.streamNonBlocking)

    def stream_destroy(self, stream):
        self._call("cudaStreamDestroy", self.rt.streamDestroy, stream)

    def stream_idle(self, stream):
        return self._done("cudaStreamQuery", self.rt.streamQuery, stream)

    def stream_capturing(self, stream):
        try:
            return self._call("cudaStreamIsCapturing", self.rt.streamIsCapturing, stream) != 0
        except RuntimeError as e:
            if isinstance(e, CudaError):
                raise
            return True     # cupy's plain RuntimeError: "the stream was capturing, but an error has invalidated ..."

    def stream_device(self, stream):
        if stream == 0:
            return None
        dev = ctypes.c_int(-1)
        try:
            self._drv("cuStreamGetDevice", ctypes.c_void_p(stream), ctypes.byref(dev))   # driver >= 12.8
        except CudaError:
            return None                                 # a driver before 12.8: cannot tell
        return dev.value

    def event_create(self):
        return self._call("cudaEventCreateWithFlags", self.rt.eventCreateWithFlags, self.rt.eventDisableTiming)

    def event_destroy(self, event):
        self._call("cudaEventDestroy", self.rt.eventDestroy, event)

    def event_record(self, event, stream):
        self._call("cudaEventRecord", self.rt.eventRecord, event, stream)

    def event_done(self, event):
        return self._done("cudaEventQuery", self.rt.eventQuery, event)

    def _done(self, name, query, handle) -> bool:
        """cudaStreamQuery / cudaEventQuery: True when the work is done, False while it runs
        (cudaErrorNotReady, 600). cupy returns these two calls' status instead of raising it, so a
        status taken for success would let the host read slots the GPU has not written yet."""
        try:
            status = query(handle)
        except self._error as e:                        # a runtime that raises instead
            status, text = getattr(e, "status", None), str(e)
        else:
            if not status:
                return True
            text = self._status_text(status)
        if status == NOT_READY:
            return False
        raise CudaError(name, text, status)

    def _status_text(self, status: int) -> str:
        try:
            return str(self._error(status))             # cupy's error names the status: "cudaErrorX: text"
        except Exception:  # noqa: BLE001 - a stand-in with another signature
            return f"CUDA error {status}"

    def stream_wait_event(self, stream, event):
        self._call("cudaStreamWaitEvent", self.rt.streamWaitEvent, stream, event, 0)

    # memory
    def malloc(self, nbytes):
        return self._call(f"cudaMalloc({nbytes} bytes)", self.rt.malloc, nbytes)

    def free(self, ptr):
        self._call("cudaFree", self.rt.free, ptr)

    def ipc_handle(self, ptr):
        return bytes(self._call("cudaIpcGetMemHandle", self.rt.ipcGetMemHandle, ptr))

    def ipc_open(self, handle):
        return self._call("cudaIpcOpenMemHandle", self.rt.ipcOpenMemHandle, handle)

    def ipc_close(self, ptr):
        self._call("cudaIpcCloseMemHandle", self.rt.ipcCloseMemHandle, ptr)

    def host_register(self, host):
        ptr, n = host.__array_interface__["data"][0], host.nbytes
        self._call(f"cudaHostRegister({n} bytes)", self.rt.hostRegister, ptr, n, HOST_REGISTER)
        # cupy's runtime module has no cudaHostGetDevicePointer (cupy-cuda13x 14.2 on an H200): the
        # driver's own call, in the primary context the runtime made current.
        dev = ctypes.c_uint64()
        self._drv("cuMemHostGetDevicePointer_v2", ctypes.pointer(dev), ctypes.c_void_p(ptr), ctypes.c_uint(0))
        return dev.value

    def host_unregister(self, host):
        self._call("cudaHostUnregister", self.rt.hostUnregister, host.__array_interface__["data"][0])

    def view(self, ptr, nbytes, host=None):
        try:
            return self.cuda.from_cuda_array_interface(
                {"shape": (nbytes,), "strides": None, "typestr": "|u1", "version": 3, "data": (ptr, False)},
                owner=None, sync=False)
        except Exception as e:  # noqa: BLE001 - numba's CudaAPIError (no context, a bad pointer): named
            raise CudaError("numba.cuda.from_cuda_array_interface", f"{type(e).__name__}: {e}") from None

    # work on a stream
    def launch(self, stream, fn, *args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - numba's CudaAPIError / cupy's errors, named as the launch
            raise CudaError(f"launching {getattr(fn, '__name__', fn)}", f"{type(e).__name__}: {e}") from None

    def wait_value(self, stream, flag, value):
        self._drv("cuStreamWaitValue64_v2", ctypes.c_void_p(stream), ctypes.c_uint64(flag.dev),
                  ctypes.c_uint64(value), ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ))

    def write_value(self, stream, flag, value):
        self._drv("cuStreamWriteValue64_v2", ctypes.c_void_p(stream), ctypes.c_uint64(flag.dev),
                  ctypes.c_uint64(value), ctypes.c_uint(CU_STREAM_WRITE_VALUE_DEFAULT))
