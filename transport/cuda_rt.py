"""The CUDA calls of the device path, behind one small interface.

The same device-path code runs over four runtimes:

- ``CupyRuntime``: a GPU, through cupy's runtime bindings (cupy-cuda12x or cupy-cuda13x, whichever is
  installed) and, for the stream memory operations, the driver's cuStreamWaitValue64 / cuStreamWriteValue64
  through ctypes;
- ``SimRuntime``: numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1). Kernels run when launched, so every
  stream is always idle;
- ``Runtime`` itself, the null runtime: every call does nothing (tests/gpu/host_overhead.py times
  ringcomm's own Python with it);
- the tests' fake runtime (tests/fake_cuda.py): streams as queues run by a thread standing in for the GPU,
  and faults injected on demand: an allocation or IPC open that fails, a sticky error, a stream under capture.

``use(rt)`` installs one for the process; ``get()`` returns it (made on first use: simulator or cupy).

Failures are ``CudaError``: the call and CUDA's name for the error, never a raw CUDARuntimeError.

Flag words. A ``Flag`` is one 64-bit word of host memory (a /dev/shm page registered with
cudaHostRegister, so both the GPU and a peer process reach it). A stream can wait until the word reaches a
value (``wait_value``: cuStreamWaitValue64 with GEQ) or write it after its earlier work
(``write_value``: cuStreamWriteValue64, which fences that work first). Because the host can write the same
word, a stream that waits for a peer that died can always be let go: write ``RELEASE`` into the word
(NCCL's abort does the same with its host-mapped flags). Counts never reach RELEASE (2**62 slices).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np

RELEASE = 1 << 62


class CudaError(RuntimeError):
    """A CUDA call failed: ``call`` names it, ``error`` is CUDA's name (and text) for the error."""

    def __init__(self, call: str, error: str, code: int | None = None):
        super().__init__(f"{call} failed: {error}")
        self.call, self.error, self.code = call, error, code


class Flag:
    """A 64-bit word of registered host memory: ``host`` (a numpy int64 view of 1) and ``dev``, the address
    the GPU uses for it."""

    __slots__ = ("host", "dev")

    def __init__(self, host: np.ndarray, dev: int):
        self.host, self.dev = host, dev

    def release(self) -> None:
        self.host[0] = RELEASE


class Runtime:
    """The interface, implemented as the null runtime: every call does nothing, every stream is idle."""

    name = "null"
    synchronous = True      # work queued on a stream is done when the call returns (null, simulator)
    ipc = False             # device memory another process can map (else cuda_ipc stages through host memory)

    # devices
    def get_device(self) -> int:
        return 0

    def set_device(self, device: int) -> None:
        pass

    def device_of(self, ptr: int) -> int:
        """The device a pointer's memory is on."""
        return 0

    def bus_id(self, device: int) -> str:
        """The PCI bus id of a device: the same GPU seen from two processes with other numberings."""
        return f"{self.name}:{device}"

    def device_with_bus_id(self, bus_id: str) -> int | None:
        return 0 if bus_id == self.bus_id(0) else None

    def can_access_peer(self, device: int, peer: int) -> bool:
        return True

    def dmabuf_supported(self, device: int) -> bool:
        """Whether the GPU can export its memory as a dma-buf a NIC may register (GPUDirect RDMA without
        nvidia_peermem); only reported, see transport/cuda_staged.gpudirect."""
        return False

    def mem_ops(self) -> bool:
        """Whether streams can wait on / write flag words (else the host synchronises, see cuda_ipc)."""
        return True

    # streams and events
    def stream_create(self) -> int:
        return 0

    def stream_destroy(self, stream: int) -> None:
        pass

    def stream_idle(self, stream: int) -> bool:
        return True

    def stream_capturing(self, stream: int) -> bool:
        return False

    def stream_device(self, stream: int) -> int | None:
        """The device a stream belongs to, or None where the runtime cannot tell (the legacy stream)."""
        return None

    def event_create(self) -> int:
        return 0

    def event_destroy(self, event: int) -> None:
        pass

    def event_record(self, event: int, stream: int) -> None:
        pass

    def event_done(self, event: int) -> bool:
        return True

    def stream_wait_event(self, stream: int, event: int) -> None:
        pass

    # memory
    def malloc(self, nbytes: int) -> int:
        return 0

    def free(self, ptr: int) -> None:
        pass

    def ipc_handle(self, ptr: int) -> bytes:
        return b""

    def ipc_open(self, handle: bytes) -> int:
        return 0

    def ipc_close(self, ptr: int) -> None:
        pass

    def host_register(self, host: np.ndarray) -> int:
        """Pin and map a page-aligned host array (cudaHostRegister, portable + mapped); its device address."""
        return host.__array_interface__["data"][0]

    def host_unregister(self, host: np.ndarray) -> None:
        pass

    def view(self, ptr: int, nbytes: int, host: np.ndarray | None = None):
        """A uint8 device array of ``nbytes`` at ``ptr`` (``host``: the same bytes as host memory, registered)."""
        return host if host is not None else np.zeros(nbytes, np.uint8)

    # work on a stream
    def launch(self, stream: int, fn, *args) -> None:
        """Queue fn(*args) -- a kernel launch or copy already bound to ``stream`` -- on ``stream``."""

    def wait_value(self, stream: int, flag: Flag, value: int) -> None:
        pass

    def write_value(self, stream: int, flag: Flag, value: int) -> None:
        pass


class NullRuntime(Runtime):
    """Every call a no-op (for measuring the host side, tests/gpu/host_overhead.py)."""


class SimRuntime(Runtime):
    """numba's CUDA simulator: kernels run at launch, so a flag is written before the host counter that
    announces it moves, and a wait must find it already there (checked: it is the protocol's invariant)."""

    name = "simulator"

    def __init__(self):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        self._fake = FakeCUDAArray

    def view(self, ptr, nbytes, host=None):
        return self._fake(host if host is not None else np.zeros(nbytes, np.uint8))

    def launch(self, stream, fn, *args):
        fn(*args)

    def wait_value(self, stream, flag, value):
        if flag.host[0] < value:
            raise CudaError("cuStreamWaitValue64", f"the simulator's stream would wait for ever: flag "
                                                   f"{int(flag.host[0])} < {value}")

    def write_value(self, stream, flag, value):
        flag.host[0] = value


_current: Runtime | None = None
_stuck: set = set()
_lock = threading.Lock()


def use(rt: Runtime | None) -> None:
    """Install ``rt`` as this process's runtime (None: choose again on next get())."""
    global _current
    _current = rt


def get() -> Runtime:
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                simulated = os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")
                if simulated:
                    _current = SimRuntime()
                else:
                    from .cuda_cupy import CupyRuntime
                    _current = CupyRuntime()
    return _current


@contextlib.contextmanager
def on_device(rt: Runtime, device: int, quiet: bool = False):
    """Make ``device`` current in this thread for the block, and restore the caller's device after it
    (CUDA's current device is per thread: a communicator may be called from any). ``quiet``: for cleanup,
    where a failing switch (a sticky error) must not hide the error being cleaned up after."""
    prev = device
    try:
        prev = rt.get_device()
        if prev != device:
            rt.set_device(device)
    except CudaError:
        if not quiet:
            raise
    try:
        yield
    finally:
        if prev != device:
            try:
                rt.set_device(prev)
            except CudaError:
                if not quiet:
                    raise


def drain(rt: Runtime, stream: int, deadline: float, release=None, abort=None) -> bool:
    """Poll until ``stream`` is idle (True) or the deadline passes (False), never blocking in CUDA: a stream
    that waits for a dead peer would block a synchronize for ever. ``release()`` is called at every poll:
    it writes RELEASE into the flags the stream may wait on that no peer will write any more (rewritten at
    every poll, as a late write of the peer's GPU may lower one again). A stream found stuck -- or whose
    query fails, a sticky error -- stays stuck: a later drain of it returns False at once."""
    key = (id(rt), stream)
    if key in _stuck:
        return False
    pause = 1e-5
    while True:
        if release is not None:
            release()
        try:
            if rt.stream_idle(stream):
                return True
        except CudaError:
            _stuck.add(key)
            return False
        if time.monotonic() > deadline or (abort is not None and abort.is_set()):
            _stuck.add(key)         # a stream found stuck stays so: later closes do not wait for it again
            return False
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)

