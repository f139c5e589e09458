"""CUDA IPC transport: same-host peers whose buffers live on GPUs (NCCL's P2P transport, driven from Python).

A connection is the shm transport's FIFO protocol with the slots moved to device memory:

- the head / tail counters, slot sizes, pids and closed flags stay in a small /dev/shm segment, so waiting,
  liveness checks, abort and the watchdog are shm.py's own (the classes below extend ShmSend / ShmRecv);
- the ``nslots`` slots are one cudaMalloc of the *sender*, exported with cudaIpcGetMemHandle and mapped
  by the receiver with cudaIpcOpenMemHandle (peer access enabled lazily, so the receiver may be another
  GPU of the host). The sender allocates because connect_send must never wait for the peer's connect_recv
  (see transport/base.py); NCCL puts the buffer on the receiver instead, so that peers write across NVLink
  rather than read. On one GPU the two are the same memory;
- two IPC events per slot, also the sender's: ``filled[i]`` and ``freed[i]``. The data never waits on
  the host. The sender's writes into slot i (a reduce kernel or a cudaMemcpyAsync, queued by the
  executor) are followed by ``eventRecord(filled[i])`` on the connection's stream, *then* the host
  counter moves; the receiver, seeing the counter, queues ``streamWaitEvent(filled[i])`` before the
  kernels that read the slot, and ``eventRecord(freed[i])`` after them before it gives the slot back; the
  sender queues ``streamWaitEvent(freed[i])`` before it writes slot i again. CUDA allows recording and
  waiting on an IPC event in either process (cudaIpcGetEventHandle), and a wait orders after the record
  that precedes it, which the host counters guarantee.

``conn.stream`` (a cudaStream_t as an int) is the stream all this is queued on; every kernel and copy that
touches a slot must run on it. ringcomm's device path sets it to a stream of its own (not the caller's);
0, the legacy default stream, until set.

RINGCOMM_CUDA_IPC_SYNC=1 adds a host-side stream synchronisation before every counter moves (a plain flag
protocol, the events then being redundant): slower, but it tells a protocol fault from an event fault.

Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, for tests without a GPU) the slots stay in the
/dev/shm segment, viewed as simulator device arrays, and the events are no-ops (the simulator runs every
kernel synchronously): the protocol, connecting and closing are the same code.
"""
from __future__ import annotations

import json
import os
import time

from .base import LinkContext, PeerGone, RecvConnection, SendConnection, wait_key
from .shm import CLOSED, RECEIVER_PID, SIZES, ShmRecv, ShmSend, ShmTransport, _pid_alive, _Segment

CLOSE_GRACE = 5.0       # seconds close() waits for the peer's GPU work before it frees or unmaps anyway
HOST_SYNC = os.environ.get("RINGCOMM_CUDA_IPC_SYNC", "") not in ("", "0")


def _simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")


class _Cuda:
    """The CUDA runtime calls this transport makes, through cupy (imported on first use)."""

    def __init__(self):
        try:
            import cupy
            from numba import cuda
        except ImportError as e:
            raise ImportError(f"the cuda_ipc transport needs cupy and numba-cuda: pip install 'ringcomm[cuda]' "
                              f"({e})") from e
        self.rt, self.cuda = cupy.cuda.runtime, cuda
        self.stuck: set[int] = set()

    def alloc(self, nbytes: int, nevents: int) -> tuple[int, list, dict]:
        rt = self.rt
        base = rt.malloc(nbytes)
        events = [rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess) for _ in range(nevents)]
        published = {"mem": rt.ipcGetMemHandle(base).hex(), "events": [rt.ipcGetEventHandle(e).hex() for e in events],
                     "device": rt.getDevice()}
        return base, events, published

    def attach(self, published: dict, nevents: int) -> tuple[int, list]:
        rt = self.rt
        base = rt.ipcOpenMemHandle(bytes.fromhex(published["mem"]))   # lazily enables peer access
        return base, [rt.ipcOpenEventHandle(bytes.fromhex(h)) for h in published["events"]]

    def views(self, base: int, nslots: int, slot_bytes: int, seg) -> list:
        """The slots as numba uint8 device arrays (the executor slices and views them)."""
        return [self.cuda.from_cuda_array_interface(
            {"shape": (slot_bytes,), "strides": None, "typestr": "|u1", "version": 3,
             "data": (base + i * slot_bytes, False)}, owner=None, sync=False) for i in range(nslots)]

    def record(self, event: int, stream: int) -> None:
        self.rt.eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        self.rt.streamWaitEvent(stream, event, 0)

    def sync(self, stream: int) -> None:
        if HOST_SYNC:
            self.rt.streamSynchronize(stream)

    def idle(self, stream: int, deadline: float) -> bool:
        """Poll until the stream has drained (True) or the deadline passes (False): never block for ever on
        a peer that died with our stream waiting for its event. A stream found stuck stays stuck."""
        while stream not in self.stuck and self.rt.streamQuery(stream) != 0:
            if time.monotonic() > deadline:
                self.stuck.add(stream)
            time.sleep(1e-3)
        return stream not in self.stuck

    def free(self, base: int, events: list, imported: bool) -> None:
        for e in events:
            self.rt.eventDestroy(e)
        (self.rt.ipcCloseMemHandle if imported else self.rt.free)(base)


class _Simulated(_Cuda):
    """Slots in the /dev/shm segment as simulator arrays; events are no-ops."""

    def __init__(self):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        self.fake = FakeCUDAArray

    def alloc(self, nbytes, nevents):
        return 0, [0] * nevents, {"mem": "", "events": [], "device": 0}

    def attach(self, published, nevents):
        return 0, [0] * nevents

    def views(self, base, nslots, slot_bytes, seg):
        return [self.fake(s) for s in seg.slots]

    def record(self, event, stream):
        pass

    def wait(self, stream, event):
        pass

    def sync(self, stream):
        pass

    def idle(self, stream, deadline):
        return True

    def free(self, base, events, imported):
        pass


class _DeviceSlots:
    """What both ends add to the shm link: device slots and, per slot, a "filled" event (the
    writer's copy is done) and a "freed" event (the reader's kernels are done)."""

    transport = "cuda_ipc"

    def __init__(self, ctx, peer, seg, cuda, base, events):
        super().__init__(ctx, peer, seg)
        self.cuda, self.base, self.events, self.stream = cuda, base, events, 0
        self.slots = cuda.views(base, ctx.nslots, ctx.slot_bytes, seg)
        self.filled, self.freed = events[:ctx.nslots], events[ctx.nslots:]


class CudaIpcSend(_DeviceSlots, ShmSend):
    def acquire(self, deadline: float):
        super().acquire(deadline)                       # the host counters say slot i is free ...
        i = self.posted % self.nslots
        self.cuda.wait(self.stream, self.freed[i])      # ... and the stream waits for the reader's kernels
        return self.slots[i]

    def post(self, nbytes: int) -> None:
        self.cuda.record(self.filled[self.posted % self.nslots], self.stream)    # before the counter moves
        self.cuda.sync(self.stream)
        super().post(nbytes)

    def close(self) -> None:
        if self.seg.words is not None:                  # the memory is freed by the transport's close
            self.seg.words[CLOSED] = 1

    def finish(self, deadline: float) -> None:
        """Free the slots once the receiver has let go of them (or is gone); leak them otherwise."""
        words = self.seg.words
        if words is None:
            return
        while not words[CLOSED + 1] and _pid_alive(int(words[RECEIVER_PID])) and time.monotonic() < deadline:
            time.sleep(1e-3)
        if words[CLOSED + 1] or not _pid_alive(int(words[RECEIVER_PID])):
            self.cuda.free(self.base, self.events, imported=False)
        # Under the simulator the slots view the segment, and so does ``words``: the mapping closes
        # only once no view is left.
        self.slots = words = None
        self.seg.unlink()
        self.seg.close()


class CudaIpcRecv(_DeviceSlots, ShmRecv):
    def wait(self, deadline: float):
        super().wait(deadline)                          # the host counter says slot i is posted ...
        i = self.released % self.nslots
        self.cuda.wait(self.stream, self.filled[i])     # ... and the stream waits for the writer's work
        return self.slots[i][: int(self.seg.words[SIZES + i])]

    def release(self) -> None:
        self.cuda.record(self.freed[self.released % self.nslots], self.stream)   # before the counter moves
        self.cuda.sync(self.stream)
        super().release()

    def close(self) -> None:
        if self.seg.words is None:
            return
        if self.cuda.idle(self.stream, time.monotonic() + CLOSE_GRACE):    # nothing of ours still reads
            self.cuda.free(self.base, self.events, imported=True)
        self.slots = None  # as in CudaIpcSend.finish
        super().close()


class CudaIpcTransport(ShmTransport):
    name = "cuda_ipc"
    _serial = 0

    def __init__(self, ctx: LinkContext):
        super().__init__(ctx)
        self.cuda = _Simulated() if _simulated() else _Cuda()

    def _key(self, src: int, dst: int) -> str:
        return f"{self.ctx.prefix}/cuda_ipc/{src}->{dst}"

    def connect_send(self, peer: int, deadline: float) -> SendConnection:
        self._check_open(peer)
        CudaIpcTransport._serial += 1
        name = f"rc-{self.job}-{os.getpid()}-g{CudaIpcTransport._serial}"
        ctx, sim = self.ctx, isinstance(self.cuda, _Simulated)
        seg = _Segment(name, ctx.nslots, ctx.slot_bytes if sim else 0, create=True)   # counters (+ sim slots)
        base, events, published = self.cuda.alloc(ctx.nslots * ctx.slot_bytes, 2 * ctx.nslots)
        conn = CudaIpcSend(ctx, peer, seg, self.cuda, base, events)
        self.links.append(conn)
        self.ctx.store.set(self._key(ctx.rank, peer), json.dumps({"seg": name, **published}).encode())
        return conn

    def connect_recv(self, peer: int, deadline: float) -> RecvConnection:
        self._check_open(peer)
        published = json.loads(wait_key(self.ctx, self._key(peer, self.ctx.rank), deadline, peer, self.name))
        sim = isinstance(self.cuda, _Simulated)
        try:
            seg = _Segment(published["seg"], self.ctx.nslots, self.ctx.slot_bytes if sim else 0, create=False)
        except FileNotFoundError:
            raise PeerGone(f"rank {peer}'s segment {published['seg']} vanished before this rank mapped it",
                           peer=peer, transport=self.name) from None
        base, events = self.cuda.attach(published, 2 * self.ctx.nslots)
        conn = CudaIpcRecv(self.ctx, peer, seg, self.cuda, base, events)
        self.links.append(conn)
        return conn

    def close(self) -> None:
        # Receivers first (they unmap the peers' slots), then senders free their own slots once their
        # receivers have let go: every rank closes all its connections before its transports, so these
        # waits end as soon as the peers reach their own close.
        self.closed = True
        deadline = time.monotonic() + CLOSE_GRACE
        for link in self.links:
            link.close()
        for link in self.links:
            if isinstance(link, CudaIpcSend):
                link.finish(deadline)
        self.links.clear()
