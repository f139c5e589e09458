"""ibverbs (RDMA) transport through pyverbs: one-sided writes into the receiver's registered slots.

Per communicator: one device context, protection domain and completion queue (another CQ only
when the connections' completions would not fit the first); per connection one RC queue pair.

- The receiver (connect_recv) registers its ``nslots`` slots once, posts one receive WR per slot
  (plus one for the close notice), reads the sender's QP number, GID and credit word from the
  store, brings its QP to RTS and publishes its own QP number, GID, slot address and rkey.
- The sender (connect_send) creates its QP and an 8-byte credit word the receiver may write,
  publishes them and returns at once: connect_send never waits for the peer's connect_recv. Its
  first acquire() reads the receiver's entry and brings the QP up.
- A slice is one RDMA WRITE WITH IMMEDIATE into remote slot ``k % nslots``; the immediate holds
  the slot index (high bits) and the byte count. The write consumes a receive WR, so the receiver
  learns of it from its CQ, after the data is placed (the verbs ordering rule, not the CPU's).
- Credits flow back as an RDMA WRITE of the receiver's released count into the sender's credit
  word; the sender may fill slice k once k - credit < nslots (NCCL's head/tail counters).
- A waiter posts a tiny write every LIVENESS_PERIOD; a dead peer's QP never acknowledges it, the
  retries run out, and that completion error (retry exceeded) becomes PeerGone naming both ranks.
  A clean close is announced: a zero-byte write with the CLOSE immediate (sender), the top bit of
  the credit word (receiver).

RINGCOMM_IB_HCA / RINGCOMM_IB_PORT / RINGCOMM_IB_GID_INDEX pick the device, port and GID like
NCCL_IB_HCA / NCCL_IB_GID_INDEX; RINGCOMM_IB_TIMEOUT (default 18) and RINGCOMM_IB_RETRY_CNT (7) are
the QP's ack timeout exponent (4.096 us * 2^t) and retry count, like NCCL_IB_TIMEOUT / _RETRY_CNT.
"""
from __future__ import annotations

import collections
import json
import mmap
import os
import secrets
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np

from .base import (Aborted, Backoff, LinkContext, PeerGone, PeerTimeout, RecvConnection,
                   SendConnection, Transport)

NAME = "ibverbs"
LIVENESS_PERIOD = 0.5  # seconds between a waiter's probes of the peer's QP (and watchdog calls)
LINGER = 5.0           # close() lets posted slices be acknowledged for this long
CLOSED_BIT = 1 << 63   # in the credit word: the receiver closed its end
DATA, PROBE, CREDIT, NOTICE, RECV = range(5)  # wr_id: what a completion belongs to
HINTS = {  # ibv_wc_status -> what it means here
    12: "transport retry counter exceeded: the peer's QP stopped answering (the process died, or "
        "its port/link went down)",
    13: "RNR retry counter exceeded: the peer posted no receive for our write",
    10: "remote access error: a write fell outside the peer's registered slots (wrong rkey?)",
    9: "remote invalid request",
    5: "flushed: the QP was already in error",
}
_pv = None


def pyverbs():
    """The pyverbs modules, imported on first use (an optional dependency)."""
    global _pv
    if _pv is None:
        try:
            import pyverbs.enums as enums
            from pyverbs import addr, device, mr, pd, qp, wr
            from pyverbs.cq import CQ, cqe_status_to_str
            from pyverbs.pyverbs_error import PyverbsError
        except ImportError as e:
            raise ImportError(
                "the ibverbs transport needs pyverbs built for this system's rdma-core: "
                "`pip install 'ringcomm[rdma]'` (PyPI pyverbs needs rdma-core >= 57) or the "
                f"distribution's python3-pyverbs (Debian 12: apt install python3-pyverbs) ({e})") from e
        _pv = SimpleNamespace(e=enums, addr=addr, device=device, mr=mr, pd=pd, qp=qp, wr=wr, CQ=CQ,
                              Error=PyverbsError, status=cqe_status_to_str)
    return _pv


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _hca_filter(name: str) -> tuple[bool, int | None]:
    """RINGCOMM_IB_HCA as NCCL_IB_HCA: "mlx5_0:1,mlx5_1" (prefixes), "=" exact names, "^" excludes."""
    spec = os.environ.get("RINGCOMM_IB_HCA", "").strip()
    if not spec:
        return True, None
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    hits = []
    for item in filter(None, (s.strip() for s in spec.lstrip("=").split(","))):
        dev, _, port = item.partition(":")
        if (name == dev) if exact else name.startswith(dev):
            hits.append(int(port) if port else None)
    return (not hits) if exclude else bool(hits), (None if exclude or not hits else hits[0])


def find_device() -> tuple[str, int]:
    """(device, port) the transport would use; LookupError saying why there is none."""
    pv = pyverbs()
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name)
             for d in pv.device.get_device_list()]
    if not names:
        raise LookupError("pyverbs sees no RDMA device (`ibv_devinfo` lists none: no RDMA NIC, "
                          "or its kernel driver / rdma-core provider is missing)")
    seen = []
    for name in names:
        wanted, port = _hca_filter(name)
        if not wanted:
            seen.append(f"{name} (excluded by RINGCOMM_IB_HCA)")
            continue
        port = _env_int("RINGCOMM_IB_PORT", port)
        with pv.device.Context(name=name) as vctx:
            for p in [port] if port else range(1, vctx.query_device().phys_port_cnt + 1):
                if vctx.query_port(p).state == pv.e.IBV_PORT_ACTIVE:
                    return name, p
                seen.append(f"{name} port {p} (not active)")
    raise LookupError(f"no usable RDMA port: {', '.join(seen)}")


def unavailable() -> str | None:
    """None when an RDMA device can be used here, else why not (for transport selection)."""
    try:
        find_device()
    except (ImportError, LookupError, ValueError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a broken verbs stack counts as "no device"
        return f"the RDMA stack failed: {e!r}"
    return None


def _gid_index(name: str, port: int, is_ib: bool) -> int:
    """RINGCOMM_IB_GID_INDEX, else (RoCE) an IPv4-mapped RoCE v2 GID as NCCL prefers, else index 0."""
    chosen = _env_int("RINGCOMM_IB_GID_INDEX", None)
    if chosen is not None or is_ib:
        return chosen or 0
    base = f"/sys/class/infiniband/{name}/ports/{port}"
    best, best_score = 0, -1
    try:
        indexes = sorted(int(i) for i in os.listdir(f"{base}/gids"))
    except OSError:
        return 0
    for i in indexes:
        try:
            gid = open(f"{base}/gids/{i}").read().strip()
            kind = open(f"{base}/gid_attrs/types/{i}").read().strip().lower()
        except OSError:
            continue
        if not gid.replace(":", "").strip("0"):
            continue  # an empty table entry
        score = 2 * ("v2" in kind) + gid.startswith("0000:0000:0000:0000:0000:ffff:")
        if score > best_score:
            best, best_score = i, score
    return best


class _Region:
    """Page-aligned memory this process owns, registered with the protection domain.

    It is an mmap, not pyverbs' own buffer, so numpy views of a slot keep the memory alive even
    after the MR is deregistered: a stale view can never point at freed memory.
    """

    def __init__(self, pd, nbytes: int, access: int):
        self.map = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        self.array = np.frombuffer(self.map, np.uint8)
        self.addr = self.array.ctypes.data
        try:
            self.mr = pyverbs().mr.MR(pd, len(self.map), access, address=self.addr)
        except pyverbs().Error as e:
            raise OSError(f"could not register {nbytes} bytes with the RDMA device ({e}); is the "
                          f"locked-memory limit (`ulimit -l`) large enough?") from e

    def close(self) -> None:
        self.mr.close()
        self.array = None
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the last one
            pass


class _Link:
    """What both ends share: the QP, completions, waiting with probes, the first error."""

    transport = NAME
    role = "?"

    def __init__(self, t: "IbverbsTransport", peer: int):
        self.t, self.ctx, self.peer = t, t.ctx, peer
        self.nslots, self.slot_bytes = t.ctx.nslots, t.ctx.slot_bytes
        self.depth = self.nslots + 4           # send WRs: a FIFO's worth, a probe, a notice, slack
        self.inflight = 0                      # signalled send WRs not completed yet
        self.probing = False
        self.error: PeerGone | None = None
        self.closed = False
        self.remote: dict | None = None
        self.qp = self.cq = None
        self.regions: list[_Region] = []

    def _setup(self, recv_wr: int) -> None:
        self.cq = self.t.cq_for(self.depth + recv_wr)
        self.psn = secrets.randbits(24)
        self.qp = self.t.make_qp(self.cq, self.depth, recv_wr)
        self.t.owner[self.qp.qp_num] = self

    def _what(self) -> str:
        return f"rank {self.ctx.rank} (this process) and rank {self.peer} over {NAME}"

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = PeerGone(message, peer=self.peer, transport=NAME)

    def _raise(self):
        e = self.error  # a fresh instance per raise keeps tracebacks from piling up
        raise type(e)(str(e), peer=self.peer, transport=NAME)

    def on_completion(self, wc, pv) -> None:
        kind = wc.wr_id
        if kind != RECV:
            self.inflight -= 1
            self.probing = self.probing and kind != PROBE
        if wc.status != pv.e.IBV_WC_SUCCESS:
            if not self.closed:
                what = {DATA: "an RDMA write of a slice", PROBE: "a liveness probe", CREDIT: "a credit "
                        "write", NOTICE: "the close notice", RECV: "a receive"}.get(kind, f"WR {kind}")
                self._fail(f"the {self.role} queue pair between {self._what()} failed: {what} completed "
                           f"with status {int(wc.status)} ({HINTS.get(int(wc.status), pv.status(wc.status))})")
            return
        if kind == RECV:
            self.on_arrival(socket.ntohl(wc.imm_data))

    def on_arrival(self, imm: int) -> None:
        self._fail(f"rank {self.peer} wrote to a send-only queue pair of rank {self.ctx.rank}")

    def _post(self, kind: int, region: _Region, offset: int, nbytes: int, raddr: int, rkey: int,
              imm: int | None = None) -> None:
        pv = self.t.pv
        op = pv.e.IBV_WR_RDMA_WRITE if imm is None else pv.e.IBV_WR_RDMA_WRITE_WITH_IMM
        wr = pv.wr.SendWR(wr_id=kind, opcode=op, num_sge=1, send_flags=pv.e.IBV_SEND_SIGNALED,
                          sg=[pv.wr.SGE(region.addr + offset, nbytes, region.mr.lkey)])
        if imm is not None:
            wr.imm_data = socket.htonl(imm)
        wr.set_wr_rdma(rkey, raddr)
        try:
            self.qp.post_send(wr)
        except pv.Error as e:
            self._fail(f"could not post to the queue pair between {self._what()}: {e}")
            self._raise()
        self.inflight += 1

    def _probe(self) -> None:
        raise NotImplementedError

    def _wait(self, ready, deadline: float, what: str) -> None:
        """Poll the CQ until ready(); probe the peer while waiting; PeerTimeout / Aborted."""
        backoff = Backoff()
        next_patrol = time.monotonic() + LIVENESS_PERIOD
        watchdog = getattr(self.ctx, "watchdog", None)  # the core's "where are you?" hook, if any
        while True:
            self.t.poll(self.cq)
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
                if (self.remote is not None and not self.probing and self.error is None
                        and self.inflight < self.depth - 1):
                    self.probing = True
                    self._probe()
                if watchdog is not None:
                    watchdog()
                next_patrol = now + LIVENESS_PERIOD

    def _settle(self, ready, seconds: float) -> None:
        """Best effort, for close(): poll until ready() or the time is up; never raises."""
        try:
            self._wait(lambda: ready() or self.error is not None, time.monotonic() + seconds, "close")
        except (PeerTimeout, Aborted):
            pass

    def _aborting(self) -> bool:
        return self.ctx.abort is not None and self.ctx.abort.is_set()

    def _destroy(self) -> None:
        self.closed = True
        if self.qp is not None:
            self.t.owner.pop(self.qp.qp_num, None)
            self.qp.close()
            self.t.cq_done(self.cq, self.depth)
            self.qp = None
        for r in self.regions:
            r.close()
        self.regions = []


class IbSend(_Link, SendConnection):
    role = "send"

    def __init__(self, t: "IbverbsTransport", peer: int):
        super().__init__(t, peer)
        e = t.pv.e
        try:
            self.slots = t.region(self, self.nslots * self.slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
            self.ctl = t.region(self, 64, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            self.credit = self.ctl.array[:8].view(np.uint64)  # the receiver's released count
            self._setup(recv_wr=1)
            t.publish(t.ctx.rank, peer, self, addr=self.ctl.addr, rkey=self.ctl.mr.rkey)
        except BaseException:
            self._destroy()
            raise
        self.posted = 0
        self.held = False

    def _connect(self, deadline: float) -> None:
        remote = self.t.lookup(self.ctx.rank, self.peer, "recv", deadline)
        if (remote["nslots"], remote["slot_bytes"]) != (self.nslots, self.slot_bytes):
            self._fail(f"rank {self.peer} has {remote['nslots']} slots of {remote['slot_bytes']} bytes "
                       f"and rank {self.ctx.rank} {self.nslots} of {self.slot_bytes}: set RINGCOMM_BUFFSIZE "
                       f"and RINGCOMM_NSLOTS alike on every rank")
            self._raise()
        self.t.bring_up(self, remote)
        self.remote = remote

    def _free(self) -> bool:
        credit = int(self.credit[0])
        return (credit & CLOSED_BIT or self.error is not None or
                (self.posted - credit < self.nslots and self.inflight < self.depth - 2))

    def acquire(self, deadline: float) -> np.ndarray:
        if self.held:
            raise RuntimeError("acquire() called again before post()")
        if self.closed:
            raise Aborted(f"rank {self.ctx.rank}: the {NAME} send connection to rank {self.peer} was "
                          f"closed by this process", peer=self.peer, transport=NAME)
        if self.remote is None:
            self._connect(deadline)
        self._wait(self._free, deadline, f"a free slot to send to rank {self.peer}")
        if self.error is not None:
            self._raise()
        if int(self.credit[0]) & CLOSED_BIT:
            raise PeerGone(f"rank {self.peer} closed its end of the {NAME} link from rank {self.ctx.rank}: "
                           f"it exited or closed its communicator", peer=self.peer, transport=NAME)
        self.held = True
        i = self.posted % self.nslots
        return self.slots.array[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def post(self, nbytes: int) -> None:
        if self.error is not None:
            self._raise()
        if not self.held:
            raise RuntimeError("post() without a slot from acquire()")
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"post({nbytes}): a slot holds 0..{self.slot_bytes} bytes")
        i = self.posted % self.nslots
        self._post(DATA, self.slots, i * self.slot_bytes, nbytes,
                   self.remote["addr"] + i * self.slot_bytes, self.remote["rkey"],
                   imm=(i << self.t.count_bits) | nbytes)
        self.posted += 1
        self.held = False

    def _probe(self) -> None:  # a zero-byte write touches nothing but needs the peer's ack
        self._post(PROBE, self.slots, 0, 0, self.remote["addr"], self.remote["rkey"])

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.remote is not None and self.error is None and not self._aborting():
                # Posted slices must reach the peer: wait for their acks, then say goodbye.
                self._settle(lambda: self.inflight == 0, LINGER)
                if self.error is None and self.inflight == 0:
                    self._post(NOTICE, self.slots, 0, 0, self.remote["addr"], self.remote["rkey"],
                               imm=self.t.close_imm)
                    self._settle(lambda: self.inflight == 0, 1.0)
        except PeerGone:
            pass
        finally:
            self._destroy()


class IbRecv(_Link, RecvConnection):
    role = "recv"

    def __init__(self, t: "IbverbsTransport", peer: int, deadline: float):
        super().__init__(t, peer)
        e = t.pv.e
        self.full: collections.deque[tuple[int, int]] = collections.deque()
        self.arrived = self.released = 0
        self.held: int | None = None
        self.peer_closed = self.credit_dirty = False
        try:
            self.slots = t.region(self, self.nslots * self.slot_bytes,
                                  e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            self.ctl = t.region(self, 64, e.IBV_ACCESS_LOCAL_WRITE)
            self.credit = self.ctl.array[:8].view(np.uint64)  # the source of every credit write
            # One receive per slot, and one for the close notice: a write with immediate
            # always finds one (the sender never has more than nslots slices unreleased).
            self._setup(recv_wr=self.nslots + 1)
            for _ in range(self.nslots + 1):
                self._post_recv()
            remote = t.lookup(peer, t.ctx.rank, "send", deadline)  # published by its connect_send
            t.bring_up(self, remote)
            self.remote = remote
            t.publish(peer, t.ctx.rank, self, addr=self.slots.addr, rkey=self.slots.mr.rkey,
                      nslots=self.nslots, slot_bytes=self.slot_bytes)
        except BaseException:
            self._destroy()
            raise

    def _post_recv(self) -> None:
        pv = self.t.pv
        sge = pv.wr.SGE(self.ctl.addr + 32, 4, self.ctl.mr.lkey)  # never written: writes carry no payload here
        try:
            self.qp.post_recv(pv.wr.RecvWR(wr_id=RECV, num_sge=1, sg=[sge]))
        except pv.Error as e:
            self._fail(f"could not post a receive on the queue pair between {self._what()}: {e}")

    def on_arrival(self, imm: int) -> None:
        if imm == self.t.close_imm:
            self.peer_closed = True
            return
        slot, nbytes = imm >> self.t.count_bits, imm & ((1 << self.t.count_bits) - 1)
        if slot != self.arrived % self.nslots or nbytes > self.slot_bytes:
            self._fail(f"rank {self.peer} broke the {NAME} protocol towards rank {self.ctx.rank}: slice "
                       f"{self.arrived} came as slot {slot} with {nbytes} bytes")
            return
        self.full.append((slot, nbytes))
        self.arrived += 1
        self._post_recv()

    def wait(self, deadline: float) -> np.ndarray:
        if self.held is not None:
            raise RuntimeError("wait() called again before release()")
        if self.closed:
            raise Aborted(f"rank {self.ctx.rank}: the {NAME} receive connection from rank {self.peer} was "
                          f"closed by this process", peer=self.peer, transport=NAME)
        self._wait(lambda: self.full or self.peer_closed or self.error is not None, deadline,
                   f"data from rank {self.peer}")
        if self.full:  # slices that arrived before an error or a close are still delivered
            self.held, nbytes = self.full.popleft()
            lo = self.held * self.slot_bytes
            return self.slots.array[lo:lo + nbytes]
        if self.error is not None:
            self._raise()
        raise PeerGone(f"rank {self.peer} closed its end of the {NAME} link to rank {self.ctx.rank}: it "
                       f"exited or closed its communicator", peer=self.peer, transport=NAME)

    def release(self) -> None:
        if self.held is None:
            raise RuntimeError("release() without a slot from wait()")
        self.held = None
        self.released += 1
        self._send_credit()

    def _send_credit(self, closing: bool = False) -> None:
        """Write the released count into the sender's credit word. Never blocks and never raises:
        a credit that finds the send queue full goes with the next one (the count is cumulative);
        a failure shows in the next wait()."""
        self.t.poll(self.cq)
        if self.error is not None or self.qp is None:
            return
        if self.inflight >= self.depth - 1:
            self.credit_dirty = True
            return
        self.credit_dirty = False
        self.credit[0] = self.released | (CLOSED_BIT if closing else 0)
        try:
            self._post(CREDIT, self.ctl, 0, 8, self.remote["addr"], self.remote["rkey"])
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
        self._post(PROBE, self.ctl, 0, 8, self.remote["addr"], self.remote["rkey"])

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.remote is not None and self.error is None and not self._aborting():
                self._settle(lambda: self.inflight < self.depth - 1, 1.0)
                self._send_credit(closing=True)
                self._settle(lambda: self.inflight == 0, 1.0)
        finally:
            self._destroy()


class IbverbsTransport(Transport):
    """One device context, PD and CQ for the communicator; an RC QP per connection."""

    name = NAME

    def __init__(self, ctx: LinkContext):
        super().__init__(ctx)
        self.pv = pv = pyverbs()
        # The immediate: slot index in the high bits, byte count below; all ones = CLOSE.
        slot_bits = max(1, ctx.nslots.bit_length())
        self.count_bits = 32 - slot_bits
        self.close_imm = (1 << 32) - 1
        if ctx.slot_bytes >= 1 << self.count_bits:
            raise ValueError(f"{NAME}: a slot of {ctx.slot_bytes} bytes does not fit the {self.count_bits}-bit "
                             f"byte count of the immediate; lower RINGCOMM_BUFFSIZE or RINGCOMM_NSLOTS")
        self.timeout = _env_int("RINGCOMM_IB_TIMEOUT", 18)
        self.retry_cnt = _env_int("RINGCOMM_IB_RETRY_CNT", 7)
        self.dev, self.port = find_device()
        self.vctx = pv.device.Context(name=self.dev)
        try:
            attr = self.vctx.query_port(self.port)
            self.lid, self.mtu = attr.lid, attr.active_mtu
            is_ib = attr.link_layer == pv.e.IBV_LINK_LAYER_INFINIBAND
            self.gid_index = _gid_index(self.dev, self.port, is_ib)
            self.gid = str(self.vctx.query_gid(self.port, self.gid_index))
            self.max_cqe = self.vctx.query_device().max_cqe
            self.pd = pv.pd.PD(self.vctx)
        except BaseException:
            self.vctx.close()
            raise
        self.cqs: list[list] = []        # [cq, entries still unclaimed]
        self.owner: dict[int, _Link] = {}  # qp_num -> the link its completions belong to
        self.links: list[_Link] = []
        self.lock = threading.Lock()
        self._closed = False

    # ---- resources -------------------------------------------------------------------------

    def cq_for(self, entries: int):
        """A CQ with room for ``entries`` more completions: the communicator's, or a new one."""
        for slot in self.cqs:
            if slot[1] >= entries:
                slot[1] -= entries
                return slot[0]
        size = max(entries, min(self.max_cqe, 4 * entries * max(1, self.ctx.world_size - 1)))
        cq = self.pv.CQ(self.vctx, size, None, None, 0)
        self.cqs.append([cq, size - entries])
        return cq

    def cq_done(self, cq, entries: int) -> None:
        for slot in self.cqs:
            if slot[0] is cq:
                slot[1] += entries

    def region(self, link: _Link, nbytes: int, access: int) -> _Region:
        r = _Region(self.pd, nbytes, access)
        link.regions.append(r)
        return r

    def make_qp(self, cq, send_wr: int, recv_wr: int):
        q, e = self.pv.qp, self.pv.e
        cap = q.QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=1, max_recv_sge=1)
        qp = q.QP(self.pd, q.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
        a = q.QPAttr()
        a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        a.pkey_index, a.port_num = 0, self.port
        qp.to_init(a)
        return qp

    def bring_up(self, link: _Link, remote: dict) -> None:
        """INIT -> RTR -> RTS towards the peer's QP."""
        q, e, addr = self.pv.qp, self.pv.e, self.pv.addr
        a = q.QPAttr()
        a.path_mtu = min(self.mtu, remote["mtu"])
        a.dest_qp_num, a.rq_psn = remote["qpn"], remote["psn"]
        a.max_dest_rd_atomic, a.min_rnr_timer = 1, 12
        gr = addr.GlobalRoute(dgid=addr.GID(remote["gid"]), sgid_index=self.gid_index)
        a.ah_attr = addr.AHAttr(gr=gr, is_global=1, port_num=self.port, dlid=remote["lid"])
        link.qp.to_rtr(a)
        a = q.QPAttr()
        a.sq_psn, a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic = (
            link.psn, self.timeout, self.retry_cnt, 7, 1)
        link.qp.to_rts(a)

    # ---- rendezvous --------------------------------------------------------------------------

    def _key(self, src: int, dst: int, role: str) -> str:
        return f"{self.ctx.prefix}/{NAME}/{src}-{dst}/{role}"

    def publish(self, src: int, dst: int, link: _Link, **extra) -> None:
        info = dict(qpn=link.qp.qp_num, psn=link.psn, gid=self.gid, lid=self.lid, mtu=self.mtu, **extra)
        self.ctx.store.set(self._key(src, dst, link.role), json.dumps(info).encode())

    def lookup(self, src: int, dst: int, role: str, deadline: float) -> dict:
        """The other end's entry; waits in short store calls so an abort is seen."""
        peer = dst if src == self.ctx.rank else src
        key = self._key(src, dst, role)
        while True:
            if self.ctx.abort is not None and self.ctx.abort.is_set():
                raise Aborted(f"rank {self.ctx.rank}: abort requested while connecting to rank {peer} over "
                              f"{NAME}", peer=peer, transport=NAME)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"rank {self.ctx.rank} (this process) timed out waiting for rank {peer} "
                                  f"to publish its {NAME} queue pair (store key {key!r})",
                                  peer=peer, transport=NAME)
            try:
                return json.loads(bytes(self.ctx.store.get(key, timeout=min(left, 0.5))))
            except TimeoutError:  # the store's StoreTimeout is a TimeoutError
                continue

    # ---- completions -------------------------------------------------------------------------

    def poll(self, cq) -> None:
        """Hand every completion waiting in ``cq`` to the link whose QP it belongs to."""
        with self.lock:
            while True:
                n, wcs = cq.poll(num_entries=16)
                for wc in wcs[:n]:
                    link = self.owner.get(wc.qp_num)
                    if link is not None:
                        link.on_completion(wc, self.pv)
                if n < 16:
                    return

    # ---- connections -------------------------------------------------------------------------

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.ctx.world_size:
            raise ValueError(f"peer {peer} is not a rank of a world of {self.ctx.world_size}")
        if self._closed:
            raise Aborted(f"rank {self.ctx.rank}: the {NAME} transport is closed", peer=peer, transport=NAME)

    def connect_send(self, peer: int, deadline: float) -> IbSend:
        self._check_peer(peer)
        link = IbSend(self, peer)
        self.links.append(link)
        return link

    def connect_recv(self, peer: int, deadline: float) -> IbRecv:
        self._check_peer(peer)
        link = IbRecv(self, peer, deadline)
        self.links.append(link)
        return link

    def close(self) -> None:
        """Close every connection, then the CQs, PD and device context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for link in self.links:
            link.close()
        self.links = []
        for cq, _ in self.cqs:
            cq.close()
        self.cqs = []
        self.pd.close()
        self.vctx.close()
