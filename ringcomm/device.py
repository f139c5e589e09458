"""Collectives on device buffers: the same schedules and executor, with kernels and copies on a GPU stream.

A communicator makes its DevicePath at its first call on device buffers (see ringcomm/buffers.py), bound
to the GPU current at that moment. The path owns:

- a CUDA stream of ringcomm's own. Every kernel and copy of a device call, and the cuda_ipc connections'
  event records and waits, are queued on it, in the order the executor issues them;
- a second Executor over the same schedules, whose links are the cuda_ipc connections to the same peers
  (Links.device) and whose slots are device memory of RINGCOMM_CUDA_BUFFSIZE bytes per connection (64 MiB
  by default: every slice costs tens of microseconds of Python, so GPU slices are made larger than host
  ones);
- the stream rule (NCCL's): at the start of a call our stream waits for an event recorded on the caller's
  stream, at the end the caller's stream waits for one recorded on ours. The host never waits for the GPU;
  a collective's result is ready on the caller's stream when the call returns.

The executor hands each slice to ``DeviceSteps`` (``call.dev``), which does what executor._slice does on
the host, with ringcomm.kernels.device.
"""
from __future__ import annotations

import time

from .buffers import address
from .env import env_number
from .executor import Executor

DEFAULT_CUDA_BUFFSIZE = 64 * 1024 * 1024
CLOSE_GRACE = 5.0


def cuda_slot_bytes(nslots: int) -> int:
    """Bytes per device slot: RINGCOMM_CUDA_BUFFSIZE split over the FIFO's slots, 256-byte aligned."""
    buffsize = env_number("RINGCOMM_CUDA_BUFFSIZE", DEFAULT_CUDA_BUFFSIZE, int)
    return max(256, buffsize // nslots // 256 * 256)


class DeviceSteps:
    """One slice of a step on the GPU (what executor._slice does on the host): the value is computed where it
    is needed first -- the output, or the outgoing slot -- and copied (cudaMemcpyAsync) where else it goes."""

    def __init__(self, kernels, stream):
        self.k, self.stream = kernels, stream

    def apply(self, step, call, x_in, x_out, srcs, dsts, world_size) -> None:
        k, s = self.k, self.stream
        if not step.recvs:
            value = x_in
        elif not step.reduces:
            value = srcs[0]
        else:
            value = x_out if step.copies else dsts[0]
            k.reduce_copy(value, x_in, srcs[0], call.op, s)
            for extra in srcs[1:]:
                k.reduce(value, extra, call.op, s)
            if step.final:
                k.postprocess(value, call.op, world_size, s)
        at = address(value)
        if step.copies and address(x_out) != at:
            k.copy(x_out, value, s)
        for d in dsts:
            if address(d) != at:
                k.copy(d, value, s)


class DeviceLinks:
    """The executor's view of the communicator's links for device calls: cuda_ipc, on our stream."""

    def __init__(self, links, slot_bytes: int, stream: int):
        self.links, self.slot_bytes, self.stream = links, slot_bytes, stream
        self.conns: dict = {}

    def __call__(self, peer: int, direction: str):
        conn = self.conns.get((peer, direction))
        if conn is None:
            conn = self.links.device(peer, direction, self.slot_bytes)
            conn.stream = self.stream
            self.conns[(peer, direction)] = conn
        return conn

    def prepare(self, srcs, dsts) -> None:
        for p in sorted(dsts):       # sends first: the order that keeps connecting deadlock-free
            self(p, "send")
        for p in sorted(srcs):
            self(p, "recv")


class _Runtime:
    """Streams and events through cupy; numba's CUDA simulator (synchronous) needs none of it."""

    def __init__(self, simulated: bool):
        self.rt = None
        if not simulated:
            try:
                import cupy
            except ImportError as e:
                raise ImportError(f"device buffers need cupy: pip install 'ringcomm[cuda]' ({e})") from e
            self.rt = cupy.cuda.runtime

    def device(self) -> int:
        return 0 if self.rt is None else self.rt.getDevice()

    def device_of(self, ptr: int) -> int:
        return 0 if self.rt is None else self.rt.pointerGetAttributes(ptr).device

    def stream(self) -> int:
        return 0 if self.rt is None else self.rt.streamCreateWithFlags(self.rt.streamNonBlocking)

    def event(self) -> int:
        return 0 if self.rt is None else self.rt.eventCreateWithFlags(self.rt.eventDisableTiming)

    def order(self, waiter: int, after: int, event: int) -> None:
        """Work queued on ``waiter`` from now on runs after the work queued on ``after`` so far."""
        if self.rt is not None:
            self.rt.eventRecord(event, after)
            self.rt.streamWaitEvent(waiter, event, 0)

    def close(self, stream: int, events) -> None:
        if self.rt is None:
            return
        deadline = time.monotonic() + CLOSE_GRACE
        while self.rt.streamQuery(stream) != 0:     # a peer that died may leave our stream waiting for ever
            if time.monotonic() > deadline:
                return                              # leak the stream and events: the process is going down
            time.sleep(1e-3)
        for e in events:
            self.rt.eventDestroy(e)
        self.rt.streamDestroy(stream)


def _stream_ptr(arr) -> int:
    """The raw cudaStream_t a flat view from ringcomm.buffers is bound to (the caller's stream); 0: legacy."""
    s = getattr(arr, "stream", 0)
    return int(s) if s else 0                       # numba's Stream.__int__: the handle (0: the default)


class DevicePath:
    def __init__(self, links, host: Executor):
        from ringcomm.kernels import device as kernels
        self.rt = _Runtime(kernels.SIMULATOR)
        self.device = self.rt.device()
        self.stream = self.rt.stream()
        self.events = (self.rt.event(), self.rt.event())
        slot_bytes = cuda_slot_bytes(host.nslots)
        self.links = DeviceLinks(links, slot_bytes, self.stream)
        self.executor = Executor(host.rank, host.world_size, self.links, host.timeout, slot_bytes, host.nslots)
        self.executor.watchdog = host.watchdog
        self.steps = DeviceSteps(kernels, kernels.as_stream(self.stream))

    def run(self, sched, call) -> None:
        for arr, what in ((call.inp, "buf"), (call.out, "out")):
            if arr.size and self.rt.device_of(address(arr)) != self.device:
                raise ValueError(f"{call.name} {what} is on cuda:{self.rt.device_of(address(arr))}, but this "
                                 f"communicator runs on cuda:{self.device}, the device current at its first "
                                 f"call on device buffers: one communicator, one GPU")
        caller = _stream_ptr(call.inp)
        self.rt.order(self.stream, caller, self.events[0])
        call.dev = self.steps
        try:
            self.executor.run(sched, call)
        finally:
            self.rt.order(caller, self.stream, self.events[1])

    def close(self) -> None:
        self.rt.close(self.stream, self.events)
