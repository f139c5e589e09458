"""CUDA IPC transport: same-host peers whose buffers live on GPUs (NCCL's P2P transport, driven from Python).

A connection is the shm transport's FIFO protocol (head / tail counters, sizes, pids and closed flags in a
small /dev/shm segment: waiting, liveness, abort and the watchdog are shm.py's own) with the slots where a
GPU reaches them. The receiver decides where, at connect time (it alone can tell whether a handle opens),
and writes its choice into the segment's MODE word:

- IPC: the ``nslots`` slots are one cudaMalloc of the *sender* (connect_send must never wait for the
  peer's connect_recv, see transport/base.py), exported with cudaIpcGetMemHandle and mapped by the
  receiver with cudaIpcOpenMemHandle;
- STAGED: the slots are the segment's own pages, pinned and mapped into both processes' GPUs with
  cudaHostRegister: the sender's kernels write host memory over PCIe, the receiver's read it. Chosen when
  IPC cannot work: RINGCOMM_P2P_DISABLE=1 (as NCCL_P2P_DISABLE), both ranks in one process, the peer's
  GPU not visible here (per-rank CUDA_VISIBLE_DEVICES), no peer access between the two GPUs, no handle
  exported (a container that refuses CUDA IPC) or one that fails to open. RINGCOMM_DEBUG=info prints the
  choice for every peer.

Ordering on the GPU, without the host ever waiting for it: two flag words in the segment header (pinned
and mapped too, see cuda_rt.Flag). The sender's stream writes FILLED = k + 1 after its work on slice k
(a write that fences that work first), *then* the host moves the counter; the receiver's stream waits for
FILLED >= k + 1 before the kernels that read slot k % nslots, and writes FREED = k + 1 after them; the
sender's stream waits for FREED >= k + 1 - nslots before it writes that slot again. A flag a dead peer
will never write does not hang our stream: close() (and so abort) writes RELEASE into the flags our
stream waits on, and frees or unmaps memory only once our stream has drained, within a deadline; what
is still in use then is leaked, not freed under a running kernel. Where the driver cannot run stream
memory operations (or RINGCOMM_CUDA_IPC_SYNC=1), the host polls the stream idle before each counter moves.

``conn.stream`` (a cudaStream_t as an int) is the stream all this is queued on: ringcomm's device path
sets it to a stream of its own. The runtime is ringcomm.transport.cuda_rt's (a GPU, numba's simulator,
the tests' fake one).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from . import cuda_rt, futex
from .base import LinkContext, PeerGone, PeerTimeout, RecvConnection, SendConnection, wait_key
from .cuda_rt import CudaError, Flag
from .shm import CLOSED, HDR, RECEIVER_PID, SEND_SLEEPS, SIZES, ShmRecv, ShmSend, ShmTransport, _pid_alive, _Segment

CLOSE_GRACE = 5.0       # seconds close() lets our stream drain before it leaks what the stream may still use
MODE, FILLED, FREED = 384, 392, 400     # int64 words of the segment header, each on a cache line of its own
IPC, STAGED = 1, 2
_PATH = {IPC: "IPC (device memory, peer to peer)", STAGED: "STAGED through pinned host memory"}
MAX_SLOTS = MODE - SIZES


def _env_on(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _quietly(fn, *args) -> None:
    """A cleanup on an error path: its own failure must not replace the error being raised."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        pass


def _info(msg: str) -> None:
    if "info" in os.environ.get("RINGCOMM_DEBUG", "").lower().split(","):
        sys.stderr.write(f"ringcomm: {msg}\n")


class _Payload:
    """What a device receive hands the executor: the payload's size, checked before typed() views it."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size


class _DeviceLink:
    """What both ends add to the shm link: the slots as device arrays, the flags, the stream."""

    transport = "cuda_ipc"

    def _setup_device(self, rt, base: int, imported: bool):
        self.rt, self.base, self.imported, self.stream = rt, base, imported, 0
        self.device = rt.get_device()       # close() makes it current again, whichever thread closes
        self.deadline = 0.0                 # the last acquire / wait's: a host-synchronised post keeps it
        self.waited = 0                     # the highest flag value our stream has been told to wait for
        self.registered: list = []
        self.slots: list | None = None
        self._typed: dict = {}
        self.host_sync = _env_on("RINGCOMM_CUDA_IPC_SYNC") or not rt.mem_ops()
        words = self.seg.words
        dev = rt.host_register(words)
        self.registered.append(words)
        self.filled = Flag(words[FILLED:FILLED + 1], dev + 8 * FILLED)
        self.freed = Flag(words[FREED:FREED + 1], dev + 8 * FREED)

    def _map_slots(self, mode: int) -> None:
        n, size = self.nslots, self.slot_bytes
        if mode == STAGED:
            region = np.frombuffer(self.seg.map, np.uint8)[HDR:HDR + n * size]
            dev = self.rt.host_register(region) if n * size else 0
            self.registered.append(region)
            self.slots = [self.rt.view(dev + i * size, size, region[i * size:(i + 1) * size]) for i in range(n)]
        else:
            self.slots = [self.rt.view(self.base + i * size, size) for i in range(n)]
        self.mode = mode

    def _signal(self, flag: Flag, value: int, deadline: float) -> None:
        """After the work queued so far: the stream writes the flag, or the host waits until it is done."""
        if self.host_sync:
            if not cuda_rt.drain(self.rt, self.stream, max(deadline, time.monotonic() + 1.0), abort=self.ctx.abort):
                raise PeerTimeout(f"this rank's GPU stream did not finish its work on a slot for rank {self.peer} "
                                  f"in time (host-synchronised cuda_ipc)", peer=self.peer, transport=self.transport)
            flag.host[0] = value
        else:
            self.rt.write_value(self.stream, flag, value)

    def typed(self, dtype, k: int):
        """The first ``k`` elements of the slot in hand (the one acquire / wait returned) as ``dtype``;
        the typed view of each (slot, dtype) is made once."""
        i = (self.posted if isinstance(self, CudaIpcSend) else self.released) % self.nslots
        view = self._typed.get((i, dtype))
        if view is None:
            slot = self.slots[i]
            view = self._typed[(i, dtype)] = slot[: slot.size // dtype.itemsize * dtype.itemsize].view(dtype)
        return view[:k]

    def _wait_flag(self, flag: Flag, value: int) -> None:
        self.waited = value
        self.rt.wait_value(self.stream, flag, value)

    def stuck_on(self) -> str | None:
        """What our stream may be waiting for on this link, if its flag is behind: for the progress watch."""
        recv = isinstance(self, CudaIpcRecv)
        flag, what = (self.filled, "data of slice") if recv else (self.freed, "a free slot after slice")
        have = int(flag.host[0]) if self.seg.words is not None else self.waited
        if have >= self.waited:
            return None
        return (f"rank {self.peer}'s {what} {have} on this link (its GPU has signalled {have} of the "
                f"{self.waited} our stream waits for)")

    def waited_flag(self) -> Flag | None:
        """The flag our stream may wait on (None if it never waited on one)."""
        return (self.filled if isinstance(self, CudaIpcRecv) else self.freed) if self.waited else None

    def peer_dead(self) -> bool:
        words = self.seg.words
        return words is not None and not _pid_alive(int(words[self._peer_pid_word]))

    def peer_cannot_write(self) -> bool:
        """The peer will never write its flag again: it died, or closed its end."""
        words = self.seg.words
        return words is None or bool(words[self._peer_closed_word]) or not _pid_alive(int(words[self._peer_pid_word]))

    def _free(self, stuck: bool) -> None:
        """Unpin and free what this end owns, unless our stream may still use it (then it is leaked)."""
        if stuck:
            return
        errors = []
        for region in self.registered:
            try:
                self.rt.host_unregister(region)
            except CudaError as e:
                errors.append(e)
        self.registered = []
        if self.base:
            try:
                (self.rt.ipc_close if self.imported else self.rt.free)(self.base)
            except CudaError as e:
                errors.append(e)
            self.base = 0
        # STAGED slots, their typed views and the flags view the segment's mapping, which closes
        # (and gives back its fd) only once no view of it is left: the flags keep a copy of their word
        # (a patrol may still read them), the slots go.
        self.slots, self._typed = None, {}
        self.filled, self.freed = (Flag(f.host.copy(), f.dev) for f in (self.filled, self.freed))
        for e in errors:                      # cleanup never raises: an earlier error is what matters
            _info(f"cuda_ipc to rank {self.peer}: cleanup: {e}")


class CudaIpcSend(_DeviceLink, ShmSend):
    def __init__(self, ctx, peer, seg, rt, base):
        ShmSend.__init__(self, ctx, peer, seg)
        self._setup_device(rt, base, imported=False)

    def acquire(self, deadline: float):
        if self.slots is None:                          # the receiver's choice, once: it is connected by now
            words = self._words()                       # (closed: Aborted)
            if not words[MODE]:
                self._wait(lambda: words[MODE] != 0, deadline, "the slot placement (ipc or staged) from",
                           MODE, SEND_SLEEPS)      # the receiver wakes MODE's futex when it writes it
            self._map_slots(int(words[MODE]))
            _info(f"rank {self.ctx.rank} -> rank {self.peer}: cuda_ipc {_PATH[int(words[MODE])]} (the receiver's choice)")
        k, self.deadline = self.posted, deadline
        super().acquire(deadline)                       # the host counters say slot k % nslots is free ...
        if k >= self.nslots and not self.host_sync:     # ... and the stream waits for the reader's kernels
            self._wait_flag(self.freed, k + 1 - self.nslots)
        return self.slots[k % self.nslots]

    def ready(self) -> bool:
        words = self.seg.words      # closed by this process: acquire() raises at once
        if words is None:
            return True
        # the first acquire also waits for the receiver's slot placement
        return (self.slots is not None or bool(words[MODE])) and super().ready()

    def post(self, nbytes: int) -> None:
        self._signal(self.filled, self.posted + 1, self.deadline)   # before the counter moves
        super().post(nbytes)

    def close(self) -> None:
        if self.seg.words is not None:                  # the memory is freed by the transport's close
            self.seg.words[CLOSED] = 1

    def finish(self, deadline: float, stuck: bool) -> None:
        """Free the slots once the receiver let go of them (or died) and our stream has drained; leak them
        otherwise."""
        words = self.seg.words
        if words is None:
            return
        self.seg.unlink()                   # no receiver can attach from now on

        def peer_done() -> bool:            # never attached (its connect failed), closed its end, or died
            pid = int(words[RECEIVER_PID])
            return not pid or bool(words[CLOSED + 1]) or not _pid_alive(pid)
        while not peer_done() and time.monotonic() < deadline:
            time.sleep(1e-3)
        peer_done = peer_done()
        self._free(stuck or not peer_done)
        words = None                        # a view of the mapping: it would keep it (and its fd) open
        self.seg.close()


class CudaIpcRecv(_DeviceLink, ShmRecv):
    def __init__(self, ctx, peer, seg, rt, base, mode):
        ShmRecv.__init__(self, ctx, peer, seg)
        self._setup_device(rt, base, imported=mode == IPC)
        self._map_slots(mode)

    def wait(self, deadline: float):
        k, self.deadline = self.released, deadline
        super().wait(deadline)                          # the host counter says slice k is posted ...
        i = k % self.nslots
        if not self.host_sync:                          # ... and the stream waits for the writer's work
            self._wait_flag(self.filled, k + 1)
        return _Payload(int(self.seg.words[SIZES + i]))     # its data: typed(), once the size is checked

    def release(self) -> None:
        self._signal(self.freed, self.released + 1, self.deadline)
        super().release()

    def close(self) -> None:
        """Nothing yet: the transport's close unmaps, once our stream has drained (see finish)."""

    def finish(self, stuck: bool) -> None:
        if self.seg.words is None:
            return
        self._free(stuck)
        ShmRecv.close(self)                             # CLOSED + 1: the sender may free its slots now


class CudaIpcTransport(ShmTransport):
    name = "cuda_ipc"
    _serial = 0

    def __init__(self, ctx: LinkContext):
        super().__init__(ctx)
        if ctx.nslots > MAX_SLOTS:
            raise ValueError(f"cuda_ipc supports at most {MAX_SLOTS} slots per FIFO, got {ctx.nslots}")
        self.rt = cuda_rt.get()
        self.device = self.rt.get_device()
        self.p2p = not _env_on("RINGCOMM_P2P_DISABLE") and getattr(self.rt, "ipc", True)

    def _key(self, src: int, dst: int) -> str:
        return f"{self.ctx.prefix}/cuda_ipc/{src}->{dst}"

    def connect_send(self, peer: int, deadline: float) -> SendConnection:
        self._check_open(peer)
        CudaIpcTransport._serial += 1
        name = f"rc-{self.job}-{os.getpid()}-g{CudaIpcTransport._serial}"
        ctx, rt = self.ctx, self.rt
        # reserve=False: the slot pages stay untouched (and unreserved) unless the link falls back to STAGED
        seg = _Segment(name, ctx.nslots, ctx.slot_bytes, create=True, reserve=False)
        published = {"seg": name, "pid": os.getpid(), "bus": rt.bus_id(self.device), "mem": "", "why": ""}
        base = 0
        try:
            if self.p2p:
                base = rt.malloc(ctx.nslots * ctx.slot_bytes)
                try:
                    published["mem"] = rt.ipc_handle(base).hex()
                except CudaError as e:                  # e.g. a container runtime that refuses CUDA IPC
                    published["why"] = str(e)
            else:
                published["why"] = "RINGCOMM_P2P_DISABLE=1" if getattr(self.rt, "ipc", True) else \
                    f"the {rt.name} runtime has no CUDA IPC"
            conn = CudaIpcSend(ctx, peer, seg, rt, base)
        except BaseException as e:
            # Tell the receiver at once (it would otherwise wait for the key until its timeout); a
            # cleanup that fails too (a sticky CUDA error fails cudaFree as well) never hides e.
            _quietly(ctx.store.set, self._key(ctx.rank, peer),
                     json.dumps({"failed": f"{type(e).__name__}: {e}"}).encode())
            if base:
                _quietly(rt.free, base)
            _quietly(seg.unlink)
            _quietly(seg.close)
            if isinstance(e, CudaError):
                raise CudaError(f"{e.call} (connecting to send to rank {peer})", e.error, e.code) from None
            raise
        if not published["mem"]:            # the receiver can only choose STAGED: no need to wait for it
            conn._map_slots(STAGED)
            _info(f"rank {ctx.rank} -> rank {peer}: cuda_ipc {_PATH[STAGED]}: {published['why']}")
        self.links.append(conn)
        ctx.store.set(self._key(ctx.rank, peer), json.dumps(published).encode())
        return conn

    def connect_recv(self, peer: int, deadline: float) -> RecvConnection:
        self._check_open(peer)
        published = json.loads(wait_key(self.ctx, self._key(peer, self.ctx.rank), deadline, peer, self.name))
        if "failed" in published:
            raise PeerGone(f"rank {peer} failed to set up its end: {published['failed']}", peer=peer,
                           transport=self.name)
        try:
            seg = _Segment(published["seg"], self.ctx.nslots, self.ctx.slot_bytes, create=False, reserve=False)
        except FileNotFoundError:
            raise PeerGone(f"rank {peer}'s segment {published['seg']} vanished before this rank mapped it",
                           peer=peer, transport=self.name) from None
        mode, why, base = self._choose(peer, published)
        if mode == IPC:
            try:
                base = self.rt.ipc_open(bytes.fromhex(published["mem"]))
            except CudaError as e:
                mode, why = STAGED, f"its memory handle did not open here: {e}"
        try:
            conn = CudaIpcRecv(self.ctx, peer, seg, self.rt, base, mode)
        except BaseException as e:
            if base:
                _quietly(self.rt.ipc_close, base)       # never hides e (a sticky error fails it too)
            _quietly(seg.close)
            if isinstance(e, CudaError):
                raise CudaError(f"{e.call} (connecting to receive from rank {peer})", e.error, e.code) from None
            raise
        seg.words[MODE] = mode                          # the sender maps its slots by this
        if seg.words[SEND_SLEEPS]:                      # its first acquire sleeps on MODE's futex
            futex.wake(seg.base + 8 * MODE)
        self.links.append(conn)
        _info(f"rank {self.ctx.rank} <- rank {peer}: cuda_ipc {_PATH[mode]}{': ' + why if why else ''}")
        return conn

    def _choose(self, peer: int, pub: dict) -> tuple[int, str, int]:
        """IPC, or STAGED and why: everything that can be known before trying to open the handle."""
        if not pub["mem"]:
            return STAGED, f"rank {peer} exported no memory handle ({pub['why']})", 0
        if pub["pid"] == os.getpid():
            return STAGED, "both ranks are in one process (a process cannot open its own IPC handle)", 0
        theirs = self.rt.device_with_bus_id(pub["bus"])
        if theirs is None:
            return STAGED, f"rank {peer}'s GPU {pub['bus']} is not visible to this process (CUDA_VISIBLE_DEVICES)", 0
        if theirs != self.device and not self.rt.can_access_peer(self.device, theirs):
            return STAGED, f"no peer access from cuda:{self.device} to cuda:{theirs}", 0
        return IPC, "", 0

    def close(self) -> None:
        """Drain our stream, then receivers unmap the peers' slots, then senders free their own once their
        receivers have let go; all within one CLOSE_GRACE, whatever the peers or the GPU do.

        Every rank closes all its connections before its transports, so these waits end as soon as the
        peers reach their own close. A flag our stream waits on is released (held at RELEASE) once its peer
        cannot write it any more (dead, closed), on abort, or after half the grace: a live peer's GPU
        normally catches up long before, and releasing early would let our stream reuse a slot the peer
        still reads."""
        self.closed = True  # later connects raise Aborted, as on shm
        for link in self.links:  # the senders' CLOSED word, as comm's Links.close sets it first
            link.close()
        deadline = time.monotonic() + CLOSE_GRACE
        half = time.monotonic() + CLOSE_GRACE / 2
        abort = self.ctx.abort
        links = [link for link in self.links if isinstance(link, _DeviceLink)]
        stuck: dict[int, bool] = {}
        with cuda_rt.on_device(self.rt, self.device, quiet=True):
            for stream in {link.stream for link in links}:
                mine = [link for link in links if link.stream == stream and link.waited_flag() is not None]

                def release(mine=mine) -> None:
                    late = time.monotonic() > half or (abort is not None and abort.is_set())
                    for link in mine:
                        if late or link.peer_cannot_write():
                            link.waited_flag().release()
                stuck[stream] = not cuda_rt.drain(self.rt, stream, deadline, release)
            for link in links:
                if isinstance(link, CudaIpcRecv):
                    link.finish(stuck[link.stream])
            for link in links:
                if isinstance(link, CudaIpcSend):
                    link.finish(deadline, stuck[link.stream])
        if any(stuck.values()):
            _info(f"rank {self.ctx.rank}: cuda_ipc close: a stream did not drain within {CLOSE_GRACE:g} s; its "
                  f"memory is left allocated rather than freed under a running kernel")
        self.links.clear()
