"""The rendezvous store: HashStore and TCPStore behave alike; the TCP server survives bad clients."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from harness import open_fds
from ringcomm import store_wire as wire
from ringcomm.errors import StoreError, StoreTimeout
from ringcomm.store import HashStore, TCPStore

TOKEN = "s3cret"


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("ringcomm-")]
    for t in leaked:  # a handler may still be between closing its socket and returning
        t.join(2)
    assert not [t.name for t in leaked if t.is_alive()]


@pytest.fixture
def server():
    s = TCPStore("127.0.0.1", 0, is_server=True, token=TOKEN, timeout=5)
    yield s
    s.close()


def client(port, token=TOKEN, timeout=5.0):
    return TCPStore("127.0.0.1", port, is_server=False, token=token, timeout=timeout)


@pytest.fixture(params=["hash", "tcp"])
def stores(request):
    """Two handles on one store: a writer and a reader."""
    if request.param == "hash":
        s = HashStore(timeout=5)
        yield s, s
        s.close()
        return
    srv = TCPStore("127.0.0.1", 0, is_server=True, token=TOKEN, timeout=5)
    other = client(srv.port)
    yield srv, other
    other.close()
    srv.close()


def raw_connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_until_eof(s: socket.socket) -> bytes:
    """What the server sends before closing the connection (socket timeout 5 s fails the test).

    A server that closes with our bytes still unread makes the kernel send RST: closed too.
    """
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out


@pytest.mark.timeout(10)
def test_set_get_add_delete(stores):
    a, b = stores
    a.set("k", "text")
    a.set("raw", b"\x00\xff")
    assert b.get("k") == b"text" and b.get("raw") == b"\x00\xff"
    assert b.add("n", 5) == 5 and a.add("n", -2) == 3
    assert a.get("n") == b"3"
    assert b.delete("k") is True and b.delete("k") is False
    with pytest.raises(StoreTimeout):
        a.get("k", timeout=0.05)
    b.wait([], timeout=0)
    b.wait(["n", "raw"], timeout=1)


@pytest.mark.timeout(10)
def test_get_blocks_until_another_client_sets(stores):
    a, b = stores
    got = []
    t = threading.Thread(target=lambda: got.append(b.get("late", timeout=5)))
    w = threading.Thread(target=lambda: got.append(b.wait(["late", "later"], timeout=5)))
    # The TCP client serialises requests: a second thread's request queues behind the first.
    t.start()
    w.start()
    a.set("late", b"v")
    a.set("later", b"w")
    t.join(6)
    w.join(6)
    assert sorted(got, key=repr) == sorted([b"v", None], key=repr)


@pytest.mark.timeout(10)
def test_timeouts_name_the_keys_and_the_time(stores):
    a, b = stores
    a.set("here", b"1")
    with pytest.raises(StoreTimeout, match=r"get .*0\.2 s.*'missing'") as e:
        b.get("missing", timeout=0.2)
    assert isinstance(e.value, TimeoutError)
    with pytest.raises(StoreTimeout, match=r"wait .*'gone'") as e:
        b.wait(["here", "gone"], timeout=0.1)
    assert "here" not in str(e.value)
    assert b.get("here") == b"1"  # the connection is still good after a timeout


@pytest.mark.timeout(10)
def test_bad_arguments(stores):
    a, _ = stores
    a.set("word", "abc")
    with pytest.raises(StoreError, match="not an integer"):
        a.add("word", 1)
    with pytest.raises(TypeError):
        a.wait("word")
    with pytest.raises(TypeError):
        a.set(3, b"x")
    with pytest.raises(TypeError):
        a.set("k", 3)


@pytest.mark.timeout(10)
def test_concurrent_adds_are_atomic(server):
    clients = [client(server.port) for _ in range(3)]
    try:
        workers = [threading.Thread(target=lambda c=c: [c.add("ctr", 1) for _ in range(100)])
                   for c in clients + clients]  # two threads share each client
        for w in workers:
            w.start()
        for w in workers:
            w.join(8)
        assert server.add("ctr", 0) == 600
    finally:
        for c in clients:
            c.close()


@pytest.mark.timeout(10)
def test_large_values(server):
    value = os.urandom(3 << 20)
    server.set("big", value)
    assert server.get("big") == value
    with pytest.raises(ValueError, match="limit"):
        server.set("huge", bytes(wire.MAX_PAYLOAD + 1))
    assert server.get("big") == value  # nothing half-sent


@pytest.mark.timeout(10)
def test_wrong_token_is_refused_and_others_continue(server, caplog):
    good = client(server.port)
    try:
        with caplog.at_level(logging.WARNING, logger="ringcomm.store"):
            refused = r"127\.0\.0\.1:\d+ refused this process: wrong RINGCOMM_TOKEN"
            with pytest.raises(StoreError, match=refused):
                client(server.port, token="guess")
        assert "wrong RINGCOMM_TOKEN" in caplog.text
        good.set("still", b"works")
        with client(server.port) as late:
            assert late.get("still") == b"works"
    finally:
        good.close()


HELLO = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Msg.HELLO, len(TOKEN)) + TOKEN.encode()
OK_REPLY = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Msg.OK, 0)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("payload, reply", [
    (b"GET / HTTP/1.0\r\n\r\n", b""),
    (wire.HEADER.pack(b"RCST", 9, 1, 0), b""),  # bad version
    (wire.HEADER.pack(b"RCST", 1, 99, 0), b""),  # unknown type
    (wire.HEADER.pack(b"RCST", 1, 1, wire.MAX_PAYLOAD + 1), b""),  # oversized
    (wire.HEADER.pack(b"RCST", 1, 1, 100) + b"x" * 10, b""),  # truncated, then EOF
    (wire.HEADER.pack(b"RCST", 1, wire.Msg.SET, 0), b""),  # a request before HELLO
    (HELLO + wire.HEADER.pack(b"RCST", 1, wire.Msg.GET, 3) + b"abc", OK_REPLY),  # bad fields
])
def test_malformed_frames_close_only_that_connection(server, payload, reply):
    idle = raw_connect(server.port)  # a silent connection must not hold anyone up either
    bad = raw_connect(server.port)
    try:
        bad.sendall(payload)
        try:
            bad.shutdown(socket.SHUT_WR)  # the truncated frame's EOF
        except OSError:
            pass  # the server already reset the connection: that is the point
        assert read_until_eof(bad) == reply
        with client(server.port) as c:
            c.set("alive", b"yes")
            assert server.get("alive") == b"yes"
    finally:
        bad.close()
        idle.close()


@pytest.mark.timeout(10)
def test_client_started_before_server_connects_when_it_comes_up(monkeypatch):
    with socket.socket() as probe:  # a port that is free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    refused = threading.Event()
    real = wire.connect_once

    def spy(*args, **kw):
        try:
            return real(*args, **kw)
        except OSError:
            refused.set()
            raise

    monkeypatch.setattr(wire, "connect_once", spy)
    result = {}

    def early():
        try:
            with client(port, timeout=8) as c:
                result["value"] = c.get("hello", timeout=5)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=early)
    t.start()
    assert refused.wait(5), "the early client never tried to connect"
    with TCPStore("127.0.0.1", port, is_server=True, token=TOKEN, timeout=5) as srv:
        srv.set("hello", b"world")
        t.join(8)
    assert result == {"value": b"world"}


@pytest.mark.timeout(10)
def test_unreachable_store_times_out_clearly():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        start = time.monotonic()
        unreachable = rf"could not reach the store at 127\.0\.0\.1:{port} within 0\.3 s"
        with pytest.raises(StoreTimeout, match=unreachable):
            client(port, timeout=0.3)
    assert time.monotonic() - start < 3


@pytest.mark.timeout(10)
def test_close_wakes_waiters_and_releases_everything():
    fds = open_fds()
    srv = TCPStore("127.0.0.1", 0, is_server=True, token=TOKEN, timeout=5)
    c = client(srv.port)
    errors = []

    def blocked():
        try:
            c.get("never", timeout=30)
        except StoreError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    srv.close()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
    c.close()
    c.close()
    srv.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        c.get("x")
    assert open_fds() - fds == set(), "the store left file descriptors open"



@pytest.mark.timeout(5)
def test_hash_store_close_wakes_waiters():
    s = HashStore()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(StoreError, s.get, "k", 10)))
    t.start()
    s.close()
    t.join(4)
    assert len(errors) == 1


@pytest.mark.timeout(5)
def test_server_port_in_use_is_a_store_error(server):
    with pytest.raises(StoreError, match=rf"could not start the store server on 127\.0\.0\.1:{server.port}"):
        TCPStore("127.0.0.1", server.port, is_server=True, token=TOKEN, timeout=1)


def test_arrive_marks_the_last_arrival_and_the_host_waits_for_it():
    s = HashStore(timeout=5)
    with pytest.raises(StoreTimeout):
        s.arrive("closed", 2, wait=0.05)       # the host alone: the other has not come
    s.arrive("closed", 2)                      # the other comes, and does not wait
    s.wait(["closed/all"], timeout=0.05)       # the second arrival of two set it


def _until_stopped(pid: int, within: float = 10.0) -> None:
    """Return once every thread of process ``pid`` is stopped (state T in /proc): a thread still
    running just after SIGSTOP can answer one more request (a CI run on 2 busy cores saw it)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in "Tt" for s in states):
            return
        time.sleep(1e-3)            # polling an observable state, with a deadline
    raise AssertionError(f"process {pid} did not stop within {within} s of SIGSTOP: {states}")


@pytest.mark.timeout(30)
def test_set_add_delete_take_a_timeout_of_their_own():
    """A store that stops answering (its process stopped): set, add and delete end at their own
    timeout with a StoreTimeout, not at the store's (60 s here)."""
    import signal
    import subprocess
    import sys
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    serve = (f"import time; from ringcomm.store import TCPStore; "
             f"s = TCPStore('127.0.0.1', {port}, is_server=True, token='{TOKEN}', timeout=60); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", serve])
    clients = []
    try:
        clients = [client(port, timeout=60) for _ in range(3)]
        clients[0].set("k", b"1", timeout=5)
        os.kill(proc.pid, signal.SIGSTOP)
        _until_stopped(proc.pid)        # kill() returns before every thread of it has stopped
        calls = [lambda c: c.set("k", b"2", timeout=0.3), lambda c: c.add("n", 1, timeout=0.3),
                 lambda c: c.delete("k", timeout=0.3)]
        for c, call in zip(clients, calls):
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout, match=r"did not answer within 0\.3 s"):
                call(c)
            assert time.monotonic() - t0 < 3
    finally:
        for c in clients:
            c.close()
        proc.kill()
        proc.wait()
