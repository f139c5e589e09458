"""What only the TCP transport has: connecting through the peer's published address, the hello and
its token, interface selection, two real processes. The contract every transport shares (both
directions at once, running ahead, misuse, deadlines, abort, close, a killed peer) is
tests/test_conformance.py's."""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import threading
import time

import numpy as np
import pytest

from ringcomm.errors import StoreError
from ringcomm.store import HashStore, TCPStore
from ringcomm.transport.base import LinkContext, PeerGone, PeerTimeout
from ringcomm.transport.tcp import TcpTransport, interface_address, local_address
from link_helpers import pattern, recv, send, soon

SLOT = 64 * 1024


def make(rank, store, *, token="tok", prefix="t", world_size=2, **kw) -> TcpTransport:
    ctx = LinkContext(rank=rank, world_size=world_size, store=store, prefix=prefix, token=token,
                      nslots=kw.pop("nslots", 4), slot_bytes=kw.pop("slot_bytes", SLOT), **kw)
    return TcpTransport(ctx)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("ringcomm-")]
    for t in leaked:
        t.join(2)
    assert not [t.name for t in leaked if t.is_alive()]


@pytest.fixture
def transports(request):
    """Ranks 0 and 1 in this process; every transport made is closed at the end."""
    made = []

    def factory(rank, store, **kw):
        t = make(rank, store, **kw)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()


@pytest.fixture
def links(transports):
    """(t0, t1, s01, r01, s10, r10): sXY sends from rank X to rank Y, rXY receives it at Y."""
    store = HashStore(timeout=5)
    t0, t1 = transports(0, store), transports(1, store)
    s01, s10 = t0.connect_send(1, soon()), t1.connect_send(0, soon())
    r01, r10 = t1.connect_recv(0, soon()), t0.connect_recv(1, soon())
    return t0, t1, s01, r01, s10, r10


@pytest.mark.timeout(10)
def test_connecting_waits_for_the_peer_with_a_deadline(links, transports):
    # tcp's connect_send needs the peer's published address; connect_recv waits for its connection.
    t0, t1, _, _, _, _ = links
    t1.close()
    with pytest.raises(PeerTimeout, match="rank 1 to connect"):
        t0.connect_recv(1, soon(0.1))  # rank 1 connected to rank 0 only once
    lonely = transports(0, HashStore(), world_size=3)
    with pytest.raises(PeerTimeout, match="rank 2 to publish"):
        lonely.connect_send(2, soon(0.1))


@pytest.mark.timeout(10)
def test_a_receiver_stops_waiting_for_a_sender_that_died_or_lost_the_store(transports, monkeypatch):
    """connect_recv waited the whole deadline for a sender that could never come: one that died, or one
    that can no longer read this rank's address because the store's host died (a two-host shrink test
    then met with one rank still waiting)."""
    store, dead = HashStore(timeout=5), {}
    t0 = transports(0, store, peer_gone=lambda p: dead.get(p, ""))
    dead[1] = "(pid 123) died"
    t = time.monotonic()
    with pytest.raises(PeerGone, match=r"rank 1 \(pid 123\) died before it connected over tcp"):
        t0.connect_recv(1, soon(10))
    assert time.monotonic() - t < 2
    dead.clear()

    def lost(*args, **kw):
        raise StoreError("lost the store at 10.0.0.1:29500: EOFError()")
    monkeypatch.setattr(store, "get", lost)
    t = time.monotonic()
    with pytest.raises(StoreError, match="lost the store"):
        t0.connect_recv(1, soon(10))
    assert time.monotonic() - t < 3   # two patrols: a sender that read the address first may still dial


@pytest.mark.timeout(10)
def test_a_sender_stops_dialling_a_peer_that_died(transports):
    store = HashStore(timeout=5)
    transports(1, store).close()      # its address is published; its listener refuses now
    t0 = transports(0, store, peer_gone=lambda p: "(pid 5) died")
    t = time.monotonic()
    with pytest.raises(PeerGone, match=r"rank 1 \(pid 5\) died: its tcp listener at .* refused"):
        t0.connect_send(1, soon(10))
    assert time.monotonic() - t < 2
    alive = transports(0, store, peer_gone=lambda p: "", prefix="t")  # not known dead: retried until the deadline
    with pytest.raises(PeerTimeout, match="a connection to rank 1"):
        alive.connect_send(1, soon(0.8))


@pytest.mark.timeout(10)
def test_wrong_token_or_garbage_is_refused_and_good_peers_still_connect(transports, caplog):
    store = HashStore(timeout=5)
    t1 = transports(1, store, token="right")
    intruder = transports(0, store, token="wrong")
    with caplog.at_level(logging.WARNING, logger="ringcomm.transport.tcp"):
        with pytest.raises(PeerGone, match="refused the tcp connection from rank 0.*RINGCOMM_TOKEN"):
            intruder.connect_send(1, soon())
        host, port = t1.address.rsplit(":", 1)
        for junk in [b"GET / HTTP/1.1\r\n\r\n" * 4, b"RCTC", b""]:
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(junk)
                try:
                    raw.shutdown(socket.SHUT_WR)
                except OSError:  # ENOTCONN: the transport has already dropped the junk, as it should
                    pass
                try:
                    assert raw.recv(16) == b""  # closed, not acknowledged
                except ConnectionResetError:
                    pass
    assert "wrong RINGCOMM_TOKEN" in caplog.text and "not a ringcomm tcp hello" in caplog.text
    with pytest.raises(PeerTimeout):
        t1.connect_recv(0, soon(0.1))  # nothing from the intruder was queued
    friend = transports(0, store, token="right", prefix="t")
    s = friend.connect_send(1, soon())
    r = t1.connect_recv(0, soon())
    send(s, pattern(0, 5, 77), soon())
    np.testing.assert_array_equal(recv(r, soon()), pattern(0, 5, 77))


@pytest.mark.timeout(10)
def test_address_selection(monkeypatch):
    monkeypatch.setenv("RINGCOMM_SOCKET_IFNAME", "lo")
    assert local_address() == "127.0.0.1"
    with pytest.raises(OSError, match="no-such-if0.*no such interface"):
        interface_address("no-such-if0")
    monkeypatch.delenv("RINGCOMM_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert local_address() == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    assert local_address() == "127.0.0.1"


def _exchange(rank: int, port: int, nbytes: int) -> None:
    """One rank of the two-process test; reports through the store."""
    store = TCPStore("127.0.0.1", port, is_server=False, token="mp", timeout=20)
    t = make(rank, store, token="mp", prefix="mp", slot_bytes=32 * 1024)
    try:
        peer = 1 - rank
        out, inp = t.connect_send(peer, soon(20)), t.connect_recv(peer, soon(20))
        mine, theirs = pattern(rank, 0, nbytes), pattern(peer, 0, nbytes)
        got = np.empty(nbytes, np.uint8)
        for lo in range(0, nbytes, out.slot_bytes):
            send(out, mine[lo:lo + out.slot_bytes], soon(20))
            piece = inp.wait(soon(20))
            got[lo:lo + piece.size] = piece
            inp.release()
        store.set(f"result/{rank}", "ok" if np.array_equal(got, theirs) else "corrupt data")
    except Exception as e:  # noqa: BLE001 - the parent reads it from the store
        store.set(f"result/{rank}", repr(e))
    finally:
        t.close()
        store.close()


@pytest.mark.timeout(30)
def test_two_processes_exchange_over_tcp():
    spawn = mp.get_context("spawn")
    with TCPStore("127.0.0.1", 0, is_server=True, token="mp", timeout=20) as store:
        procs = [spawn.Process(target=_exchange, args=(r, store.port, 1_000_003), daemon=True)
                 for r in (0, 1)]
        try:
            for p in procs:
                p.start()
            assert [store.get(f"result/{r}", timeout=25) for r in (0, 1)] == [b"ok", b"ok"]
            for p in procs:
                p.join(10)
            assert [p.exitcode for p in procs] == [0, 0]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
