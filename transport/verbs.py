"""The pyverbs plumbing under the ibverbs transport (not a transport itself).

Finding the device, port and GID (RINGCOMM_IB_HCA / RINGCOMM_IB_PORT / RINGCOMM_IB_GID_INDEX, read
like NCCL_IB_HCA / NCCL_IB_GID_INDEX), registered memory, and a Device that owns one context,
protection domain and completion queue and makes RC queue pairs: RESET -> INIT here, INIT -> RTR ->
RTS once the peer's QP number, PSN, GID and LID are known. The QP's ack timeout exponent
(4.096 us * 2^t) and retry count come from RINGCOMM_IB_TIMEOUT (default 18, ~1.07 s) and
RINGCOMM_IB_RETRY_CNT (default 6), like NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT. Not NCCL's 7: Linux's
Soft-RoCE treats 7 as "retry forever" (rxe_comp.c), so a dead peer would never be noticed there;
with 6 a peer that stops answering fails the QP after 7 timeouts, ~7.5 s.

pyverbs is optional and imported on first use; it must be the build that matches the system's
rdma-core (the PyPI wheels need rdma-core >= 57; distributions ship python3-pyverbs).
"""
from __future__ import annotations

import mmap
import os
import socket
import threading
from types import SimpleNamespace

import numpy as np

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


def env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _hca_hits(name: str) -> tuple[bool, list]:
    """(whether RINGCOMM_IB_HCA excludes, the ports of its entries that match ``name``: None for an
    entry without one)."""
    spec = os.environ.get("RINGCOMM_IB_HCA", "").strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    hits = []
    for item in filter(None, (s.strip() for s in spec.lstrip("=").split(","))):
        dev, _, port = item.partition(":")
        if (name == dev) if exact else name.startswith(dev):
            try:
                hits.append(int(port) if port else None)
            except ValueError:
                raise ValueError(f"RINGCOMM_IB_HCA entry {item!r}: the port after ':' must be a number") from None
    return exclude, hits


def hca_filter(name: str) -> tuple[bool, int | None]:
    """RINGCOMM_IB_HCA as NCCL_IB_HCA: "mlx5_0:1,mlx5_1" (prefixes), "=" exact names, "^" excludes
    ("^mlx5_0" the device, "^mlx5_0:1" only its port 1: excluded_ports). Returns (use this device?,
    the port the entry names or None)."""
    if not os.environ.get("RINGCOMM_IB_HCA", "").strip():
        return True, None
    exclude, hits = _hca_hits(name)
    if exclude:
        return None not in hits, None
    return bool(hits), (hits[0] if hits else None)


def excluded_ports(name: str) -> frozenset[int]:
    """The ports of device ``name`` that "^dev:port" entries of RINGCOMM_IB_HCA exclude."""
    exclude, hits = _hca_hits(name)
    return frozenset(p for p in hits if p is not None) if exclude else frozenset()


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
        wanted, port = hca_filter(name)
        if not wanted:
            seen.append(f"{name} (not selected by RINGCOMM_IB_HCA={os.environ.get('RINGCOMM_IB_HCA', '')!r})")
            continue
        port, skip = env_int("RINGCOMM_IB_PORT", port), excluded_ports(name)
        with pv.device.Context(name=name) as vctx:
            for p in [port] if port else range(1, vctx.query_device().phys_port_cnt + 1):
                if p in skip:
                    seen.append(f"{name} port {p} (excluded by RINGCOMM_IB_HCA)")
                elif vctx.query_port(p).state == pv.e.IBV_PORT_ACTIVE:
                    return name, p
                else:
                    seen.append(f"{name} port {p} (not active)")
    raise LookupError(f"no usable RDMA port: {', '.join(seen)}")


# The knobs' ranges: an ack timeout exponent is 5 bits (0: wait for ever, which ringcomm refuses: a dead
# peer must fail the link), a retry count 3 bits; ports count from 1; a GID index from 0 (-1: automatic,
# as NCCL_IB_GID_INDEX=-1 means).
KNOBS = {"RINGCOMM_IB_TIMEOUT": (1, 31), "RINGCOMM_IB_RETRY_CNT": (0, 7), "RINGCOMM_IB_PORT": (1, 255),
         "RINGCOMM_IB_GID_INDEX": (-1, 65535)}


def check_knobs() -> None:
    """ValueError naming the RINGCOMM_IB_* setting that is not an integer in its range."""
    for name, (low, high) in KNOBS.items():
        value = env_int(name, None)
        if value is not None and not low <= value <= high:
            raise ValueError(f"{name}={value} is out of range: it must be between {low} and {high}")


def unavailable() -> str | None:
    """None when an RDMA device can be used here, else why not (for transport selection). A
    RINGCOMM_IB_* setting that is wrong is a ValueError, not a reason to take another transport."""
    check_knobs()
    try:
        find_device()
    except (ImportError, LookupError) as e:
        return str(e)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken verbs stack counts as "no device"
        return f"the RDMA stack failed: {e!r}"
    return None


def gid_index(name: str, port: int, is_ib: bool) -> int:
    """RINGCOMM_IB_GID_INDEX, else (RoCE) an IPv4-mapped RoCE v2 GID as NCCL prefers, else index 0."""
    chosen = env_int("RINGCOMM_IB_GID_INDEX", None)
    if chosen == -1:                    # automatic, as NCCL_IB_GID_INDEX=-1
        chosen = None
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


class Region:
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


class Device:
    """One opened port: context, PD, completion queues, and which QP's completions go where."""

    def __init__(self, world_size: int):
        self.pv = pv = pyverbs()
        self.timeout = env_int("RINGCOMM_IB_TIMEOUT", 18)
        self.retry_cnt = env_int("RINGCOMM_IB_RETRY_CNT", 6)
        self.world_size = world_size
        self.name, self.port = find_device()
        self.vctx = pv.device.Context(name=self.name)
        try:
            attr = self.vctx.query_port(self.port)
            self.lid, self.mtu = attr.lid, attr.active_mtu
            is_ib = attr.link_layer == pv.e.IBV_LINK_LAYER_INFINIBAND
            self.gid_index = gid_index(self.name, self.port, is_ib)
            self.gid = str(self.vctx.query_gid(self.port, self.gid_index))
            self.max_cqe = self.vctx.query_device().max_cqe
            self.pd = pv.pd.PD(self.vctx)
        except BaseException:
            self.vctx.close()
            raise
        self.cqs: list[list] = []          # [cq, entries still unclaimed]
        self.owner: dict[int, object] = {}  # qp_num -> whose on_completion(wc) gets its completions
        self.lock = threading.Lock()

    def cq_for(self, entries: int):
        """A CQ with room for ``entries`` more completions: the first one, or a new one when full."""
        for slot in self.cqs:
            if slot[1] >= entries:
                slot[1] -= entries
                return slot[0]
        size = max(entries, min(self.max_cqe, 4 * entries * max(1, self.world_size - 1)))
        cq = self.pv.CQ(self.vctx, size, None, None, 0)
        self.cqs.append([cq, size - entries])
        return cq

    def cq_done(self, cq, entries: int) -> None:
        for slot in self.cqs:
            if slot[0] is cq:
                slot[1] += entries

    def make_qp(self, cq, send_wr: int, recv_wr: int, owner):
        """An RC QP in INIT whose completions go to ``owner.on_completion``."""
        q, e = self.pv.qp, self.pv.e
        cap = q.QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=1, max_recv_sge=1)
        qp = q.QP(self.pd, q.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
        a = q.QPAttr()
        a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        a.pkey_index, a.port_num = 0, self.port
        qp.to_init(a)
        self.owner[qp.qp_num] = owner
        return qp

    def bring_up(self, qp, psn: int, remote: dict) -> None:
        """INIT -> RTR -> RTS towards the peer's QP (its qpn, psn, gid, lid, mtu)."""
        q, addr = self.pv.qp, self.pv.addr
        a = q.QPAttr()
        a.path_mtu = min(self.mtu, remote["mtu"])
        a.dest_qp_num, a.rq_psn = remote["qpn"], remote["psn"]
        a.max_dest_rd_atomic, a.min_rnr_timer = 1, 12
        gr = addr.GlobalRoute(dgid=addr.GID(remote["gid"]), sgid_index=self.gid_index)
        a.ah_attr = addr.AHAttr(gr=gr, is_global=1, port_num=self.port, dlid=remote["lid"])
        qp.to_rtr(a)
        a = q.QPAttr()
        a.sq_psn, a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic = psn, self.timeout, self.retry_cnt, 7, 1
        qp.to_rts(a)

    def describe(self, qp, psn: int) -> dict:
        return dict(qpn=qp.qp_num, psn=psn, gid=self.gid, lid=self.lid, mtu=int(self.mtu))

    def forget(self, qp) -> None:
        self.owner.pop(qp.qp_num, None)

    def poll(self, cq) -> None:
        """Hand every completion waiting in ``cq`` to the owner of the QP it belongs to."""
        with self.lock:
            while True:
                n, wcs = cq.poll(num_entries=16)
                for wc in wcs[:n]:
                    owner = self.owner.get(wc.qp_num)
                    if owner is not None:
                        owner.on_completion(wc)
                if n < 16:
                    return

    def post_write(self, qp, wr_id: int, region: Region, offset: int, nbytes: int, raddr: int, rkey: int,
                   imm: int | None = None) -> None:
        """A signalled RDMA WRITE (WITH IMMEDIATE when ``imm`` is given, in host order)."""
        pv = self.pv
        op = pv.e.IBV_WR_RDMA_WRITE if imm is None else pv.e.IBV_WR_RDMA_WRITE_WITH_IMM
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=op, num_sge=1, send_flags=pv.e.IBV_SEND_SIGNALED,
                          sg=[pv.wr.SGE(region.addr + offset, nbytes, region.mr.lkey)])
        if imm is not None:
            wr.imm_data = socket.htonl(imm)  # the wire is big-endian; the receiver ntohl()s
        wr.set_wr_rdma(rkey, raddr)
        qp.post_send(wr)

    def post_recv(self, qp, wr_id: int, region: Region, offset: int) -> None:
        pv = self.pv
        qp.post_recv(pv.wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[pv.wr.SGE(region.addr + offset, 4, region.mr.lkey)]))

    def close(self) -> None:
        for cq, _ in self.cqs:
            cq.close()
        self.cqs = []
        self.pd.close()
        self.vctx.close()
