"""Device slices to and from a peer on another host: staged through the network connection's host slots.

A device call whose peer is reached over tcp or ibverbs uses that transport's own connection (made with the
device path's slot size, under a prefix of its own) and lets the GPU reach its slots directly: each slot's
host memory is registered with cudaHostRegister (portable, mapped) once, so kernels and copies on our stream
write the outgoing slot and read the incoming one over PCIe, without a staging copy.

The network must not see a slot before the GPU has written it, and a slot must not be given back before our
kernels have read it. Neither wait happens in the caller's thread: the communicator's proxy thread
(ringcomm/proxy.py) owns the network connection. It keeps slots in hand ahead of the caller (free ones to
send into, arrived ones to read), and the caller's post() / release() only record an event on our stream
and hand the slot back; the proxy posts or releases it once the event has completed. The connection may
hold all ``nslots`` slots at once (see transport/base.py), so the GPU runs up to a FIFO ahead.

Only the proxy thread calls the network connection, and ``pump`` never blocks: it acts only on what
ready() and the events say is done. What the caller and the proxy share (``in_hand``, ``queue``) is
guarded by the proxy's condition.

GPUDirect RDMA (registering device memory with the NIC) is not used: the slots are host memory.
``gpudirect()`` says whether this machine could (ringcomm/device.py reports it).
"""
from __future__ import annotations

import collections
import ctypes
import glob
import time

import numpy as np

from . import cuda_rt
from .base import PeerTimeout, TransportError

_kept: list = []    # host slots a stuck stream may still use: never unpinned or freed (see close)


class _Staged:
    def __init__(self, conn, rt, name: str):
        self.conn, self.rt, self.stream = conn, rt, 0
        self.peer, self.slot_bytes, self.transport = conn.peer, conn.slot_bytes, name
        self.nslots = conn.ctx.nslots
        self.proxy = None
        self.views: dict = {}        # host slot address -> (host array, device view, owner), registered once
        self.typed_views: dict = {}  # (address, dtype) -> typed view
        self.current = None          # the address of the slot in the caller's hands
        self.in_hand: collections.deque = collections.deque()  # the proxy's slots for the caller, oldest first
        self.queue: collections.deque = collections.deque()  # (nbytes, event, deadline) for the proxy
        self.spare: list = []        # events the proxy is done with
        self.wanted = False          # a caller waits in take(): the proxy keeps polling
        self.deadline = 0.0          # the caller's last take's (0: never asked; a send link then takes nothing)
        self.error: TransportError | None = None     # the network connection failed (raised at take)
        self.sent = 0                # slices the proxy has posted / released, for messages

    def attach(self, proxy) -> None:
        self.proxy = proxy
        proxy.add(self)

    def ready(self) -> bool:
        """True when acquire() / wait() would return (or raise) at once; if not, the proxy is asked for a slot,
        as a waiting caller asks (comm.group() polls this instead of blocking in acquire / wait)."""
        return self.proxy.poll(self)

    def check(self) -> None:
        """Nothing to do in the caller's thread: while the caller wants a slot, the proxy patrols the network
        connection itself, and a failure it meets makes ready() true and the next acquire / wait raise it."""

    def busy(self) -> bool:
        return bool(self.queue) or (self.wanted and not self.in_hand and self.error is None)

    def _hold(self, data) -> None:
        """Make the host slot starting where ``data`` starts (tcp's and ibverbs' slots are ``slot_bytes``
        each, a payload starts at its slot's start) the one in hand; registered and viewed once."""
        at = data.__array_interface__["data"][0]
        if at not in self.views:
            host = np.frombuffer((ctypes.c_uint8 * self.slot_bytes).from_address(at), np.uint8)
            # ``data`` (the connection's own view) keeps the memory alive; ``host`` (all of the slot) does not
            self.views[at] = (host, self.rt.view(self.rt.host_register(host), self.slot_bytes, host), data)
        self.current = at

    def typed(self, dtype, k: int):
        key = (self.current, dtype)
        view = self.typed_views.get(key)
        if view is None:
            slot = self.views[self.current][1]
            view = self.typed_views[key] = slot[: slot.size // dtype.itemsize * dtype.itemsize].view(dtype)
        return view[:k]

    def _hand_back(self, nbytes: int | None) -> None:
        """After the GPU work on the slot in hand is queued: an event behind it, and the slot to the proxy."""
        with self.proxy.cv:
            event = self.spare.pop() if self.spare else None
        if event is None:
            event = self.rt.event_create()
        self.rt.event_record(event, self.stream)
        self.proxy.give(self, (nbytes, event, time.monotonic() + self.proxy.timeout))

    # ---- the proxy's side: never blocks ------------------------------------------------------------

    def pump(self, now: float, patrol: bool) -> bool:
        """Finish what the GPU is done with, then take what the network offers; whether anything moved.
        Raises (TransportError, CudaError) for a failure the proxy must report as its own."""
        moved = False
        while self.queue:
            nbytes, event, deadline = self.queue[0]
            if not self.rt.event_done(event):
                if now > deadline:
                    why = (f"this rank's GPU stream has not finished {self._gpu_work()} the slot of slice "
                           f"{self.sent} of this link {self.proxy.timeout:g} s after the host queued it (the "
                           f"proxy waits on its event)")
                    e = PeerTimeout(why, peer=self.peer, transport=self.transport)
                    e.detail = why      # the executor's message names ranks, call and transport, then this
                    raise e
                break
            try:                        # a failure to post is the proxy's: data the caller handed over is lost
                self._finish(nbytes)
            except TransportError as e:
                raise self._ours(e) from None
            self.sent += 1
            with self.proxy.cv:
                self.queue.popleft()
                self.spare.append(event)
            moved = True
        if self.error is None:
            moved |= self.take_ahead()
        if patrol and self.error is None and self.busy():
            self.conn.check()           # ibverbs probes the peer: a dead one fails the next ready()
        return moved

    def _ours(self, e: TransportError) -> TransportError:
        """The network connection's error, as this link's (its transport named "tcp+staged", ...)."""
        return type(e)(str(e), peer=e.peer, transport=self.transport)

    def take_ahead(self) -> bool:
        """Take free slots (send) or arrived slices (recv) from the network connection while it has them;
        the proxy's, or a waiting caller's while the proxy is not touching the connections."""
        moved = False
        if self.error is not None:
            return False
        if isinstance(self, StagedSend) and not self.deadline:
            return False                # its first acquire connects (ibverbs): only once a call needs it
        while len(self.in_hand) + len(self.queue) < self.nslots and self.conn.ready():
            try:
                slot = self._next_slot()
            except TransportError as e:
                with self.proxy.cv:
                    self.error = self._ours(e)
                return True
            with self.proxy.cv:
                self.in_hand.append(slot)
                self.wanted = False
            moved = True
        return moved

    def close(self) -> None:
        """Detach from the proxy (after it posted what the GPU finished), then unpin and close -- unless our
        stream has not drained within a second: then the slots stay pinned and referenced for ever rather
        than freed under a kernel that may still read or write them."""
        if self.proxy is not None:
            self.proxy.detach(self, flush=isinstance(self, StagedSend))
        drained = cuda_rt.drain(self.rt, self.stream, time.monotonic() + 1.0)
        if drained:
            for slot, _, _ in self.views.values():
                try:
                    self.rt.host_unregister(slot)
                except cuda_rt.CudaError:
                    pass                # cleanup never hides the error that led here
            for event in self.spare + [item[1] for item in self.queue]:
                try:
                    self.rt.event_destroy(event)
                except cuda_rt.CudaError:
                    pass
        else:
            _kept.append([owner for _, _, owner in self.views.values()])   # tcp's array, ibverbs' mmap stay
        self.conn.close()
        self.views.clear()
        self.typed_views.clear()
        self.queue.clear()
        self.spare.clear()


class StagedSend(_Staged):
    def acquire(self, deadline: float):
        self._hold(self.proxy.take(self, deadline, f"a free slot to send to rank {self.peer}"))
        return self.views[self.current][1]

    def post(self, nbytes: int) -> None:
        self._hand_back(nbytes)

    def _gpu_work(self) -> str:
        return "writing"

    def _next_slot(self):
        # ready() says it returns at once, but for ibverbs' first, which connects: the caller's deadline
        return self.conn.acquire(max(self.deadline, time.monotonic() + 1.0))

    def _finish(self, nbytes: int) -> None:
        self.conn.post(nbytes)


class StagedRecv(_Staged):
    def wait(self, deadline: float):
        data = self.proxy.take(self, deadline, f"data from rank {self.peer}")
        self._hold(data)
        return data                            # its size is checked; typed() gives the device view

    def release(self) -> None:
        self._hand_back(None)

    def _gpu_work(self) -> str:
        return "reading"

    def _next_slot(self):
        return self.conn.wait(time.monotonic() + 1.0)

    def _finish(self, nbytes) -> None:
        self.conn.release()


def staged(conn, direction: str, name: str):
    rt = cuda_rt.get()
    return (StagedSend if direction == "send" else StagedRecv)(conn, rt, name)


def gpudirect(rt, device: int) -> str:
    """Whether the NIC could register this GPU's memory (GPUDirect RDMA), in words. Detection only: ringcomm
    stages through host memory either way, and the direct path is untested here (no GPU, no such NIC).
    Two ways exist: a peer-memory kernel module (nvidia_peermem, or the older nv_peer_mem), or dma-buf (the
    GPU exports its memory, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, and rdma-core registers it:
    pyverbs.mr.DmaBufMR, ibv_reg_dmabuf_mr)."""
    ways = [f"the {m} kernel module is loaded" for m in ("nvidia_peermem", "nv_peer_mem")
            if glob.glob(f"/sys/module/{m}")]
    notes = []
    try:
        dmabuf = rt.dmabuf_supported(device)
    except cuda_rt.CudaError as e:
        dmabuf = False
        notes.append(f"the dma-buf query failed: {e}")
    if dmabuf:
        try:
            from pyverbs.mr import DmaBufMR  # noqa: F401 - rdma-core >= 34
            ways.append("dma-buf: the GPU exports its memory and pyverbs has DmaBufMR")
        except ImportError:
            notes.append("the GPU exports dma-bufs, but this pyverbs has no DmaBufMR")
    verdict = f"possible ({'; '.join(ways)})" if ways else "not available (no nvidia_peermem / nv_peer_mem " \
        "module loaded, no dma-buf export the NIC could register)"
    extra = f" [{'; '.join(notes)}]" if notes else ""
    return f"GPUDirect RDMA {verdict}{extra}; not used: device slices are staged through pinned host memory"
