"""TCP transport: one socket per (sender, receiver, direction), staging slots at both ends.

A sender thread per send connection does the blocking ``sendall``, so acquire()
and post() never block on the socket (the connections live in tcp_link.py). That matters: a ring step sends and then
receives, and two ranks each stuck in ``sendall`` of a big slice towards the
other would deadlock once both kernels' socket buffers fill. A receiver thread
per receive connection reads frames into free slots ahead of wait(), which is
what keeps the peer's sendall moving.

On the wire, a link opens with HELLO (magic, version, src, dst, token, prefix),
answered by ACK; after that every slice is an 8-byte big-endian length and the
payload. Deadlines are ``time.monotonic()`` values.
"""
from __future__ import annotations

import collections
import fcntl
import hmac
import logging
import os
import socket
import struct
import threading
import time

from .base import PATROL_PERIOD, Aborted, LinkContext, PeerGone, PeerTimeout, Transport, wait_key
from .tcp_link import TcpRecvConnection, TcpSendConnection, _Link, _left, _recv_bytes, _wait

log = logging.getLogger("ringcomm.transport.tcp")

MAGIC, VERSION, ACK = b"RCTC", 1, b"RCOK"
HELLO = struct.Struct("!4sBIIHH")  # magic, version, src, dst, len(token), len(prefix)
SIOCGIFADDR = 0x8915
HANDSHAKE_TIMEOUT = 10.0  # a silent incoming connection holds one thread at most this long


def local_address() -> str:
    """RINGCOMM_SOCKET_IFNAME's IPv4 address, else the one routing to MASTER_ADDR, else loopback."""
    ifname = os.environ.get("RINGCOMM_SOCKET_IFNAME")
    if ifname:
        return interface_address(ifname)
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:  # connect() on UDP only picks a route and a source address; nothing is sent
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT") or 1)))
                return s.getsockname()[0]
        except (OSError, ValueError):
            pass
    return "127.0.0.1"


def interface_address(name: str) -> str:
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise OSError(f"RINGCOMM_SOCKET_IFNAME={name!r}: no such interface (have {', '.join(names)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise OSError(f"RINGCOMM_SOCKET_IFNAME={name!r}: interface has no IPv4 address") from e
    return socket.inet_ntoa(req[20:24])  # struct ifreq: 16-byte name, then sockaddr_in


class TcpTransport(Transport):
    """Listens on one port; publishes ``host:port`` under ``{prefix}/tcp/{rank}``."""

    name = "tcp"

    def __init__(self, ctx: LinkContext):
        super().__init__(ctx)
        self._cv = threading.Condition()
        self._accepted: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._handshaking: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._links: list[_Link] = []
        self._closed = False
        host = local_address()
        self._lsock = socket.create_server((host, 0), backlog=max(64, ctx.world_size))
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"ringcomm-tcp-accept-{ctx.rank}")
        self._acceptor.start()
        try:
            ctx.store.set(f"{ctx.prefix}/tcp/{ctx.rank}", self.address)
        except BaseException:
            self.close()
            raise

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._lsock.accept()
            except OSError:
                return  # close() shut the listening socket
            with self._cv:
                if self._closed:
                    sock.close()
                    return
                self._handshaking.add(sock)
                self._threads = [t for t in self._threads if t.is_alive()]
                t = threading.Thread(target=self._handshake, args=(sock, addr), daemon=True,
                                     name=f"ringcomm-tcp-hello-{self.ctx.rank}")
                self._threads.append(t)
                t.start()

    def _handshake(self, sock: socket.socket, addr) -> None:
        # In its own thread, so a silent or slow client cannot hold up the other ranks' connections.
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            src = self._read_hello(sock)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(ACK)
        except (OSError, EOFError, ValueError) as e:
            if not self._closed:
                log.warning("tcp: rank %d refused a connection from %s:%s: %s",
                            self.ctx.rank, addr[0], addr[1], e)
            with self._cv:
                self._handshaking.discard(sock)
            sock.close()
            return
        with self._cv:
            self._handshaking.discard(sock)
            if self._closed:
                sock.close()
                return
            self._accepted[src].append(sock)
            self._cv.notify_all()

    def _read_hello(self, sock: socket.socket) -> int:
        magic, version, src, dst, tlen, plen = HELLO.unpack(_recv_bytes(sock, HELLO.size))
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a ringcomm tcp hello (magic {magic!r}, version {version})")
        token, prefix = _recv_bytes(sock, tlen), _recv_bytes(sock, plen)
        if not hmac.compare_digest(token, self.ctx.token.encode()):
            raise ValueError("wrong RINGCOMM_TOKEN")
        if prefix != self.ctx.prefix.encode():
            raise ValueError(f"it is for communicator {prefix!r}, this one is {self.ctx.prefix!r}")
        if dst != self.ctx.rank or src >= self.ctx.world_size:
            raise ValueError(f"it claims to be from rank {src} to rank {dst}")
        return src

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.ctx.world_size:
            raise ValueError(f"peer {peer} is not a rank of a world of {self.ctx.world_size}")
        if self._closed:
            raise Aborted(f"rank {self.ctx.rank}: the tcp transport is closed", peer=peer, transport="tcp")

    def connect_recv(self, peer: int, deadline: float) -> TcpRecvConnection:
        self._check_peer(peer)
        with self._cv:
            _wait(self._cv, lambda: self._closed or self._accepted[peer], deadline, self.ctx, peer,
                  f"rank {peer} to connect", patrol=_SenderPatrol(self.ctx, peer))
            self._check_peer(peer)
            link = TcpRecvConnection(self.ctx, peer, self._accepted[peer].popleft())
            self._links.append(link)
        return link

    def connect_send(self, peer: int, deadline: float) -> TcpSendConnection:
        self._check_peer(peer)
        link = TcpSendConnection(self.ctx, peer, self._dial(peer, self._lookup(peer, deadline), deadline))
        with self._cv:
            closed = self._closed
            if not closed:
                self._links.append(link)
        if closed:  # close() ran while we were dialling; it could not see this link
            link.close()
            self._check_peer(peer)
        return link

    def _lookup(self, peer: int, deadline: float) -> tuple[str, int]:
        key = f"{self.ctx.prefix}/tcp/{peer}"
        value = wait_key(self.ctx, key, deadline, peer, "tcp")  # its listener's address
        host, _, port = bytes(value).decode().rpartition(":")
        return host, int(port)

    def _dial(self, peer: int, addr: tuple[str, int], deadline: float) -> socket.socket:
        me, where = self.ctx.rank, f"{addr[0]}:{addr[1]}"
        token, prefix = self.ctx.token.encode(), self.ctx.prefix.encode()
        hello = HELLO.pack(MAGIC, VERSION, me, peer, len(token), len(prefix)) + token + prefix
        pause, last, next_patrol = 0.005, None, time.monotonic() + PATROL_PERIOD
        while True:
            left = _left(deadline, self.ctx, peer, f"a connection to rank {peer} at {where} (last: {last})")
            try:
                sock = socket.create_connection(addr, timeout=left)
                break
            except OSError as e:  # the peer may not be listening yet ...
                last = e
            if time.monotonic() >= next_patrol:   # ... or never will: it died (a refusal alone says neither)
                self.ctx.check_alive(peer, "tcp", f": its tcp listener at {where} refused this rank's "
                                                  f"connection ({last})")
                next_patrol = time.monotonic() + PATROL_PERIOD
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello)
            ack = _recv_bytes(sock, len(ACK))
        except TimeoutError:
            sock.close()
            raise PeerTimeout(f"rank {me} (this process) timed out waiting for rank {peer} at {where} "
                              f"to answer the tcp handshake", peer=peer, transport="tcp") from None
        except (OSError, EOFError) as e:
            sock.close()
            raise PeerGone(f"rank {peer} at {where} refused the tcp connection from rank {me} ({e}): "
                           f"wrong RINGCOMM_TOKEN, or another communicator?",
                           peer=peer, transport="tcp") from e
        if ack != ACK:
            sock.close()
            raise PeerGone(f"rank {peer} at {where} answered the tcp handshake with {ack!r}",
                           peer=peer, transport="tcp")
        sock.settimeout(None)
        return sock

    def close(self) -> None:
        """Stop every thread and close every socket this transport made. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
            links, threads, handshaking = self._links, self._threads, list(self._handshaking)
            unclaimed = [s for q in self._accepted.values() for s in q]
            self._links, self._threads = [], []
            self._accepted.clear()
        for s in [self._lsock, *handshaking]:  # wakes accept()/recv(); their threads close them
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._lsock.close()
        for s in unclaimed:
            s.close()
        for link in links:
            link.close()
        self._acceptor.join()
        for t in threads:
            t.join()


class _SenderPatrol:
    """What a receiver waiting for its sender to connect checks at each patrol: that the sender
    lives, and that the store it reads this rank's address from is still there. A rank that lost
    the store (its host died) fails the call and shrinks; without this its peer waited the whole
    timeout for a connection that could no longer come, and came to the shrink too late. A sender
    that read the address before the store went may still be dialling: one more patrol for it."""

    def __init__(self, ctx: LinkContext, peer: int):
        self.ctx, self.peer, self.lost = ctx, peer, False

    def __call__(self) -> None:
        ctx = self.ctx
        ctx.check_alive(self.peer, "tcp", " before it connected over tcp")
        try:
            ctx.store.get(f"{ctx.prefix}/tcp/{ctx.rank}", timeout=0)  # this rank's address, set at start
            self.lost = False
        except TimeoutError:
            pass  # a slow store is not a lost one
        except Exception:  # noqa: BLE001 - the store's StoreError (the transports do not import the core)
            if self.lost:
                raise
            self.lost = True
