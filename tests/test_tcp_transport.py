"""The TCP transport: slot FIFOs over sockets, both directions at once, and its failure modes."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np
import pytest

from ringcomm.store import HashStore, TCPStore
from ringcomm.transport.base import Aborted, LinkContext, PeerGone, PeerTimeout
from ringcomm.transport.tcp import TcpTransport, interface_address, local_address
from link_helpers import pattern, recv, run_threads, send, soon

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


@pytest.mark.timeout(20)
@pytest.mark.parametrize("slot_bytes, nslots, count", [(SLOT, 4, 48), (8 << 20, 2, 6)])
def test_both_directions_at_once_many_slices(transports, slot_bytes, nslots, count):
    # Each rank posts a slice, then waits for the peer's, as a ring step does. Many more
    # slices than slots; and 8 MiB slices, more than the kernel buffers of an unread
    # socket hold here, so a sendall() inside post() would deadlock the two ranks.
    store = HashStore(timeout=5)
    t0, t1 = (transports(r, store, slot_bytes=slot_bytes, nslots=nslots) for r in (0, 1))
    s01, s10 = t0.connect_send(1, soon()), t1.connect_send(0, soon())
    r01, r10 = t1.connect_recv(0, soon()), t0.connect_recv(1, soon())
    sizes = [slot_bytes, 0, 1, slot_bytes - 1, *[slot_bytes] * (count - 4)]

    def rank(me, out, inp):
        for i, n in enumerate(sizes):
            send(out, pattern(me, i, n), soon())
            got = inp.wait(soon())
            assert got.size == n and np.array_equal(got, pattern(1 - me, i, n)), f"slice {i}"
            inp.release()

    run_threads(lambda: rank(0, s01, r10), lambda: rank(1, s10, r01))


@pytest.mark.timeout(20)
def test_sender_runs_ahead_then_receiver_drains(links):
    # A sender may post nslots slices with nobody reading; then it has to wait for a free slot.
    _, _, s01, r01, _, _ = links
    for i in range(4 + 4):  # the sender's slots, then the receiver's slots ahead of wait()
        send(s01, pattern(0, i, SLOT), soon())
    for i in range(8):
        np.testing.assert_array_equal(recv(r01, soon()), pattern(0, i, SLOT))


@pytest.mark.timeout(10)
def test_api_misuse_is_explained_and_several_slots_are_held_in_order(links):
    _, _, s01, r01, _, _ = links
    with pytest.raises(RuntimeError, match="without a slot"):
        s01.post(1)
    a, b = s01.acquire(soon()), s01.acquire(soon())  # two held at once (the device proxy does this)
    assert a.ctypes.data != b.ctypes.data
    a[:3], b[:3] = 1, 2
    with pytest.raises(ValueError, match="0..65536"):
        s01.post(SLOT + 1)
    s01.post(3)  # the oldest held slot goes first
    s01.post(3)
    first, second = r01.wait(soon()), r01.wait(soon())
    assert list(first) == [1, 1, 1] and list(second) == [2, 2, 2]
    r01.release()
    r01.release()
    with pytest.raises(RuntimeError, match="without a slot"):
        r01.release()


@pytest.mark.timeout(10)
def test_deadlines_give_peer_timeout(links, transports):
    t0, t1, s01, r01, _, _ = links
    with pytest.raises(PeerTimeout, match="rank 1 .*timed out waiting for data from rank 0 over tcp") as e:
        r01.wait(time.monotonic() - 1)
    assert (e.value.peer, e.value.transport) == (0, "tcp")
    with pytest.raises(PeerTimeout, match="a free slot to send to rank 1"):
        for _ in range(10_000):  # fill both ends' slots and the kernel buffers; nobody reads
            send(s01, pattern(0, 0, SLOT), soon(0.2))
    t1.close()  # so that rank 0's close does not linger over the unread slices
    with pytest.raises(PeerTimeout, match="rank 1 to connect"):
        t0.connect_recv(1, soon(0.1))  # rank 1 connected to rank 0 only once
    lonely = transports(0, HashStore(), world_size=3)
    with pytest.raises(PeerTimeout, match="rank 2 to publish"):
        lonely.connect_send(2, soon(0.1))


@pytest.mark.timeout(10)
def test_abort_wakes_a_wait(transports):
    abort = threading.Event()
    store = HashStore(timeout=5)
    t0, t1 = transports(0, store, abort=abort), transports(1, store, abort=abort)
    t0.connect_send(1, soon())
    r01 = t1.connect_recv(0, soon())
    caught = []
    waiter = threading.Thread(target=lambda: caught.append(pytest.raises(Aborted, r01.wait, soon(30))))
    waiter.start()
    abort.set()
    waiter.join(5)
    assert len(caught) == 1 and "abort" in str(caught[0].value)


@pytest.mark.timeout(15)
def test_peer_closing_gives_peer_gone_after_its_data(links):
    _, t1, s01, _, s10, r10 = links
    for i in range(3):
        send(s10, pattern(1, i, 1000), soon())
    t1.close()  # lingers until those three slices are on the wire
    t1.close()
    for i in range(3):
        np.testing.assert_array_equal(recv(r10, soon()), pattern(1, i, 1000))
    with pytest.raises(PeerGone, match=r"rank 1 closed the connection \(EOF\) to rank 0 over tcp") as e:
        r10.wait(soon())
    assert e.value.peer == 1
    with pytest.raises(PeerGone, match="could not send to rank 1"):
        for _ in range(10_000):  # the first sends may land in kernel buffers before the reset
            send(s01, pattern(0, 0, SLOT), soon())
    with pytest.raises(Aborted, match="closed by this process"):
        s10.acquire(soon())


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
                raw.shutdown(socket.SHUT_WR)
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
def test_close_is_idempotent_and_releases_fds(transports):
    fds = len(os.listdir("/proc/self/fd"))
    store = HashStore(timeout=5)
    t0, t1 = make(0, store), make(1, store)
    try:
        s01, r01 = t0.connect_send(1, soon()), t1.connect_recv(0, soon())
        send(s01, pattern(0, 0, 100), soon())
        recv(r01, soon())
    finally:
        t0.close()
        t1.close()
    t0.close()
    with pytest.raises(Aborted, match="closed"):
        t0.connect_send(1, soon())
    assert len(os.listdir("/proc/self/fd")) == fds


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
