"""A fake CUDA runtime for the device path's failure tests: what numba's simulator cannot show.

The simulator runs every kernel at launch, so a stream never waits and nothing can hang. This runtime
implements ringcomm.transport.cuda_rt.Runtime with streams that really are queues: a thread standing in for
the GPU runs each stream's operations in order (kernels under the simulator, copies, event records, flag
waits and writes), and an operation that waits -- for a flag word, for an event -- holds its stream until
it is satisfied, as on a GPU. "Device memory" is /dev/shm-backed, so IPC handles open in another process.

Faults, injected by a test:
- ``fail(call, error, sticky=False)``: the next call whose name starts with ``call`` raises CudaError
  (sticky: every later call does too, as after a kernel fault);
- ``freeze()``: the GPU stops running anything (a peer whose GPU never gets to write its flags);
- ``delay``: seconds each kernel or copy takes (a slow GPU: events complete late);
- ``capturing`` (a set of streams under graph capture), ``visible`` (bus ids this process can see),
  ``pointer_device`` (pointer -> device) for a buffer on another GPU.
It also records what a real GPU would punish: ``violations`` lists every cudaFree / cudaIpcCloseMemHandle /
cudaHostUnregister made while a stream was still busy (a real cudaFree would block on it, or pull memory
from under a running kernel).
"""
from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np

from ringcomm.transport.cuda_rt import CudaError, Runtime

_installed = None


def install(comm=None, **config):
    """Install a FakeRuntime in this process (a World rank: ``w.run(install, ...)``); returns nothing."""
    from ringcomm.transport import cuda_rt
    global _installed
    _installed = FakeRuntime(**config)
    cuda_rt.use(_installed)


def current() -> "FakeRuntime":
    return _installed


class _Stream:
    def __init__(self, device: int):
        self.ops: list = []          # callables returning True when done, False while they must wait
        self.busy = False
        self.device = device


class FakeRuntime(Runtime):
    name = "fake"
    synchronous = False
    ipc = True

    def __init__(self, devices: int = 2, mem_ops: bool = True, delay: float = 0.0):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        self._fake, self.devices, self._mem_ops = FakeCUDAArray, devices, mem_ops
        self._tls = threading.local()
        self.lock = threading.RLock()
        self.streams: dict[int, _Stream] = {0: _Stream(0)}
        self.events: dict[int, list] = {}      # event -> [recorded, completed]
        self.memory: dict[int, tuple] = {}     # pointer -> (array, path or None, mmap, owned)
        self.registered: set[int] = set()
        self.failures: list = []               # (prefix, error, sticky)
        self.sticky: str | None = None
        self.frozen = False
        self.capturing: set[int] = set()
        self.visible = {f"fake:{d}" for d in range(devices)}
        self.pointer_device: dict[int, int] = {}
        self.violations: list[str] = []
        self.delay = delay
        self.calls: list[tuple] = []           # (call, thread's current device, thread name)
        self._next = 1
        threading.Thread(target=self._gpu, daemon=True, name="fake-gpu").start()

    # ---- faults -------------------------------------------------------------------------------------
    def fail(self, call: str, error: str = "cudaErrorMemoryAllocation: out of memory", sticky=False):
        self.failures.append((call, error, sticky))

    def freeze(self) -> None:
        self.frozen = True

    def _enter(self, call: str) -> None:
        self.calls.append((call, self.get_device(quiet=True), threading.current_thread().name))
        if self.sticky:
            raise CudaError(call, self.sticky)
        for f in self.failures:
            if call.startswith(f[0]):
                self.failures.remove(f)
                if f[2]:
                    self.sticky = f[1]
                raise CudaError(call, f[1])

    # ---- the GPU -----------------------------------------------------------------------------------
    def _gpu(self) -> None:
        while True:
            moved = False
            if not self.frozen:
                with self.lock:
                    streams = list(self.streams.values())
                for s in streams:
                    while s.ops:
                        s.busy = True
                        if not s.ops[0]():
                            break
                        s.ops.pop(0)
                        moved = True
                    s.busy = bool(s.ops)
            if not moved:
                time.sleep(2e-4)

    def _queue(self, stream: int, op) -> None:
        with self.lock:
            s = self.streams[stream]
            s.busy = True
            s.ops.append(op)

    def synchronize(self, stream: int = 0, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.stream_idle(stream):
            assert time.monotonic() < deadline, f"fake stream {stream} did not drain within {timeout} s"
            time.sleep(1e-3)

    # ---- devices -----------------------------------------------------------------------------------
    def get_device(self, quiet=False):
        return getattr(self._tls, "device", 0)

    def set_device(self, device):
        self._enter("cudaSetDevice")
        if not 0 <= device < self.devices:
            raise CudaError("cudaSetDevice", "cudaErrorInvalidDevice: invalid device ordinal")
        self._tls.device = device

    def device_of(self, ptr):
        self._enter("cudaPointerGetAttributes")
        return self.pointer_device.get(ptr, 0)

    def bus_id(self, device):
        return f"fake:{device}"

    def device_with_bus_id(self, bus_id):
        return int(bus_id.split(":")[1]) if bus_id in self.visible else None

    def mem_ops(self):
        return self._mem_ops

    # ---- streams and events ------------------------------------------------------------------------
    def stream_create(self):
        self._enter("cudaStreamCreateWithFlags")
        with self.lock:
            handle, self._next = self._next, self._next + 1
            self.streams[handle] = _Stream(self.get_device())
        return handle

    def stream_destroy(self, stream):
        self._enter("cudaStreamDestroy")
        if not self.stream_idle(stream):
            self.violations.append(f"cudaStreamDestroy of busy stream {stream}")

    def stream_idle(self, stream):
        self._enter("cudaStreamQuery")
        s = self.streams[stream]
        return not s.ops and not s.busy

    def stream_capturing(self, stream):
        self._enter("cudaStreamIsCapturing")
        return stream in self.capturing

    def stream_device(self, stream):
        return self.streams[stream].device if stream else None

    def event_create(self):
        self._enter("cudaEventCreateWithFlags")
        with self.lock:
            handle, self._next = self._next, self._next + 1
            self.events[handle] = [0, 0]
        return handle

    def event_destroy(self, event):
        self._enter("cudaEventDestroy")

    def event_record(self, event, stream):
        self._enter("cudaEventRecord")
        ev = self.events[event]
        ev[0] += 1
        gen = ev[0]

        def done():
            ev[1] = max(ev[1], gen)
            return True
        self._queue(stream, done)

    def event_done(self, event):
        self._enter("cudaEventQuery")
        recorded, completed = self.events[event]
        return completed >= recorded

    def stream_wait_event(self, stream, event):
        self._enter("cudaStreamWaitEvent")
        ev = self.events[event]
        gen = ev[0]
        self._queue(stream, lambda: ev[1] >= gen)

    # ---- memory ------------------------------------------------------------------------------------
    def _map(self, path: str, nbytes: int, owned: bool) -> int:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if owned else 0), 0o600)
        try:
            if owned:
                os.ftruncate(fd, max(nbytes, 1))
            m = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        arr = np.frombuffer(m, np.uint8)
        ptr = arr.__array_interface__["data"][0]
        self.memory[ptr] = (arr, path, m, owned)
        return ptr

    def malloc(self, nbytes):
        self._enter(f"cudaMalloc({nbytes} bytes)")
        job = os.environ.get("RINGCOMM_JOB_ID", "x")
        with self.lock:
            serial, self._next = self._next, self._next + 1
        return self._map(f"/dev/shm/rc-{job}-{os.getpid()}-fake{serial}", nbytes, owned=True)

    def _release(self, ptr: int, call: str) -> None:
        self._enter(call)
        busy = [h for h, s in self.streams.items() if s.ops or s.busy]
        if busy:
            self.violations.append(f"{call} while streams {busy} were busy")
        arr, path, m, owned = self.memory.pop(ptr)
        if owned:
            os.unlink(path)

    def free(self, ptr):
        self._release(ptr, "cudaFree")

    def ipc_handle(self, ptr):
        self._enter("cudaIpcGetMemHandle")
        return self.memory[ptr][1].encode()

    def ipc_open(self, handle):
        self._enter("cudaIpcOpenMemHandle")
        return self._map(handle.decode(), 0, owned=False)

    def ipc_close(self, ptr):
        self._release(ptr, "cudaIpcCloseMemHandle")

    def host_register(self, host):
        self._enter(f"cudaHostRegister({host.nbytes} bytes)")
        ptr = host.__array_interface__["data"][0]
        self.registered.add(ptr)
        return ptr

    def host_unregister(self, host):
        ptr = host.__array_interface__["data"][0]
        self._enter("cudaHostUnregister")
        self.registered.discard(ptr)

    def view(self, ptr, nbytes, host=None):
        if host is None:
            for base, (arr, *_rest) in self.memory.items():
                if base <= ptr < base + arr.size:
                    host = arr[ptr - base: ptr - base + nbytes]
        return self._fake(host)

    # ---- work ---------------------------------------------------------------------------------------
    def launch(self, stream, fn, *args):
        self._enter(f"launching {getattr(fn, '__name__', fn)}")

        def run():
            if self.delay:
                time.sleep(self.delay)
            fn(*args)
            return True
        self._queue(stream, run)

    def wait_value(self, stream, flag, value):
        self._enter("cuStreamWaitValue64")
        self._queue(stream, lambda: flag.host[0] >= value)

    def write_value(self, stream, flag, value):
        self._enter("cuStreamWriteValue64")

        def write():
            flag.host[0] = value
            return True
        self._queue(stream, write)
