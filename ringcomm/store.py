"""The rendezvous store: a small key/value service ranks use to find each other.

Modelled on gloo's ``rendezvous/store.h`` and torch's TCPStore. It is used only
while connecting (addresses, barriers), never on the data path.

* ``HashStore``: in memory, thread safe; for tests and a world of one.
* ``TCPStore``: rank 0 serves the data from a daemon thread (``is_server=True``);
  every instance, the server's own included, is a client over a socket.
  The wire protocol lives in ``store_wire``.
"""
from __future__ import annotations

import socket
import threading
import time

from . import store_wire as wire
from .errors import StoreError, StoreTimeout
from .store_wire import F64, I64, Msg


def _check_key(key) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"store keys are non-empty str, got {key!r}")
    return key


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values are bytes or str, got {type(value).__name__}")


def _timeout_message(op: str, missing: list[str], timeout: float) -> str:
    what = f"key {missing[0]!r}" if len(missing) == 1 else f"keys {missing!r}"
    return f"store {op} timed out after {timeout:g} s waiting for {what}"


class Store:
    """set / get / wait / add / delete. Public methods check; ``_hooks`` do the work."""

    timeout: float = 300.0  # seconds, used when a call passes timeout=None

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """``timeout`` (here and for add and delete): how long the store may take to answer."""
        self._set(_check_key(key), _as_bytes(value), self._timeout(timeout))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Block until ``key`` exists; StoreTimeout names the key and the timeout."""
        return self._get(_check_key(key), self._timeout(timeout))

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        if isinstance(keys, str):
            raise TypeError(f"wait() takes a list of keys, got the single key {keys!r}")
        self._wait([_check_key(k) for k in keys], self._timeout(timeout))

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Atomically add to the integer at ``key`` (created at 0); return the new value."""
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"add() takes an int amount, got {amount!r}")
        return self._add(_check_key(key), amount, self._timeout(timeout))

    def delete(self, key: str, timeout: float | None = None) -> bool:
        """Remove ``key``; return whether it existed."""
        return self._delete(_check_key(key), self._timeout(timeout))

    def has_queues(self) -> bool:
        """Whether queue_push / queue_pop work here: only over torch's c10d stores that keep queues
        (torch_support.TorchStore)."""
        return False

    def arrive(self, key: str, n: int, wait: float | None = None) -> None:
        """Count this process at ``key``; the n-th arrival sets ``key/all``. With ``wait``, then wait
        up to that many seconds for all n: what the process hosting the store does, to keep it up
        until the others no longer need it (StoreTimeout if they do not all come)."""
        if self.add(key, 1) == n:
            self.set(f"{key}/all", b"1")
        if wait is not None:
            self.wait([f"{key}/all"], timeout=wait)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if t < 0:
            raise ValueError(f"timeout must be >= 0, got {t}")
        return t

    # The hooks of set, add and delete get the time the store may take to answer; a store that
    # answers at once (in memory) or bounds it itself (torch's) ignores it.
    def _set(self, key: str, value: bytes, timeout: float) -> None:
        raise NotImplementedError

    def _get(self, key: str, timeout: float) -> bytes:
        raise NotImplementedError

    def _wait(self, keys: list[str], timeout: float) -> None:
        raise NotImplementedError

    def _add(self, key: str, amount: int, timeout: float) -> int:
        raise NotImplementedError

    def _delete(self, key: str, timeout: float) -> bool:
        raise NotImplementedError


class HashStore(Store):
    """In-memory store. Also the TCPStore server's data, so both behave alike."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = float(timeout)
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    def _await(self, keys: list[str], timeout: float, op: str) -> None:
        """Caller holds the condition. Returns once every key exists."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(_timeout_message(op, missing, timeout))
            self._cv.wait(left)

    def _set(self, key, value, timeout):
        with self._cv:
            self._check_open()
            self._data[key] = value
            self._cv.notify_all()

    def _get(self, key, timeout):
        with self._cv:
            self._await([key], timeout, "get")
            return self._data[key]

    def _wait(self, keys, timeout):
        with self._cv:
            self._await(keys, timeout, "wait")

    def _add(self, key, amount, timeout):
        with self._cv:
            self._check_open()
            old = self._data.get(key, b"0")
            try:
                value = int(old) + amount
            except ValueError:
                raise StoreError(f"store add: key {key!r} holds {old[:40]!r}, not an integer") from None
            self._data[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def _delete(self, key, timeout):
        with self._cv:
            return self._data.pop(key, None) is not None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class TCPStore(Store):
    """A client of the store server at host:port, and that server too when ``is_server``."""

    def __init__(self, host: str, port: int, *, is_server: bool, token: str = "",
                 timeout: float = 300.0):
        self.host = host
        self.timeout = float(timeout)
        self._token = token.encode()
        self._lock = threading.Lock()  # one request/reply in flight per client
        self._sock: socket.socket | None = None
        self._server = None
        if is_server:
            try:
                self._server = wire.StoreServer(host, port, token, HashStore(timeout))
            except OSError as e:
                raise StoreError(f"could not start the store server on {host}:{port}: {e}") from e
        self.port = self._server.port if self._server else int(port)
        # "" and 0.0.0.0 mean "listen everywhere"; a client must name an address.
        self._dial = "127.0.0.1" if host in ("", "0.0.0.0") else host
        try:
            self._sock = self._connect(time.monotonic() + self.timeout)
        except BaseException:
            self.close()
            raise

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, deadline: float) -> socket.socket:
        # Rank 0 may start after the others: retry refused connections until the deadline.
        pause, last = 0.01, None
        while (left := deadline - time.monotonic()) > 0:
            try:
                sock = wire.connect_once(self._dial, self.port, left)
            except OSError as e:
                last = e
                time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
                pause = min(pause * 2, 0.5)
                continue
            return self._hello(sock, deadline)
        raise StoreTimeout(f"could not reach the store at {self.where} within "
                           f"{self.timeout:g} s (last error: {last})")

    def _hello(self, sock: socket.socket, deadline: float) -> socket.socket:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            wire.send_frame(sock, Msg.HELLO, self._token)
            mtype, _ = wire.recv_frame(sock)
        except TimeoutError:
            sock.close()
            raise StoreTimeout(f"could not reach the store at {self.where} within "
                               f"{self.timeout:g} s (no answer to the handshake)") from None
        except (OSError, EOFError, wire.ProtocolError) as e:
            sock.close()
            raise StoreError(f"store at {self.where} dropped the connection during the handshake "
                             f"({e!r}); is something else listening on that port?") from e
        if mtype != Msg.OK:
            sock.close()
            raise StoreError(f"store at {self.where} refused this process: wrong RINGCOMM_TOKEN")
        return sock

    def _request(self, mtype: Msg, fields: list[bytes], expect: Msg, wait_s: float = 0.0,
                 answer_s: float | None = None) -> bytes:
        """One request and its reply. The server answers a blocked GET/WAIT by ``wait_s``; then it
        has ``answer_s`` more (default: the store's timeout)."""
        payload = wire.pack_fields(*fields)
        slack = self.timeout if answer_s is None else answer_s
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreError(f"this client of the store at {self.where} is closed")
            try:
                sock.settimeout(wait_s + slack)
                wire.send_frame(sock, mtype, payload)
                rtype, reply = wire.recv_frame(sock)
            except (OSError, EOFError, wire.ProtocolError) as e:
                # Request and reply are out of step now: no later call could trust this socket.
                self._sock = None
                sock.close()
                if isinstance(e, TimeoutError):
                    raise StoreTimeout(f"store at {self.where} did not answer within "
                                       f"{wait_s + slack:g} s") from None
                raise StoreError(f"lost the store at {self.where}: {e!r}") from e
        if rtype == expect:
            return reply
        text = reply.decode(errors="replace")
        if rtype == Msg.TIMEOUT:
            raise StoreTimeout(f"{text} (store at {self.where})")
        raise StoreError(f"store at {self.where}: {text}")

    def _set(self, key, value, timeout):
        self._request(Msg.SET, [key.encode(), value], Msg.OK, answer_s=timeout)

    def _get(self, key, timeout):
        return self._request(Msg.GET, [key.encode(), F64.pack(timeout)], Msg.VALUE, timeout)

    def _wait(self, keys, timeout):
        self._request(Msg.WAIT, [F64.pack(timeout), *(k.encode() for k in keys)], Msg.OK, timeout)

    def _add(self, key, amount, timeout):
        return I64.unpack(self._request(Msg.ADD, [key.encode(), I64.pack(amount)], Msg.VALUE, answer_s=timeout))[0]

    def _delete(self, key, timeout):
        return self._request(Msg.DELETE, [key.encode()], Msg.VALUE, answer_s=timeout) == b"\x01"

    def close(self) -> None:
        """Close this client, and stop the server if this instance runs it. Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a request blocked in another thread
            except OSError:
                pass
            sock.close()
        server, self._server = self._server, None
        if server is not None:
            server.close()
