"""Which transport joins this rank to each peer, and the connections, made on first use.

Peers on the same host (same boot, same network namespace) use shared memory,
everything else TCP, as NCCL picks its p2p/shm transports before the network
(src/transport.cc). Between hosts, ibverbs (RDMA) when both ends have an active
RDMA port, else TCP. RINGCOMM_TRANSPORT=tcp|shm|ibverbs forces one everywhere.
Calls on device (CUDA) buffers use cuda_ipc to peers on this host and, to the others, the
network transport staged through registered host slots (Links.device); those connections
live beside the host ones.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

from ringcomm.transport.base import Aborted, LinkContext, PeerGone, PeerTimeout, wait_key
from ringcomm.transport.cuda_rt import CudaError

from .errors import (CollectiveTimeout, CommunicatorClosed, PeerFailure, RingcommError, StoreError,
                     StoreTimeout)
from .watchdog import told

TRANSPORTS = ("shm", "tcp", "ibverbs")


def host_id() -> str:
    """Equal for two processes exactly when they can share /dev/shm as one host.

    A network namespace counts as a host of its own: containers on one machine
    (and the tests' namespaces) talk as separate hosts would.
    """
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = "?"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{boot}/{netns}"


def _make_transport(name: str, ctx: LinkContext):
    if name == "shm":
        from ringcomm.transport.shm import ShmTransport
        return ShmTransport(ctx)
    if name == "tcp":
        from ringcomm.transport.tcp import TcpTransport
        return TcpTransport(ctx)
    if name == "ibverbs":
        from ringcomm.transport.ibverbs import IbverbsTransport
        return IbverbsTransport(ctx)
    if name == "cuda_ipc":
        from ringcomm.transport.cuda_ipc import CudaIpcTransport
        return CudaIpcTransport(ctx)
    raise ValueError(f"unknown transport {name!r}")


def _rdma_usable(forced: str | None, rank: int) -> bool:
    from ringcomm.transport.ibverbs import unavailable
    why = unavailable()
    if why is not None and forced == "ibverbs":
        raise RingcommError(f"RINGCOMM_TRANSPORT=ibverbs, but rank {rank} (this process) cannot use RDMA: {why}")
    return why is None


class Links:
    """The connections of one communicator, keyed by (peer, "send" | "recv")."""

    def __init__(self, ctx: LinkContext, timeout: float):
        # The transports' waits for a store key ask peer_gone whether the peer they wait for died.
        self.ctx, self.timeout = replace(ctx, peer_gone=self.peer_gone), timeout
        self.roster = None  # every rank's host, pid and meeting socket, once joined (assemble)
        self.forced = os.environ.get("RINGCOMM_TRANSPORT", "").strip().lower() or None
        if self.forced is not None and self.forced not in TRANSPORTS:
            raise ValueError(f"RINGCOMM_TRANSPORT={self.forced!r}: choose one of {', '.join(TRANSPORTS)}")
        self.me = host_id()
        ctx.store.set(f"{ctx.prefix}/host/{ctx.rank}", self.me.encode())   # read until the roster is in
        # A world of one has no links, but RINGCOMM_TRANSPORT=ibverbs still says at init whether it could.
        self.rdma = (self.forced in (None, "ibverbs") and (ctx.world_size > 1 or self.forced == "ibverbs")
                     and _rdma_usable(self.forced, ctx.rank))
        ctx.store.set(f"{ctx.prefix}/rdma/{ctx.rank}", b"1" if self.rdma else b"0")
        self.transports: dict = {}
        self.conns: dict = {}
        self.kinds: dict[int, str] = {}
        self.closed = False
        self.call = None  # the executor's current Call, named in connect errors

    def __call__(self, peer: int, direction: str):
        conn = self.conns.get((peer, direction))
        if conn is None:
            if self.closed:
                raise CommunicatorClosed(f"rank {self.ctx.rank}: this communicator's links are closed")
            conn = self.conns[(peer, direction)] = self._connect(peer, direction)
        return conn

    def prepare(self, srcs, dsts) -> None:
        """Connect everything a schedule needs: all sends first, then all receives
        (the order that keeps connecting deadlock-free, see Transport)."""
        for p in sorted(dsts):
            self(p, "send")
        for p in sorted(srcs):
            self(p, "recv")

    def device(self, peer: int, direction: str, slot_bytes: int):
        """The cuda_ipc connection to a peer on this host, for calls on device buffers (ringcomm/device.py);
        its slots are device memory of ``slot_bytes`` each."""
        conn = self.conns.get((peer, direction, "cuda_ipc"))
        if conn is None:
            if self.closed:
                raise CommunicatorClosed(f"rank {self.ctx.rank}: this communicator's links are closed")
            host = self.transport_for(peer)
            name = "cuda_ipc" if host == "shm" else f"{host}+staged"     # another host: see cuda_staged.py
            if name not in self.transports:
                ctx = replace(self.ctx, slot_bytes=slot_bytes, prefix=f"{self.ctx.prefix}/device")
                self.transports[name] = _make_transport("cuda_ipc" if host == "shm" else host, ctx)
            conn = self._connect(peer, direction, name)
            if host != "shm":
                from ringcomm.transport.cuda_staged import staged
                conn = staged(conn, direction, name)
            self.conns[(peer, direction, "cuda_ipc")] = conn
        return conn

    def transport_for(self, peer: int) -> str:
        if self.forced:
            return self.forced
        if peer not in self.kinds:
            if self.roster is not None:  # no store needed
                theirs = self.roster.entries[peer]["host"]
            else:
                key = f"{self.ctx.prefix}/host/{peer}"
                theirs = wait_key(self.ctx, key, time.monotonic() + self.timeout, peer, "the store").decode()
            self.kinds[peer] = "shm" if theirs == self.me else self._network(peer)
        return self.kinds[peer]

    def _network(self, peer: int) -> str:
        """ibverbs when both ends have an RDMA port (both decide alike), else tcp."""
        if self.rdma and self.ctx.store.get(f"{self.ctx.prefix}/rdma/{peer}", timeout=self.timeout) == b"1":
            return "ibverbs"
        return "tcp"

    def _connect(self, peer: int, direction: str, transport: str | None = None):
        name = "a transport not chosen yet"
        try:
            name = transport or self.transport_for(peer)
            if name not in self.transports:
                self.transports[name] = _make_transport(name, self.ctx)
            t = self.transports[name]
            deadline = time.monotonic() + self.timeout
            return t.connect_send(peer, deadline) if direction == "send" else t.connect_recv(peer, deadline)
        except (PeerTimeout, StoreTimeout) as e:
            raise told(self.ctx.watchdog, CollectiveTimeout, "timed out",
                       f"rank {self.ctx.rank} (this process) timed out after {self.timeout:g} s: could not connect "
                       f"to rank {peer} ({direction}{self._purpose()}) over {name} within the timeout of this "
                       f"communicator: {e}", peer) from None
        except Aborted as e:
            raise RingcommError(f"rank {self.ctx.rank} (this process) was aborted while connecting to rank "
                                f"{peer} ({direction}{self._purpose()}) over {name}: {e}") from None
        except (PeerGone, StoreError) as e:
            raise told(self.ctx.watchdog, PeerFailure, "failed", f"rank {self.ctx.rank} (this process) could not "
                       f"connect to rank {peer} ({direction}{self._purpose()}) over {name}: {e}"
                       + (self.known_dead() if isinstance(e, StoreError) else ""), peer) from None
        except (OSError, ImportError, LookupError) as e:
            raise RingcommError(f"rank {self.ctx.rank} (this process) could not connect to rank {peer} "
                                f"({direction}{self._purpose()}) over {name}: {e}") from e
        except (RingcommError, CudaError, ValueError, TypeError):
            raise                       # ringcomm's own (the device path names a CUDA error), bad settings
        except Exception as e:  # noqa: BLE001 - a transport's library (pyverbs' PyverbsRDMAError, say)
            raise RingcommError(f"rank {self.ctx.rank} (this process) could not connect to rank {peer} "
                                f"({direction}{self._purpose()}) over {name}: {type(e).__name__}: {e}") from e

    def peer_gone(self, peer: int) -> str:
        """"" while ``peer`` may live (or before the roster is in); else why it is known dead."""
        return self.roster.why_gone(peer) if self.roster is not None else ""

    def known_dead(self) -> str:
        """" (rank 0 (pid 123) died)" for the ranks known dead, or "": what a lost store
        usually means (the rank that hosted it died), said where the store's loss is reported."""
        dead = [f"rank {p} {why}" for p in range(self.ctx.world_size)
                if p != self.ctx.rank and (why := self.peer_gone(p))]
        return f" ({'; '.join(dead)})" if dead else ""

    def _purpose(self) -> str:
        return f", for {self.call.name} #{self.call.seq}" if self.call is not None else ""

    def close(self) -> None:
        self.closed = True
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        for t in self.transports.values():
            t.close()
        self.transports.clear()
