"""The TCPStore wire protocol and its server.

Every frame is ``HEADER`` (magic, version, type, payload length) followed by
the payload. A payload is a list of fields, each prefixed by its u32 length,
so keys and values may hold any bytes. The first frame of a connection is
HELLO carrying the token; anything unexpected closes that one connection and
nothing else, so a stray port scanner or a misconfigured job cannot take the
rendezvous of a healthy job down.
"""
from __future__ import annotations

import enum
import hmac
import logging
import socket
import struct
import threading

from .errors import StoreError, StoreTimeout

log = logging.getLogger("ringcomm.store")

MAGIC = b"RCST"
VERSION = 1
HEADER = struct.Struct("!4sBBI")
FIELD = struct.Struct("!I")
F64 = struct.Struct("!d")
I64 = struct.Struct("!q")
MAX_PAYLOAD = 64 << 20


class Msg(enum.IntEnum):
    HELLO = 1
    SET = 2
    GET = 3
    WAIT = 4
    ADD = 5
    DELETE = 6
    OK = 16
    VALUE = 17
    TIMEOUT = 18
    ERROR = 19


class ProtocolError(Exception):
    """The other end sent bytes that are not a valid frame."""


def send_frame(sock: socket.socket, mtype: Msg, payload: bytes = b"") -> None:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"store frame of {len(payload)} bytes exceeds the {MAX_PAYLOAD} byte limit")
    sock.sendall(HEADER.pack(MAGIC, VERSION, mtype, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int, first: bool) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if first and got == 0:
                raise EOFError("connection closed")
            raise ProtocolError(f"truncated frame: got {got} of {n} bytes before EOF")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[Msg, bytes]:
    """Read one frame. EOFError on a clean close between frames, ProtocolError on garbage."""
    magic, version, mtype, length = HEADER.unpack(_recv_exact(sock, HEADER.size, first=True))
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad magic/version {magic!r}/{version}")
    if mtype not in Msg._value2member_map_:
        raise ProtocolError(f"unknown frame type {mtype}")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame length {length} exceeds {MAX_PAYLOAD}")
    return Msg(mtype), _recv_exact(sock, length, first=False)


def pack_fields(*fields: bytes) -> bytes:
    return b"".join(FIELD.pack(len(f)) + f for f in fields)


def unpack_fields(payload: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(payload):
        if pos + FIELD.size > len(payload):
            raise ProtocolError("truncated field length")
        (n,) = FIELD.unpack_from(payload, pos)
        pos += FIELD.size
        if pos + n > len(payload):
            raise ProtocolError("field runs past the end of the frame")
        out.append(payload[pos:pos + n])
        pos += n
    return out


def connect_once(host: str, port: int, timeout: float) -> socket.socket:
    """One connection attempt (a seam for tests that need to see a refused attempt)."""
    return socket.create_connection((host, port), timeout=timeout)


class StoreServer:
    """Accepts clients on a daemon thread; one thread per client serves its requests.

    ``data`` is a HashStore: blocking GET/WAIT park the client's thread on the
    store's condition, so a waiting client costs no network traffic at all.
    """

    def __init__(self, host: str, port: int, token: str, data):
        self.data = data
        self._token = token.encode()
        self._lsock = socket.create_server((host, port), backlog=128)
        self.port = self._lsock.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"ringcomm-store-accept-{self.port}")
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._lsock.accept()
            except OSError:
                return  # close() shut the listening socket down
            t = threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                                 name=f"ringcomm-store-client-{addr[1]}")
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns[sock] = t
                t.start()  # under the lock, so close() never joins an unstarted thread

    def _serve(self, sock: socket.socket, addr) -> None:
        try:
            if self._hello(sock, addr):
                while True:
                    mtype, payload = recv_frame(sock)
                    send_frame(sock, *self._dispatch(mtype, payload))
        except EOFError:
            pass
        except ProtocolError as e:
            log.warning("store: dropping client %s:%s: %s", addr[0], addr[1], e)
        except OSError:
            pass  # reset by the client, or close() shut this socket down
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _hello(self, sock: socket.socket, addr) -> bool:
        mtype, payload = recv_frame(sock)
        if mtype != Msg.HELLO:
            raise ProtocolError(f"expected HELLO, got {mtype.name}")
        if not hmac.compare_digest(payload, self._token):
            log.warning("store: refused client %s:%s: wrong RINGCOMM_TOKEN", addr[0], addr[1])
            send_frame(sock, Msg.ERROR, b"wrong token")
            return False
        send_frame(sock, Msg.OK)
        return True

    def _dispatch(self, mtype: Msg, payload: bytes) -> tuple[Msg, bytes]:
        f = unpack_fields(payload)
        try:
            if mtype == Msg.SET and len(f) == 2:
                self.data.set(f[0].decode(), f[1])
                return Msg.OK, b""
            if mtype == Msg.GET and len(f) == 2:
                return Msg.VALUE, self.data.get(f[0].decode(), timeout=F64.unpack(f[1])[0])
            if mtype == Msg.WAIT and len(f) >= 1:
                self.data.wait([k.decode() for k in f[1:]], timeout=F64.unpack(f[0])[0])
                return Msg.OK, b""
            if mtype == Msg.ADD and len(f) == 2:
                return Msg.VALUE, I64.pack(self.data.add(f[0].decode(), I64.unpack(f[1])[0]))
            if mtype == Msg.DELETE and len(f) == 1:
                return Msg.VALUE, b"\x01" if self.data.delete(f[0].decode()) else b"\x00"
        except StoreTimeout as e:
            return Msg.TIMEOUT, str(e).encode()
        except (StoreError, ValueError, struct.error) as e:
            return Msg.ERROR, str(e).encode()
        raise ProtocolError(f"malformed {mtype.name} request ({len(f)} fields)")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        for s in [self._lsock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes accept()/recv() blocked in our threads
            except OSError:
                pass
        self._lsock.close()
        self.data.close()  # wakes handlers parked in GET/WAIT
        self._acceptor.join(5)
        for t in conns.values():
            t.join(5)
