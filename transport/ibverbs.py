"""ibverbs (RDMA) transport through pyverbs: one-sided writes into the receiver's registered slots.

Per communicator one device context, protection domain and completion queue (verbs.Device); per
connection one RC queue pair. The protocol:

- The receiver (connect_recv) registers its ``nslots`` slots once, posts its receive WRs, reads
  the sender's QP number, GID and credit word from the store, brings its QP to RTS and publishes
  its own QP number, GID, slot address and rkey.
- The sender (connect_send) creates its QP and an 8-byte credit word the receiver may write,
  publishes them and returns at once: connect_send never waits for the peer's connect_recv. Its
  first acquire() reads the receiver's entry, brings the QP up and says HELLO (a zero-byte write
  with immediate): until then its QP cannot answer, so the receiver writes nothing to it.
- A slice is one RDMA WRITE WITH IMMEDIATE into remote slot ``k % nslots``; the immediate holds
  the slot index (high bits) and the byte count. It consumes a receive WR, so the receiver learns
  of it from its CQ, after the data is placed (the verbs ordering rule, not the CPU's).
- Credits flow back as an RDMA WRITE of the receiver's released count into the sender's credit
  word; the sender may fill slice k once k - credit < nslots (NCCL's head/tail counters).
- A waiter posts a tiny write every LIVENESS_PERIOD; a dead peer's QP never acknowledges it, the
  retries run out, and that completion error (retry exceeded) becomes PeerGone naming both ranks.
  A clean close is announced: the CLOSE immediate (sender), the top bit of the credit word
  (receiver), or a store key when the sender's QP never came up.
"""
from __future__ import annotations

import collections
import json
import secrets
import socket
import time

import numpy as np

from .base import (Aborted, Backoff, LinkContext, PeerGone, PeerTimeout, RecvConnection, wait_key,
                   SendConnection, Transport)
from .verbs import Device, Region, find_device, unavailable  # noqa: F401 - re-exported for links/tests

NAME = "ibverbs"
LIVENESS_PERIOD = 0.5  # seconds between a waiter's probes of the peer's QP (and watchdog calls)
LINGER = 5.0           # close() lets posted slices be acknowledged for this long
CLOSED_BIT = 1 << 63   # in the credit word: the receiver closed its end
CLOSE_IMM, HELLO_IMM = 0xFFFFFFFF, 0xFFFFFFFE  # slot field all ones: never a data slot
DATA, PROBE, CREDIT, NOTICE, RECV = range(5)  # wr_id: what a completion belongs to
WHAT = {DATA: "an RDMA write of a slice", PROBE: "a liveness probe", CREDIT: "a credit write",
        NOTICE: "a hello / close notice", RECV: "a receive"}
HINTS = {  # ibv_wc_status -> what it means here
    12: "transport retry counter exceeded: the peer's QP stopped answering (its process died or "
        "closed, or the link went down)",
    13: "RNR retry counter exceeded: the peer posted no receive for our write",
    10: "remote access error: the peer's registered slots were gone or a write fell outside them "
        "(its process died and the kernel dropped its memory before its QP, or a wrong rkey)",
    5: "flushed: the QP was already in error",
}


class _Link:
    """What both ends share: the QP, completions, waiting with probes, the first error."""

    transport = NAME
    role = "?"

    def __init__(self, t: "IbverbsTransport", peer: int, recv_wr: int):
        self.t, self.dev, self.ctx, self.peer = t, t.dev, t.ctx, peer
        self.nslots, self.slot_bytes = t.ctx.nslots, t.ctx.slot_bytes
        self.depth = self.nslots + 4  # send WRs: a FIFO's worth, a probe, a notice, slack
        self.inflight = 0             # signalled send WRs not completed yet
        self.probing = self.closed = False
        self.error: PeerGone | None = None
        self.remote: dict | None = None
        self.regions: list[Region] = []
        self.psn = secrets.randbits(24)
        self.recv_wr = recv_wr
        self.cq = self.dev.cq_for(self.depth + recv_wr)
        self.qp = self.dev.make_qp(self.cq, self.depth, recv_wr, self)

    def region(self, nbytes: int, access: int) -> Region:
        self.regions.append(Region(self.dev.pd, nbytes, access))
        return self.regions[-1]

    def _both(self) -> str:
        return f"rank {self.ctx.rank} (this process) and rank {self.peer} over {NAME}"

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = PeerGone(message, peer=self.peer, transport=NAME)

    def _raise(self):
        e = self.error  # a fresh instance per raise keeps tracebacks from piling up
        raise type(e)(str(e), peer=self.peer, transport=NAME)

    def on_completion(self, wc) -> None:
        kind, status = wc.wr_id, int(wc.status)
        if kind != RECV:
            self.inflight -= 1
            self.probing = self.probing and kind != PROBE
        if status != 0:
            if not self.closed:
                hint = HINTS.get(status) or self.dev.pv.status(status)
                self._fail(f"the {self.role} queue pair between {self._both()} failed: "
                           f"{WHAT.get(kind, kind)} completed with status {status} ({hint})")
        elif kind == RECV:
            self.on_arrival(socket.ntohl(wc.imm_data))

    def on_arrival(self, imm: int) -> None:
        self._fail(f"rank {self.peer} wrote to a send-only queue pair of rank {self.ctx.rank}")

    def _write(self, kind: int, region: Region, offset: int, nbytes: int, raddr: int, rkey: int,
               imm: int | None = None) -> None:
        try:
            self.dev.post_write(self.qp, kind, region, offset, nbytes, raddr, rkey, imm)
        except self.dev.pv.Error as e:
            self._fail(f"could not post to the queue pair between {self._both()}: {e}")
            self._raise()
        self.inflight += 1

    def _probe(self) -> None:
        raise NotImplementedError

    def _can_probe(self) -> bool:
        raise NotImplementedError

    def _wait(self, ready, deadline: float, what: str) -> None:
        """Poll the CQ until ready(); probe the peer while waiting; PeerTimeout / Aborted."""
        backoff = Backoff()
        next_patrol = time.monotonic() + LIVENESS_PERIOD
        watchdog = getattr(self.ctx, "watchdog", None)  # the core's "where are you?" hook, if any
        while True:
            self.dev.poll(self.cq)
            if ready():
                return
            backoff()
            if backoff.n & 15:
                continue
            now = time.monotonic()
            if self.ctx.abort is not None and self.ctx.abort.is_set():
                raise Aborted(f"rank {self.ctx.rank}: abort requested while waiting for {what} over "
                              f"{NAME}", peer=self.peer, transport=NAME)
            if now > deadline:
                raise PeerTimeout(f"rank {self.ctx.rank} (this process) timed out waiting for {what} "
                                  f"over {NAME}", peer=self.peer, transport=NAME)
            if now >= next_patrol:
                if self._can_probe():
                    if not self.probing and self.inflight < self.depth - 1:
                        self.probing = True
                        self._probe()
                else:       # no QP of the peer's to probe yet: the roster says whether it died
                    self._check_alive(what)
                if watchdog is not None:
                    watchdog()
                next_patrol = now + LIVENESS_PERIOD

    def _check_alive(self, what: str) -> None:
        """PeerGone if the communicator's roster knows the peer died (its pid gone on this host, its
        socket refusing on another): for waits the QP probe cannot cover (before the peer wrote)."""
        self.ctx.check_alive(self.peer, NAME, f" while rank {self.ctx.rank} (this process) waited for {what} "
                                              f"over {NAME}")

    def check(self) -> None:
        """A patrol of _wait for callers that poll ready(): probe the peer; a dead one fails the probe,
        and the next ready() says True so that acquire() / wait() raise."""
        self.dev.poll(self.cq)
        if self._can_probe() and not self.probing and self.inflight < self.depth - 1:
            self.probing = True
            self._probe()

    def _settle(self, ready, seconds: float) -> None:
        """Best effort, for close(): poll until ready() or the time is up; never raises."""
        try:
            self._wait(lambda: ready() or self.error is not None, time.monotonic() + seconds, "close")
        except (PeerTimeout, Aborted, PeerGone):
            pass

    def _quiet_close(self) -> bool:
        """Whether close() should skip its goodbyes (an abort, an error, or already closed)."""
        aborting = self.ctx.abort is not None and self.ctx.abort.is_set()
        return self.closed or aborting or self.error is not None

    def _closed_here(self, what: str):
        return Aborted(f"rank {self.ctx.rank}: the {NAME} {what} rank {self.peer} was closed by this "
                       f"process", peer=self.peer, transport=NAME)

    def _destroy(self) -> None:
        self.closed = True
        if self.qp is not None:
            self.dev.forget(self.qp)
            self.qp.close()
            self.dev.cq_done(self.cq, self.depth + self.recv_wr)
            self.qp = None
        for r in self.regions:
            r.close()
        self.regions = []


class IbSend(_Link, SendConnection):
    role = "send"

    def __init__(self, t: "IbverbsTransport", peer: int):
        super().__init__(t, peer, recv_wr=1)
        e = self.dev.pv.e
        try:
            self.slots = self.region(self.nslots * self.slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
            self.ctl = self.region(64, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            self.credit = self.ctl.array[:8].view(np.uint64)  # the receiver's released count
            t.publish(t.ctx.rank, peer, self, addr=self.ctl.addr, rkey=self.ctl.mr.rkey)
        except BaseException:
            self._destroy()
            raise
        self.posted = 0
        self.held = 0  # acquired, not posted yet: slices posted .. posted + held - 1

    def _connect(self, deadline: float) -> None:
        remote = self.t.lookup(self.ctx.rank, self.peer, "recv", deadline)
        if (remote["nslots"], remote["slot_bytes"]) != (self.nslots, self.slot_bytes):
            self._fail(f"rank {self.peer} has {remote['nslots']} slots of {remote['slot_bytes']} bytes "
                       f"and rank {self.ctx.rank} {self.nslots} of {self.slot_bytes}: set RINGCOMM_BUFFSIZE "
                       f"and RINGCOMM_NSLOTS alike on every rank")
            self._raise()
        if self.t.peek(self.ctx.rank, self.peer, "closed") is not None:
            raise self._peer_closed()
        self.dev.bring_up(self.qp, self.psn, remote)
        self.remote = remote
        self._write(NOTICE, self.slots, 0, 0, remote["addr"], remote["rkey"], imm=HELLO_IMM)

    def _peer_closed(self) -> PeerGone:
        return PeerGone(f"rank {self.peer} closed its end of the {NAME} link from rank {self.ctx.rank}: it "
                        f"exited or closed its communicator", peer=self.peer, transport=NAME)

    def _free(self) -> bool:
        credit = int(self.credit[0])
        return bool(credit & CLOSED_BIT or self.error is not None or
                    (self.posted + self.held - credit < self.nslots and self.inflight < self.depth - 2))

    def _can_probe(self) -> bool:
        return self.remote is not None

    def acquire(self, deadline: float) -> np.ndarray:
        if self.closed:
            raise self._closed_here("send connection to")
        if self.remote is None:
            self._connect(deadline)
        self._wait(self._free, deadline, f"a free slot to send to rank {self.peer}")
        if self.error is not None:
            self._raise()
        if int(self.credit[0]) & CLOSED_BIT:
            raise self._peer_closed()
        i = (self.posted + self.held) % self.nslots
        self.held += 1
        return self.slots.array[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def ready(self) -> bool:
        if self.remote is None or self.closed:
            return True  # acquire() connects (the peer has published: prepare() ran on both) or raises
        self.dev.poll(self.cq)
        return self._free()

    def post(self, nbytes: int) -> None:
        if self.error is not None:
            self._raise()
        if not self.held:
            raise RuntimeError("post() without a slot from acquire()")
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"post({nbytes}): a slot holds 0..{self.slot_bytes} bytes")
        i = self.posted % self.nslots
        self._write(DATA, self.slots, i * self.slot_bytes, nbytes, self.remote["addr"] + i * self.slot_bytes,
                    self.remote["rkey"], imm=(i << self.t.count_bits) | nbytes)
        self.posted += 1
        self.held -= 1

    def _probe(self) -> None:  # a zero-byte write touches nothing but needs the peer's ack
        self._write(PROBE, self.slots, 0, 0, self.remote["addr"], self.remote["rkey"])

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.remote is None and not self._quiet_close():
                # Never used: if the receiver is connected it may be waiting, so come up to say goodbye.
                remote = self.t.peek(self.ctx.rank, self.peer, "recv")
                if remote is not None:
                    self.dev.bring_up(self.qp, self.psn, remote)
                    self.remote = remote
            if self.remote is not None and not self._quiet_close():
                # Posted slices must reach the peer: wait for their acks, then say goodbye.
                self._settle(lambda: self.inflight == 0, LINGER)
                if self.error is None and self.inflight == 0:
                    self._write(NOTICE, self.slots, 0, 0, self.remote["addr"], self.remote["rkey"],
                                imm=CLOSE_IMM)
                    self._settle(lambda: self.inflight == 0, 1.0)
        except PeerGone:
            pass
        finally:
            self._destroy()


class IbRecv(_Link, RecvConnection):
    role = "recv"

    def __init__(self, t: "IbverbsTransport", peer: int, deadline: float):
        # A receive per slot, and one each for HELLO and CLOSE: a write with immediate always
        # finds one, because the sender never has more than nslots slices unreleased.
        super().__init__(t, peer, recv_wr=t.ctx.nslots + 2)
        e = self.dev.pv.e
        self.full: collections.deque[tuple[int, int]] = collections.deque()
        self.arrived = self.released = 0
        self.held: collections.deque[int] = collections.deque()  # slots wait() returned, oldest first
        self.peer_up = self.peer_closed = self.credit_dirty = False
        try:
            self.slots = self.region(self.nslots * self.slot_bytes,
                                     e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            self.ctl = self.region(64, e.IBV_ACCESS_LOCAL_WRITE)
            self.credit = self.ctl.array[:8].view(np.uint64)  # the source of every credit write
            for _ in range(self.recv_wr):
                self._post_recv()
            remote = t.lookup(peer, t.ctx.rank, "send", deadline)  # published by its connect_send
            self.dev.bring_up(self.qp, self.psn, remote)
            self.remote = remote
            t.publish(peer, t.ctx.rank, self, addr=self.slots.addr, rkey=self.slots.mr.rkey,
                      nslots=self.nslots, slot_bytes=self.slot_bytes)
        except BaseException:
            self._destroy()
            raise

    def _post_recv(self) -> None:
        try:  # the SGE is never written: our writes carry their payload to the slots, not here
            self.dev.post_recv(self.qp, RECV, self.ctl, 32)
        except self.dev.pv.Error as e:
            self._fail(f"could not post a receive on the queue pair between {self._both()}: {e}")

    def on_arrival(self, imm: int) -> None:
        self._post_recv()
        if imm in (HELLO_IMM, CLOSE_IMM):
            self.peer_up = True
            self.peer_closed = imm == CLOSE_IMM
            return
        slot, nbytes = imm >> self.t.count_bits, imm & ((1 << self.t.count_bits) - 1)
        if slot != self.arrived % self.nslots or nbytes > self.slot_bytes:
            self._fail(f"rank {self.peer} broke the {NAME} protocol towards rank {self.ctx.rank}: slice "
                       f"{self.arrived} came as slot {slot} with {nbytes} bytes")
            return
        self.full.append((slot, nbytes))
        self.arrived += 1

    def _can_probe(self) -> bool:
        return self.peer_up and not self.peer_closed

    def wait(self, deadline: float) -> np.ndarray:
        if self.closed:
            raise self._closed_here("receive connection from")
        self._wait(lambda: self.full or self.peer_closed or self.error is not None, deadline,
                   f"data from rank {self.peer}")
        if self.full:  # slices that arrived before an error or a close are still delivered
            slot, nbytes = self.full.popleft()
            self.held.append(slot)
            lo = slot * self.slot_bytes
            return self.slots.array[lo:lo + nbytes]
        if self.error is not None:
            self._raise()
        raise PeerGone(f"rank {self.peer} closed its end of the {NAME} link to rank {self.ctx.rank}: it "
                       f"exited or closed its communicator", peer=self.peer, transport=NAME)

    def ready(self) -> bool:
        if self.closed:
            return True  # wait() raises
        self.dev.poll(self.cq)
        if self.credit_dirty and self.inflight < self.depth - 1:
            self._send_credit()
        return bool(self.full or self.peer_closed or self.error is not None)

    def release(self) -> None:
        if not self.held:
            raise RuntimeError("release() without a slot from wait()")
        self.held.popleft()
        self.released += 1
        self._send_credit()

    def _send_credit(self, closing: bool = False) -> None:
        """Write the released count into the sender's credit word. Never blocks and never raises:
        a credit that finds the send queue full goes with the next one (the count is cumulative),
        and a failure shows in the next wait()."""
        self.dev.poll(self.cq)
        if self.error is not None or self.qp is None or self.peer_closed:
            return
        if self.inflight >= self.depth - 1:
            self.credit_dirty = True
            return
        self.credit_dirty = False
        self.credit[0] = self.released | (CLOSED_BIT if closing else 0)
        try:
            self._write(CREDIT, self.ctl, 0, 8, self.remote["addr"], self.remote["rkey"])
        except PeerGone:
            pass

    def _wait(self, ready, deadline: float, what: str) -> None:
        def ready_or_flush():
            if self.credit_dirty and self.inflight < self.depth - 1:
                self._send_credit()
            return ready()
        super()._wait(ready_or_flush, deadline, what)

    def _probe(self) -> None:  # rewriting the credit word is harmless and needs the peer's ack
        self.credit_dirty = False
        self.credit[0] = self.released
        self._write(PROBE, self.ctl, 0, 8, self.remote["addr"], self.remote["rkey"])

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.remote is not None and not self._quiet_close() and not self.peer_closed:
                self.dev.poll(self.cq)
                if self.peer_up:  # its QP answers: tell it in its credit word
                    self._settle(lambda: self.inflight < self.depth - 1, 1.0)
                    self._send_credit(closing=True)
                    self._settle(lambda: self.inflight == 0, 1.0)
                else:  # its QP is not up yet and could not take the write: leave a note
                    self.t.note_closed(self.peer)
        finally:
            self._destroy()


class IbverbsTransport(Transport):
    """Makes RC connections on the device RINGCOMM_IB_HCA / _PORT / _GID_INDEX pick."""

    name = NAME

    def __init__(self, ctx: LinkContext):
        super().__init__(ctx)
        # The immediate: slot index in the high bits, byte count below.
        self.count_bits = 32 - max(1, ctx.nslots.bit_length())
        if ctx.slot_bytes >= 1 << self.count_bits:
            raise ValueError(f"{NAME}: a slot of {ctx.slot_bytes} bytes does not fit the {self.count_bits}-bit "
                             f"byte count of the immediate; lower RINGCOMM_BUFFSIZE or RINGCOMM_NSLOTS")
        self.dev = Device(ctx.world_size)
        self.links: list[_Link] = []
        self._closed = False

    def _key(self, src: int, dst: int, what: str) -> str:
        return f"{self.ctx.prefix}/{NAME}/{src}-{dst}/{what}"

    def publish(self, src: int, dst: int, link: _Link, **extra) -> None:
        info = dict(self.dev.describe(link.qp, link.psn), **extra)
        self.ctx.store.set(self._key(src, dst, link.role), json.dumps(info).encode())

    def note_closed(self, peer: int) -> None:
        try:
            self.ctx.store.set(self._key(peer, self.ctx.rank, "closed"), b"1")  # JSON for peek()
        except Exception:  # noqa: BLE001 - best effort: the store may be gone at exit
            pass

    def peek(self, src: int, dst: int, what: str):
        """The entry if it is in the store now, else None (never waits, never raises)."""
        try:
            return json.loads(bytes(self.ctx.store.get(self._key(src, dst, what), timeout=0)))
        except Exception:  # noqa: BLE001 - absent (StoreTimeout) or unreadable: nothing to see
            return None

    def lookup(self, src: int, dst: int, role: str, deadline: float) -> dict:
        """The other end's entry, waited for as every transport waits for a store key (base.wait_key:
        an abort, the watchdog and a peer known dead are heard while it waits)."""
        peer = dst if src == self.ctx.rank else src
        try:
            return json.loads(bytes(wait_key(self.ctx, self._key(src, dst, role), deadline, peer, NAME)))
        except PeerTimeout:
            entry = self.peek(src, dst, role)   # published by the deadline: connecting does not wait
            if entry is not None:
                return entry
            raise

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.ctx.world_size:
            raise ValueError(f"peer {peer} is not a rank of a world of {self.ctx.world_size}")
        if self._closed:
            raise Aborted(f"rank {self.ctx.rank}: the {NAME} transport is closed", peer=peer, transport=NAME)

    def connect_send(self, peer: int, deadline: float) -> IbSend:
        self._check_peer(peer)
        self.links.append(IbSend(self, peer))
        return self.links[-1]

    def connect_recv(self, peer: int, deadline: float) -> IbRecv:
        self._check_peer(peer)
        self.links.append(IbRecv(self, peer, deadline))
        return self.links[-1]

    def close(self) -> None:
        """Close every connection, then the CQs, PD and device context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for link in self.links:
            link.close()
        self.links = []
        self.dev.close()
