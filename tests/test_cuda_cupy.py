"""The GPU runtime wrapper (transport/cuda_cupy.py) against a stand-in for cupy's runtime module: every CUDA
failure becomes a CudaError naming the call, "not ready" is an answer rather than an error, and a driver
without stream memory operations (none here) turns the flag protocol off instead of failing. The stand-in
offers only calls that cupy-cuda12x and cupy-cuda13x both have, so the wrapper needs nothing else."""
from __future__ import annotations

import sys
import types

import pytest

from ringcomm.transport.cuda_rt import CudaError

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


class CUDARuntimeError(RuntimeError):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status


def _stub_cupy(calls):
    def fail(status, text):
        def raiser(*args):
            calls.append(args)
            raise CUDARuntimeError(status, text)
        return raiser
    rt = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, streamNonBlocking=1, eventDisableTiming=2,
        malloc=fail(2, "cudaErrorMemoryAllocation: out of memory"),
        ipcOpenMemHandle=fail(201, "cudaErrorMapBufferObjectFailed: mapping of buffer object failed"),
        streamQuery=lambda s: 600,          # cupy returns these two calls' status (600: cudaErrorNotReady)
        eventQuery=lambda e: 0,
        getDevice=fail(710, "cudaErrorAssert: device-side assert triggered"),
        hostRegister=fail(712, "cudaErrorHostMemoryAlreadyRegistered"))
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))


@pytest.fixture
def rt(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "cupy", _stub_cupy(calls))
    from ringcomm.transport.cuda_cupy import CupyRuntime
    runtime = CupyRuntime()
    runtime.calls = calls
    return runtime


def test_cuda_failures_are_cuda_errors_naming_the_call(rt):
    with pytest.raises(CudaError, match=r"cudaMalloc\(4096 bytes\) failed: cudaErrorMemoryAllocation") as e:
        rt.malloc(4096)
    assert e.value.call == "cudaMalloc(4096 bytes)" and e.value.code == 2
    with pytest.raises(CudaError, match="cudaIpcOpenMemHandle failed: cudaErrorMapBufferObjectFailed"):
        rt.ipc_open(b"\0" * 64)
    with pytest.raises(CudaError, match="cudaGetDevice failed: cudaErrorAssert"):
        rt.get_device()


def test_not_ready_is_an_answer(rt):
    """cupy's streamQuery and eventQuery return CUDA's status rather than raise it (cupy-cuda13x 14.2 on
    an H200: taking every return for "done" let the proxy post slices before the GPU wrote them)."""
    assert rt.stream_idle(5) is False
    assert rt.event_done(7) is True
    rt.rt.streamQuery = lambda s: 0
    assert rt.stream_idle(5) is True
    rt.rt.eventQuery = lambda e: 600
    assert rt.event_done(7) is False


def test_a_query_status_other_than_not_ready_is_a_cuda_error(rt):
    rt.rt.streamQuery = lambda s: 700
    with pytest.raises(CudaError, match="cudaStreamQuery failed") as e:
        rt.stream_idle(5)
    assert e.value.code == 700

    def raises(status):
        def query(handle):
            raise CUDARuntimeError(status, f"status {status}")
        return query
    rt.rt.eventQuery = raises(600)                  # a runtime that raises instead: the same answers
    assert rt.event_done(7) is False
    rt.rt.eventQuery = raises(719)
    with pytest.raises(CudaError, match="cudaEventQuery failed: status 719"):
        rt.event_done(7)


def test_no_stream_memory_operations_means_host_synchronisation(rt, monkeypatch):
    import ctypes

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    from ringcomm.transport.cuda_rt import Flag
    import numpy as np
    with pytest.raises(CudaError, match="cuStreamWaitValue64_v2 failed: not available from the driver"):
        rt.wait_value(1, Flag(np.zeros(1, np.int64), 0), 1)
    assert rt.mem_ops() is False          # the probe fails (here at cudaHostRegister): cuda_ipc polls instead


def test_registered_host_memory_gets_its_device_address_from_the_driver(rt, monkeypatch):
    """cupy's runtime module has no cudaHostGetDevicePointer (cupy-cuda13x 14.2): the address the GPU
    uses for a registered host page comes from the driver's cuMemHostGetDevicePointer."""
    import ctypes

    import numpy as np

    class Driver:
        def cuMemHostGetDevicePointer_v2(self, out, host, flags):
            out.contents.value = host.value + 0x10000     # a device address that differs from the host's
            return 0
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: Driver())
    rt.rt.hostRegister = lambda ptr, n, flags: None
    page = np.zeros(512, np.int64)
    assert rt.host_register(page) == page.__array_interface__["data"][0] + 0x10000


def test_a_stream_whose_capture_was_invalidated_counts_as_capturing(rt):
    """cupy raises a plain RuntimeError for cudaStreamCaptureStatusInvalidated: the stream is refused
    as a capturing one (a clear ValueError upstream), not a raw error out of the library."""
    def invalidated(stream):
        raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
    rt.rt.streamIsCapturing = invalidated
    assert rt.stream_capturing(5) is True
    rt.rt.streamIsCapturing = lambda stream: False
    assert rt.stream_capturing(5) is False
