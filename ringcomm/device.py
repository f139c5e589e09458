"""Collectives on device buffers: the same schedules and executor, with kernels and copies on a GPU stream.

A communicator makes its DevicePath at its first call on device buffers (see ringcomm/buffers.py), bound
to the GPU that holds that call's buffer (the current one, for an empty buffer): one communicator, one GPU,
whichever thread runs the call (an async call's runs on the progress thread). The path owns:

- a CUDA stream of ringcomm's own. Every kernel and copy of a device call, and the cuda_ipc connections'
  flag waits and writes, are queued on it, in the order the executor issues them;
- a second Executor over the same schedules, whose links are the cuda_ipc connections to the same peers
  (Links.device), with slots of RINGCOMM_CUDA_BUFFSIZE bytes per connection (64 MiB by default);
- the stream rule (NCCL's): at the start of a call our stream waits for an event recorded on the caller's
  stream; at the end, *if the call succeeded*, the caller's stream waits for one recorded on ours. A call
  that raised never chains the caller's stream to work that may never finish. The host never waits for
  the GPU: a result is ready on the caller's stream when the call returns;
- the proxy thread (proxy.py), started at the first peer on another host: it posts and releases the
  network slots the GPU reads and writes, once their events complete (transport/cuda_staged.py);
- the progress watch (device_watch.py): the end-of-call event is kept and queried at later calls and at
  close; one the GPU has not passed within RINGCOMM_TIMEOUT raises, naming the flag the stream waits on.

Every call, close and cleanup makes the communicator's GPU current in the calling thread (and restores
the caller's after). CUDA failures become DeviceError (a RingcommError: the communicator is then broken
and its links closed) naming the CUDA call and its error. The CUDA runtime is ringcomm.transport.cuda_rt's.
"""
from __future__ import annotations

import os
import sys

from ringcomm.transport import cuda_rt
from ringcomm.transport.cuda_rt import CudaError

from .buffers import address
from .device_watch import ProgressWatch
from .env import env_number
from .errors import RingcommError
from .executor import Executor
from .proxy import Proxy

DEFAULT_CUDA_BUFFSIZE = 64 * 1024 * 1024


def _info(msg: str) -> None:
    if "info" in os.environ.get("RINGCOMM_DEBUG", "").lower().split(","):
        sys.stderr.write(f"ringcomm: {msg}\n")


class DeviceError(RingcommError):
    """A CUDA call of the device path failed; ``cuda_call`` and ``cuda_error`` say which and how."""

    def __init__(self, message: str, cause: CudaError):
        super().__init__(message)
        self.cuda_call, self.cuda_error = cause.call, cause.error


def cuda_slot_bytes(nslots: int) -> int:
    """Bytes per device slot: RINGCOMM_CUDA_BUFFSIZE split over the FIFO's slots, 256-byte aligned."""
    buffsize = env_number("RINGCOMM_CUDA_BUFFSIZE", DEFAULT_CUDA_BUFFSIZE, int)
    return max(256, buffsize // nslots // 256 * 256)


class DeviceSteps:
    """One slice of a step on the GPU (what executor._slice does on the host): the value is computed where it
    is needed first -- the output, or the outgoing slot -- and copied (cudaMemcpyAsync) where else it goes.
    Work is queued through the runtime's launch, on our stream."""

    def __init__(self, kernels, rt, stream: int):
        self.k, self.rt, self.stream = kernels, rt, stream
        try:
            self.kstream = kernels.as_stream(stream)        # numba's handle on our stream, made once
        except Exception as e:  # noqa: BLE001 - numba's CudaAPIError: a CudaError, named
            raise CudaError("numba.cuda.external_stream", f"{type(e).__name__}: {e}") from e

    def apply(self, step, call, io, oo, k, srcs, dsts, world_size) -> None:
        kn, s, launch, ks = self.k, self.stream, self.rt.launch, self.kstream
        x_in = call.out[oo:oo + k] if step.base == "out" else call.inp[io:io + k]
        x_out = call.out[oo:oo + k] if step.copies or (step.reduces and not dsts) else None
        if not step.recvs:
            value = x_in
        elif not step.reduces:
            value = srcs[0]
            if step.copies and dsts:    # read the peer's slot once: into the output, then on from there
                launch(s, kn.copy, x_out, value, ks)
                value = x_out
        else:
            value = x_out if x_out is not None else dsts[0]
            launch(s, kn.reduce_copy, value, x_in, srcs[0], call.op, ks)
            for extra in srcs[1:]:
                launch(s, kn.reduce, value, extra, call.op, ks)
            if step.final:
                launch(s, kn.postprocess, value, call.op, world_size, ks)
        if step.copies and value is not x_out and not (value is x_in and address(x_in) == address(x_out)):
            launch(s, kn.copy, x_out, value, ks)
        for d in dsts:
            if d is not value:
                launch(s, kn.copy, d, value, ks)


class DeviceLinks:
    """The executor's view of the communicator's links for device calls: cuda_ipc to peers on this host, the
    network staged by the proxy thread to the others, all on our stream."""

    def __init__(self, links, slot_bytes: int, stream: int, proxy):
        self.links, self.slot_bytes, self.stream, self.proxy = links, slot_bytes, stream, proxy
        self.conns: dict = {}
        self.gpudirect: str | None = None

    @property
    def call(self):
        return self.links.call

    @call.setter
    def call(self, call) -> None:           # the executor names its call here; connect errors name it
        self.links.call = call

    @property
    def ctx(self):                          # the job's LinkContext (abort, watchdog, spins): the host links'
        return self.links.ctx

    def __call__(self, peer: int, direction: str):
        conn = self.conns.get((peer, direction))
        if conn is None:
            conn = self.links.device(peer, direction, self.slot_bytes)
            conn.stream = self.stream
            if hasattr(conn, "attach"):     # staged to another host: the proxy drives its network end
                conn.attach(self.proxy)
                _info(f"rank {self.links.ctx.rank} {'->' if direction == 'send' else '<-'} rank {peer}: "
                      f"{conn.transport}, device slices staged through its registered host slots by the proxy "
                      f"thread; {self._gpudirect()}")
            self.conns[(peer, direction)] = conn
        return conn

    def _gpudirect(self) -> str:
        if self.gpudirect is None:   # asked once per communicator
            from ringcomm.transport.cuda_staged import gpudirect
            self.gpudirect = gpudirect(cuda_rt.get(), cuda_rt.get().get_device())
        return self.gpudirect

    def prepare(self, srcs, dsts) -> None:
        for p in sorted(dsts):       # sends first: the order that keeps connecting deadlock-free
            self(p, "send")
        for p in sorted(srcs):
            self(p, "recv")


def _stream_ptr(arr) -> int:
    """The raw cudaStream_t a flat view from ringcomm.buffers is bound to (the caller's stream); 0: legacy."""
    s = getattr(arr, "stream", 0)
    return int(s) if s else 0                       # numba's Stream.__int__: the handle (0: the default)


class DevicePath:
    def __init__(self, links, host: Executor, first=None):
        """Bound to the GPU that holds the buffer of ``first``, the first device call (the one current in
        this thread if it is empty): the call may run on the progress thread, whose current device says
        nothing about the caller's."""
        from ringcomm.kernels import device as kernels
        self.rank, self.rt = host.rank, cuda_rt.get()
        try:
            if first is not None and first.inp.size:
                self.device = self.rt.device_of(address(first.inp))
            else:
                self.device = self.rt.get_device()
            with cuda_rt.on_device(self.rt, self.device):
                self.stream = self.rt.stream_create()
                self.starts = [self.rt.event_create()]     # one per caller stream of a call or group
                self.steps = DeviceSteps(kernels, self.rt, self.stream)
        except CudaError as e:
            raise DeviceError(f"rank {self.rank} (this process) could not set up its device path: {e}", e) from None
        slot_bytes = cuda_slot_bytes(host.nslots)
        self.proxy = Proxy(self.rt, self.device, host.rank, host.timeout, links.ctx.abort, links.ctx.watchdog)
        self.links = DeviceLinks(links, slot_bytes, self.stream, self.proxy)
        self.executor = Executor(host.rank, host.world_size, self.links, host.timeout, slot_bytes, host.nslots)
        self.executor.watchdog = host.watchdog
        self.watch = ProgressWatch(self.rt, host.rank, host.timeout, self.links, links.ctx.abort)

    def run(self, sched, call) -> None:
        self.run_calls([call], f"{call.name} #{call.seq}", lambda executor: self._execute(sched, call))

    def run_calls(self, calls, label: str, body) -> None:
        """Queue ``calls`` on our stream by ``body(executor)`` (one call, or a group's device members), with the
        stream rule once for all of them: our stream starts after every caller's stream, and every caller's
        stream waits for our work only if ``body`` succeeded."""
        try:
            with cuda_rt.on_device(self.rt, self.device):
                callers = list(dict.fromkeys(self._check(call) for call in calls))
                self.watch.check(label)
                for i, caller in enumerate(callers):            # our work runs after the callers' so far
                    if i == len(self.starts):
                        self.starts.append(self.rt.event_create())
                    self.rt.event_record(self.starts[i], caller)
                    self.rt.stream_wait_event(self.stream, self.starts[i])
                for call in calls:
                    self._prepare(call)
                    call.dev = self.steps
                body(self.executor)
                done = self.watch.finished(self.stream, label)
                for caller in callers:
                    self.rt.stream_wait_event(caller, done)     # success only: the callers' later work
        except CudaError as e:
            raise DeviceError(f"rank {self.rank} (this process) failed in {label} on cuda:{self.device}: {e}",
                              e) from None

    def _prepare(self, call) -> None:
        """Compile the call's kernels before its first slice; a compiler or driver failure is a CudaError."""
        try:
            self.steps.k.prepare(call.op, call.inp.dtype)
        except (TypeError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - numba's NvvmError, CudaAPIError, ...: named, not raw
            raise CudaError(f"compiling the {call.op} kernels for {call.inp.dtype}", f"{type(e).__name__}: {e}") from e

    def _execute(self, sched, call) -> None:
        """The executor's run, with the watchdog asking the device executor where this rank is."""
        watchdog = self.executor.watchdog
        saved = watchdog.position if watchdog is not None else None
        if watchdog is not None:
            watchdog.position = self.executor.position
        try:
            self.executor.run(sched, call)
        finally:
            if watchdog is not None:
                watchdog.position = saved

    def _check(self, call) -> int:
        """The caller's stream, after checking that it and the buffers are on our GPU and not captured."""
        for arr, what in ((call.inp, "buf"), (call.out, "out")):
            dev = self.rt.device_of(address(arr)) if arr.size else self.device
            if dev != self.device:
                raise ValueError(f"{call.name} {what} is on cuda:{dev}, but this communicator runs on cuda:"
                                 f"{self.device}, the GPU of its first call's buffers: "
                                 f"one communicator, one GPU")
        caller = _stream_ptr(call.inp)
        dev = self.rt.stream_device(caller)
        if dev is not None and dev != self.device:
            raise ValueError(f"{call.name}: the caller's stream is on cuda:{dev}, but this communicator runs "
                             f"on cuda:{self.device}")
        if self.rt.stream_capturing(caller):
            raise ValueError(f"{call.name}: the caller's stream is being captured into a CUDA graph; ringcomm's "
                             f"device collectives are driven by the host slice by slice and cannot be captured: "
                             f"call it outside the capture")
        return caller

    def close(self) -> None:
        """After the links (whose close drains our stream, releasing what it waits on): drop the events and
        the stream if the stream has drained by the deadline, else leave them (never block past it)."""
        self.proxy.close()
        with cuda_rt.on_device(self.rt, self.device, quiet=True):
            drained = self.watch.close(self.stream)
            try:
                if drained:
                    for event in self.starts:
                        self.rt.event_destroy(event)
                    self.rt.stream_destroy(self.stream)
            except CudaError:
                pass                                        # cleanup never hides the error that led here
