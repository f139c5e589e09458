"""TCP transport: one socket per (sender, receiver, direction), staging slots at both ends.

A sender thread per send connection does the blocking ``sendall``, so acquire()
and post() never block on the socket. That matters: a ring step sends and then
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

import numpy as np

from .base import (PATROL_PERIOD, Aborted, LinkContext, PeerGone, PeerTimeout, RecvConnection,
                   SendConnection, Transport, wait_key)

log = logging.getLogger("ringcomm.transport.tcp")

MAGIC, VERSION, ACK = b"RCTC", 1, b"RCOK"
HELLO = struct.Struct("!4sBIIHH")  # magic, version, src, dst, len(token), len(prefix)
LENGTH = struct.Struct("!Q")
SIOCGIFADDR = 0x8915
HANDSHAKE_TIMEOUT = 10.0  # a silent incoming connection holds one thread at most this long
ABORT_POLL = 0.05  # an Event cannot wake a Condition, so waits look at ctx.abort this often
LINGER = 5.0  # close() lets posted slices reach a peer that is still reading for this long


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


def _recv_exact(sock: socket.socket, view: memoryview, first: bool = False) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("EOF" if first and got == 0 else f"EOF mid-frame after {got} of {len(view)} bytes")
        got += k


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf), first=True)
    return bytes(buf)


def _send_frame(sock: socket.socket, slot: np.ndarray, n: int) -> None:
    header = LENGTH.pack(n)
    if n == 0:
        sock.sendall(header)
        return
    payload = memoryview(slot)[:n]
    sent = sock.sendmsg([header, payload])  # one syscall for header and payload when it all fits
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    sock.sendall(payload[sent - len(header):])


def _left(deadline: float, ctx: LinkContext, peer: int, what: str) -> float:
    """Seconds left before the deadline; PeerTimeout when none, Aborted when ctx.abort is set."""
    if ctx.abort is not None and ctx.abort.is_set():
        raise Aborted(f"rank {ctx.rank}: abort requested while waiting for {what} over tcp",
                      peer=peer, transport="tcp")
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout(f"rank {ctx.rank} (this process) timed out waiting for {what} over tcp",
                          peer=peer, transport="tcp")
    return left


def _wait(cv: threading.Condition, ready, deadline: float, ctx: LinkContext, peer: int, what: str):
    """With ``cv`` held, wait until ready() is true (see _left for the errors); a wait
    that lasts calls ctx.watchdog every PATROL_PERIOD."""
    next_patrol = time.monotonic() + PATROL_PERIOD
    while not ready():
        left = _left(deadline, ctx, peer, what)
        cv.wait(left if ctx.abort is None and ctx.watchdog is None else min(left, ABORT_POLL))
        if ctx.watchdog is not None and time.monotonic() >= next_patrol:
            ctx.watchdog()
            next_patrol = time.monotonic() + PATROL_PERIOD


class _Link:
    """State both directions share: slots, a FIFO of full ones, a pump thread, the first error.

    ``_full`` holds (slot, nbytes): posted and not yet on the wire (send side), or
    read from the wire and not yet returned by wait() (receive side).
    """

    transport = "tcp"
    role = "?"

    def __init__(self, ctx: LinkContext, peer: int, sock: socket.socket):
        self.ctx, self.peer, self.slot_bytes = ctx, peer, ctx.slot_bytes
        self._sock = sock
        self._slots = np.zeros((ctx.nslots, ctx.slot_bytes), dtype=np.uint8)
        self._free = collections.deque(range(ctx.nslots))
        self._full: collections.deque[tuple[int, int]] = collections.deque()
        self._held: int | None = None
        self._error: Exception | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ringcomm-tcp-{self.role}-{ctx.rank}-{peer}")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._pump()
        except Exception as e:  # noqa: BLE001 - every failure must reach the waiters
            with self._cv:
                if self._error is None:
                    self._error = self._describe(e)
                self._cv.notify_all()

    def _raise(self):
        e = self._error  # a fresh instance per raise keeps tracebacks from piling up
        raise type(e)(str(e), peer=self.peer, transport="tcp")

    def _mark_closed(self) -> bool:
        """Returns False when already closed."""
        with self._cv:
            if self._closed:
                return False
            self._closed = True
            if self._error is None:
                self._error = Aborted(f"rank {self.ctx.rank}: the tcp {self.role} connection with "
                                      f"rank {self.peer} was closed by this process",
                                      peer=self.peer, transport="tcp")
            self._cv.notify_all()
            return True

    def _teardown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the pump if it is blocked in the socket
        except OSError:
            pass
        self._thread.join()
        self._sock.close()


class TcpSendConnection(_Link, SendConnection):
    role = "send"

    def acquire(self, deadline: float) -> np.ndarray:
        with self._cv:
            if self._held is not None:
                raise RuntimeError("acquire() called again before post()")
            _wait(self._cv, lambda: self._free or self._error is not None, deadline, self.ctx,
                  self.peer, f"a free slot to send to rank {self.peer}")
            if self._error is not None:
                self._raise()
            self._held = self._free.popleft()
            return self._slots[self._held]

    def post(self, nbytes: int) -> None:
        with self._cv:
            if self._error is not None:
                self._raise()
            if self._held is None:
                raise RuntimeError("post() without a slot from acquire()")
            if not 0 <= nbytes <= self.slot_bytes:
                raise ValueError(f"post({nbytes}): a slot holds 0..{self.slot_bytes} bytes")
            self._full.append((self._held, nbytes))
            self._held = None
            self._cv.notify_all()

    def _pump(self) -> None:
        while True:
            with self._cv:
                while not self._full and not self._closed:
                    self._cv.wait()
                if not self._full:
                    return  # closed, and everything posted is on the wire
                slot, n = self._full[0]
            _send_frame(self._sock, self._slots[slot], n)
            with self._cv:
                self._full.popleft()
                self._free.append(slot)
                self._cv.notify_all()

    def _describe(self, e: Exception) -> PeerGone:
        return PeerGone(f"rank {self.ctx.rank} could not send to rank {self.peer} over tcp ({e!r}): "
                        f"rank {self.peer} closed the connection or died", peer=self.peer, transport="tcp")

    def close(self) -> None:
        if not self._mark_closed():
            return
        # A send is complete once posted, so slices still queued must reach the peer,
        # unless the job is aborting or the peer stops reading for LINGER seconds.
        aborting = self.ctx.abort is not None and self.ctx.abort.is_set()
        self._thread.join(0 if aborting else LINGER)
        self._teardown()


class TcpRecvConnection(_Link, RecvConnection):
    role = "recv"

    def wait(self, deadline: float) -> np.ndarray:
        with self._cv:
            if self._held is not None:
                raise RuntimeError("wait() called again before release()")
            _wait(self._cv, lambda: self._full or self._error is not None, deadline, self.ctx,
                  self.peer, f"data from rank {self.peer}")
            # Slices that arrived before an EOF are still delivered: the peer sent them.
            if self._full and not self._closed:
                self._held, n = self._full.popleft()
                return self._slots[self._held, :n]
            self._raise()

    def release(self) -> None:
        with self._cv:
            if self._held is None:
                raise RuntimeError("release() without a slot from wait()")
            self._free.append(self._held)
            self._held = None
            self._cv.notify_all()

    def _pump(self) -> None:
        header = bytearray(LENGTH.size)
        while True:
            # Reading only into a free slot is the flow control: when wait()/release()
            # lag, the kernel buffers fill and the peer's sender thread blocks.
            with self._cv:
                while not self._free and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                slot = self._free.popleft()
            _recv_exact(self._sock, memoryview(header), first=True)
            (n,) = LENGTH.unpack(header)
            if n > self.slot_bytes:
                raise ValueError(f"a frame of {n} bytes, larger than a slot ({self.slot_bytes})")
            _recv_exact(self._sock, memoryview(self._slots[slot])[:n])
            with self._cv:
                self._full.append((slot, n))
                self._cv.notify_all()

    def _describe(self, e: Exception) -> PeerGone:
        me, peer = self.ctx.rank, self.peer
        if isinstance(e, EOFError):
            msg = (f"rank {peer} closed the connection ({e}) to rank {me} over tcp: "
                   f"it exited or closed its communicator")
        elif isinstance(e, ValueError):
            msg = f"rank {peer} broke the tcp protocol towards rank {me}: it sent {e}"
        else:
            msg = f"the tcp connection from rank {peer} to rank {me} broke: {e!r}"
        return PeerGone(msg, peer=peer, transport="tcp")

    def close(self) -> None:
        if self._mark_closed():
            self._teardown()


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
                  f"rank {peer} to connect")
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
        pause, last = 0.005, None
        while True:
            left = _left(deadline, self.ctx, peer, f"a connection to rank {peer} at {where} (last: {last})")
            try:
                sock = socket.create_connection(addr, timeout=left)
                break
            except OSError as e:  # the peer may not be listening yet
                last = e
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
