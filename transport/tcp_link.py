"""One TCP link: the connection objects of the tcp transport and their wire framing.

Each connection owns ``nslots`` staging slots and one pump thread: the sender's
thread does the blocking ``sendall`` of posted slots, the receiver's reads frames
into free slots ahead of wait(). Every slice on the wire is an 8-byte big-endian
length and the payload. Deadlines are ``time.monotonic()`` values.
"""
from __future__ import annotations

import collections
import socket
import struct
import threading
import time

import numpy as np

from .base import PATROL_PERIOD, Aborted, LinkContext, PeerGone, PeerTimeout, RecvConnection, SendConnection

LENGTH = struct.Struct("!Q")
ABORT_POLL = 0.05  # an Event cannot wake a Condition, so waits look at ctx.abort this often
LINGER = 5.0  # close() lets posted slices reach a peer that is still reading for this long


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


def _wait(cv: threading.Condition, ready, deadline: float, ctx: LinkContext, peer: int, what: str,
          patrol=None):
    """With ``cv`` held, wait until ready() is true (see _left for the errors); a wait
    that lasts calls ctx.watchdog, and ``patrol()`` (with ``cv`` released: it may raise to end
    the wait), every PATROL_PERIOD."""
    next_patrol = time.monotonic() + PATROL_PERIOD
    polls = ctx.abort is not None or ctx.watchdog is not None or patrol is not None
    while not ready():
        left = _left(deadline, ctx, peer, what)
        cv.wait(min(left, ABORT_POLL) if polls else left)
        if time.monotonic() >= next_patrol:
            if ctx.watchdog is not None:
                ctx.watchdog()
            if patrol is not None:
                cv.release()
                try:
                    patrol()
                finally:
                    cv.acquire()
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
        self._held: collections.deque[int] = collections.deque()  # in the caller's hands, oldest first
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
            _wait(self._cv, lambda: self._free or self._error is not None, deadline, self.ctx,
                  self.peer, f"a free slot to send to rank {self.peer}")
            if self._error is not None:
                self._raise()
            self._held.append(self._free.popleft())
            return self._slots[self._held[-1]]

    def ready(self) -> bool:
        return bool(self._free) or self._error is not None  # a lock-free peek: only we take slots

    def post(self, nbytes: int) -> None:
        with self._cv:
            if self._error is not None:
                self._raise()
            if not self._held:
                raise RuntimeError("post() without a slot from acquire()")
            if not 0 <= nbytes <= self.slot_bytes:
                raise ValueError(f"post({nbytes}): a slot holds 0..{self.slot_bytes} bytes")
            self._full.append((self._held.popleft(), nbytes))
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
            _wait(self._cv, lambda: self._full or self._error is not None, deadline, self.ctx,
                  self.peer, f"data from rank {self.peer}")
            # Slices that arrived before an EOF are still delivered: the peer sent them.
            if self._full and not self._closed:
                slot, n = self._full.popleft()
                self._held.append(slot)
                return self._slots[slot, :n]
            self._raise()

    def ready(self) -> bool:
        return bool(self._full) or self._error is not None  # a lock-free peek: only we take data

    def release(self) -> None:
        with self._cv:
            if not self._held:
                raise RuntimeError("release() without a slot from wait()")
            self._free.append(self._held.popleft())
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
