"""One contract, every transport: the same tests over shm, tcp, ibverbs and cuda_ipc.

A transport is a FIFO of slots per direction (transport/base.py). Whatever carries the bytes, it
must move slices both ways at once, let a sender run ahead by its slots and then wait, explain
misuse (tcp and ibverbs let a caller hold several slots, handed back in order), meet deadlines
with PeerTimeout, hear abort(), say through ready() / check() what comm.group() polls, report a
peer's close after its data, free what it holds on close, and see a killed peer as PeerGone long
before the deadline -- also while the dead peer is a zombie that its parent has not reaped.

Where a transport cannot run here the test is skipped with the reason: ibverbs needs pyverbs and an
active RDMA port (.ci/rdma runs these tests in a Soft-RoCE guest: ``-m rdma``), cuda_ipc runs under
numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), so it needs numba-cuda. Ranks 0 and 1 live in this
process (threads) except in the killed-peer test, where rank 1 is a real process.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ringcomm.store import HashStore, TCPStore
from ringcomm.transport.base import Aborted, LinkContext, PeerGone, PeerTimeout, pid_alive
from ringcomm.transport.shm import remove_stale
from harness import open_fds
from link_helpers import pattern, run_threads

KINDS = ("shm", "tcp", "ibverbs", "cuda_ipc")
SLOT = {"shm": 64 << 10, "tcp": 64 << 10, "ibverbs": 16 << 10, "cuda_ipc": 4 << 10}
# Big slices: for tcp more than the kernel buffers of an unread socket hold, so a sendall() inside
# post() would deadlock two ranks that both send first.
BIG = {"shm": 1 << 20, "tcp": 8 << 20, "ibverbs": 1 << 20, "cuda_ipc": 64 << 10}
PATIENCE = {"ibverbs": 10.0}  # emulated RDMA is slow: longer deadlines there
# A wait that must run out does run out: its whole deadline passes. Long enough for several of the
# ibverbs waiter's liveness probes (every 0.5 s), but not PATIENCE's 10x: the Soft-RoCE guest
# spent 12 s in each such wait.
EXPIRING = {"ibverbs": 2.5}


def unavailable(kind: str) -> str | None:
    if kind == "ibverbs":
        from ringcomm.transport import ibverbs
        why = ibverbs.unavailable()
        return f"no RDMA here: {why}" if why else None
    if kind == "cuda_ipc" and importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (the CUDA simulator comes with it): pip install 'numba-cuda[cu12]'"
    return None


@pytest.fixture(params=[pytest.param(k, marks=[pytest.mark.rdma] if k == "ibverbs" else []) for k in KINDS])
def kind(request, monkeypatch):
    why = unavailable(request.param)
    if why:
        pytest.skip(why)
    if request.param == "cuda_ipc":
        monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    monkeypatch.setenv("RINGCOMM_JOB_ID", f"conf{os.getpid()}")
    return request.param


def soon(kind: str, seconds: float = 5.0) -> float:
    return time.monotonic() + PATIENCE.get(kind, 1.0) * seconds


def expiring(kind: str, seconds: float) -> float:
    """The deadline of a wait that must time out."""
    return time.monotonic() + EXPIRING.get(kind, 1.0) * seconds


def make_transport(kind: str, ctx: LinkContext):
    if kind == "shm":
        from ringcomm.transport.shm import ShmTransport
        return ShmTransport(ctx)
    if kind == "tcp":
        from ringcomm.transport.tcp import TcpTransport
        return TcpTransport(ctx)
    if kind == "ibverbs":
        from ringcomm.transport.ibverbs import IbverbsTransport
        return IbverbsTransport(ctx)
    from ringcomm.transport.cuda_ipc import CudaIpcTransport
    return CudaIpcTransport(ctx)


@pytest.fixture
def transports(kind):
    """factory(rank, store, **ctx fields): a transport of this kind; all closed at the end."""
    made = []

    def factory(rank, store, *, world_size=2, nslots=4, slot_bytes=None, prefix="conf", **kw):
        ctx = LinkContext(rank=rank, world_size=world_size, store=store, prefix=prefix, token="t",
                          nslots=nslots, slot_bytes=slot_bytes or SLOT[kind], **kw)
        t = make_transport(kind, ctx)
        made.append(t)
        return t

    yield factory
    # Each rank closes its own transport, at once: cuda_ipc's close waits (a few seconds at most)
    # for the peer to let go of its slots, as separate processes would do together.
    closing = [threading.Thread(target=t.close) for t in made]
    for c in closing:
        c.start()
    for c in closing:
        c.join(30)


@pytest.fixture
def links(kind, transports):
    """(t0, t1, s01, r01, s10, r10): sXY sends from rank X to rank Y, rXY receives it at Y."""
    store = HashStore(timeout=10)
    t0, t1 = transports(0, store), transports(1, store)
    s01, s10 = t0.connect_send(1, soon(kind)), t1.connect_send(0, soon(kind))  # never waits for the peer
    r01, r10 = t1.connect_recv(0, soon(kind)), t0.connect_recv(1, soon(kind))
    return t0, t1, s01, r01, s10, r10


def received(conn, got) -> np.ndarray:
    """What wait() handed over, as a numpy copy. cuda_ipc's wait() returns the payload's size and
    its bytes are the device view typed() gives, as the executor's device path reads them."""
    if hasattr(conn, "typed"):
        return conn.typed(np.dtype(np.uint8), got.size).copy_to_host()
    return np.array(got)


def send(conn, data: np.ndarray, deadline: float) -> None:
    slot = conn.acquire(deadline)
    slot[:data.size] = data
    conn.post(data.size)


def recv(conn, deadline: float) -> np.ndarray:
    data = received(conn, conn.wait(deadline))
    conn.release()
    return data


# ---- the contract -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", ["small", "big"])
def test_both_directions_at_once_many_slices(kind, transports, size):
    # Each rank posts a slice, then waits for the peer's, as a ring step does: many more slices
    # than slots, so freed slots must flow back; sizes 0, 1, slot - 1 and full slots.
    slot_bytes, nslots, count = (SLOT[kind], 4, 40) if size == "small" else (BIG[kind], 2, 6)
    store = HashStore(timeout=10)
    t0, t1 = (transports(r, store, slot_bytes=slot_bytes, nslots=nslots) for r in (0, 1))
    s01, s10 = t0.connect_send(1, soon(kind)), t1.connect_send(0, soon(kind))
    r01, r10 = t1.connect_recv(0, soon(kind)), t0.connect_recv(1, soon(kind))
    sizes = [slot_bytes, 0, 1, slot_bytes - 1, *[slot_bytes] * (count - 4)]

    def rank(me, out, inp):
        for i, n in enumerate(sizes):
            send(out, pattern(me, i, n), soon(kind, 30))
            got = received(inp, inp.wait(soon(kind, 30)))
            assert got.size == n and np.array_equal(got, pattern(1 - me, i, n)), f"slice {i}"
            inp.release()

    run_threads(lambda: rank(0, s01, r10), lambda: rank(1, s10, r01), timeout=90.0)
    assert {c.transport for c in (s01, r01, s10, r10)} == {kind}


@pytest.mark.timeout(60)
def test_sender_runs_ahead_then_waits_for_a_free_slot(kind, links):
    _, _, s01, r01, _, _ = links
    posted = 0
    with pytest.raises(PeerTimeout, match="free slot") as e:
        for posted in range(10_000):  # nobody reads: the sender's slots (and any buffers on the way) fill
            send(s01, pattern(0, posted, SLOT[kind]), expiring(kind, 1.2))  # long enough for liveness probes
    assert posted >= 4 and (e.value.peer, e.value.transport) == (1, kind)
    for i in range(posted):  # everything posted arrives, in order, intact
        np.testing.assert_array_equal(recv(r01, soon(kind)), pattern(0, i, SLOT[kind]))
    send(s01, pattern(0, 7, 10), soon(kind))  # and the link still works
    np.testing.assert_array_equal(recv(r01, soon(kind)), pattern(0, 7, 10))


# tcp and ibverbs let a caller hold several slots at once, handed back oldest first (the device
# path's proxy thread does, transport/base.py); shm and cuda_ipc, which the executor and the native
# engine drive one slot at a time, refuse a second acquire() / wait() before post() / release().
SEVERAL_HELD = {"tcp", "ibverbs"}


@pytest.mark.timeout(60)
def test_api_misuse_is_explained_and_held_slots_go_in_order(kind, links):
    _, _, s01, r01, _, _ = links
    with pytest.raises(RuntimeError, match="without a slot"):
        s01.post(1)
    if kind in SEVERAL_HELD:
        a, b = s01.acquire(soon(kind)), s01.acquire(soon(kind))
        assert a.ctypes.data != b.ctypes.data
        a[:3], b[:3] = 1, 2
        with pytest.raises(ValueError, match=f"0..{SLOT[kind]}"):
            s01.post(SLOT[kind] + 1)
        s01.post(3)  # the oldest held slot goes first
        s01.post(3)
        first, second = r01.wait(soon(kind)), r01.wait(soon(kind))
        assert list(first) == [1, 1, 1] and list(second) == [2, 2, 2]
        r01.release()
    else:
        s01.acquire(soon(kind))
        with pytest.raises(RuntimeError, match="before post"):
            s01.acquire(soon(kind))
        with pytest.raises(ValueError, match=f"0..{SLOT[kind]}"):
            s01.post(SLOT[kind] + 1)
        s01.post(3)
        r01.wait(soon(kind))
        with pytest.raises(RuntimeError, match="before release"):
            r01.wait(soon(kind))
    r01.release()
    with pytest.raises(RuntimeError, match="without a slot"):
        r01.release()


@pytest.mark.timeout(60)
def test_deadlines_give_peer_timeout_naming_both_ends(kind, links, transports):
    _, _, _, r01, _, _ = links
    with pytest.raises(PeerTimeout, match=f"from rank 0 over {kind}") as e:
        r01.wait(expiring(kind, 1.2))  # past a liveness check: a live, silent peer is a timeout, not PeerGone
    assert (e.value.peer, e.value.transport) == (0, kind)
    lonely = transports(0, HashStore(), world_size=3, prefix="lonely")
    with pytest.raises(PeerTimeout, match="rank 2 to (publish|connect)") as e:
        lonely.connect_recv(2, expiring(kind, 0.2))  # rank 2 never shows up
    assert e.value.peer == 2


@pytest.mark.timeout(60)
def test_abort_wakes_a_wait(kind, transports):
    abort = threading.Event()
    store = HashStore(timeout=10)
    t0, t1 = transports(0, store, abort=abort), transports(1, store, abort=abort)
    t0.connect_send(1, soon(kind))
    r01 = t1.connect_recv(0, soon(kind))
    caught = []
    waiter = threading.Thread(target=lambda: caught.append(pytest.raises(Aborted, r01.wait, soon(kind, 60))))
    waiter.start()
    abort.set()
    waiter.join(10)
    assert len(caught) == 1 and "abort" in str(caught[0].value)


@pytest.mark.timeout(60)
def test_peer_closing_gives_peer_gone_after_its_data(kind, links):
    t0, t1, s01, r01, s10, r10 = links
    for i in range(3):
        send(s10, pattern(1, i, 1000), soon(kind))
    # Whatever rank 1 posted still arrives; then rank 0 learns of the close. Rank 1 closes in a
    # thread of its own, as a process would: cuda_ipc's close waits (up to 5 s) for the receiver's.
    closing = threading.Thread(target=t1.close)
    closing.start()
    for i in range(3):
        np.testing.assert_array_equal(recv(r10, soon(kind)), pattern(1, i, 1000))
    _close_seen_by_polling(r10, kind)  # as comm.group() sees it
    with pytest.raises(PeerGone, match="rank 1 closed") as e:
        r10.wait(soon(kind))
    assert (e.value.peer, e.value.transport) == (1, kind)
    with pytest.raises(PeerGone, match="rank 1"):
        for i in range(10_000):  # the first sends may fill free slots or kernel buffers
            send(s01, pattern(0, i, 10), soon(kind))
    t0.close()
    closing.join(30)
    t1.close()
    assert s10.ready() and r01.ready()  # closed here: acquire() / wait() raise at once
    with pytest.raises(Aborted, match="closed by this process"):
        s10.acquire(soon(kind))


def _close_seen_by_polling(conn, kind) -> None:
    """A caller that polls (comm.group()) learns of a closed peer: check() raises PeerGone, or
    ready() says True so that the wait raises at once."""
    deadline = soon(kind)
    while time.monotonic() < deadline:  # a condition polled with a deadline, no sleep
        try:
            conn.check()
        except PeerGone as e:
            assert (e.peer, e.transport) == (1, kind)
            return
        if conn.ready():
            return
    raise AssertionError(f"{kind}: neither check() nor ready() saw the peer's close")


@pytest.mark.timeout(60)
def test_ready_is_true_exactly_when_a_call_would_not_wait(kind, links):
    # comm.group() polls ready() and then calls acquire() / wait(), which must not block then.
    _, _, s01, r01, _, _ = links
    assert s01.ready() and not r01.ready()  # free slots, nothing posted
    s01.check()
    r01.check()  # a live peer: nothing to report
    posted, deadline = 0, soon(kind, 2)
    while s01.ready():  # run ahead until the sender's slots (and any buffers on the way) are full
        send(s01, pattern(0, posted, SLOT[kind]), time.monotonic())  # ready: no wait, past deadline or not
        posted += 1
        assert posted < 10_000 and time.monotonic() < deadline, "ready() stayed True on a full FIFO"
    for i in range(posted):
        until = soon(kind)
        while not r01.ready():  # posted slices arrive; polled with a deadline
            assert time.monotonic() < until, f"slice {i} was posted but ready() never said so"
        got = received(r01, r01.wait(time.monotonic()))
        np.testing.assert_array_equal(got, pattern(0, i, SLOT[kind]))
        r01.release()
    assert not r01.ready()
    until = soon(kind)
    while not s01.ready():  # the released slots flow back
        assert time.monotonic() < until, "the sender's slots never came back"
    send(s01, pattern(0, 99, 5), time.monotonic())
    np.testing.assert_array_equal(recv(r01, soon(kind)), pattern(0, 99, 5))


def _held() -> tuple[set[str], set[str], list[str]]:
    """(open fds, mapped /dev/shm files, this job's names in /dev/shm) of this process.

    Sets, not counts: an earlier test's garbage may be freed while this one runs, and only what this
    test opened and did not close is a leak."""
    fds = open_fds()
    with open("/proc/self/maps") as f:
        maps = {line.split()[-1] for line in f if "/dev/shm/rc-" in line}
    job = os.environ["RINGCOMM_JOB_ID"]
    return fds, maps, sorted(n for n in os.listdir("/dev/shm") if job in n)


@pytest.mark.timeout(60)
def test_close_is_idempotent_and_releases_what_it_holds(kind):
    store = HashStore(timeout=10)
    ctx = dict(world_size=2, store=store, prefix="fd", token="t", nslots=4, slot_bytes=SLOT[kind])
    before = _held()
    t0 = make_transport(kind, LinkContext(rank=0, **ctx))
    t1 = make_transport(kind, LinkContext(rank=1, **ctx))
    try:
        s01, r01 = t0.connect_send(1, soon(kind)), t1.connect_recv(0, soon(kind))
        send(s01, pattern(0, 0, 100), soon(kind))
        recv(r01, soon(kind))
    finally:
        closing = threading.Thread(target=t1.close)  # as two ranks would, at the same time
        closing.start()
        t0.close()
        closing.join(30)
    t0.close()
    with pytest.raises(Aborted, match="closed"):
        t0.connect_send(1, soon(kind))
    fds, maps, names = _held()
    assert fds - before[0] == set(), "file descriptors left open"
    assert maps - before[1] == set(), "shared memory left mapped"
    assert set(names) - set(before[2]) == set(), "segments left in /dev/shm"


# ---- a killed peer ------------------------------------------------------------------------------

PEER = """
import sys
import numpy as np
from ringcomm.store import TCPStore
from ringcomm.transport.base import LinkContext
sys.path.insert(0, {tests!r})
from test_conformance import make_transport, send, recv, soon
kind = {kind!r}
store = TCPStore("127.0.0.1", {port}, is_server=False, token="k", timeout=60)
t = make_transport(kind, LinkContext(rank=1, world_size=2, store=store, prefix="kill", token="k",
                                     nslots=4, slot_bytes={slot}))
out, inp = t.connect_send(0, soon(kind, 30)), t.connect_recv(0, soon(kind, 30))
send(out, np.arange(16, dtype=np.uint8), soon(kind, 30))
recv(inp, soon(kind, 30))
store.set("ready", b"1")
store.get("never", timeout=300)
"""


@pytest.mark.timeout(120)
def test_a_killed_peer_is_peer_gone_even_unreaped(kind, monkeypatch):
    # Rank 1 is a child process: connected, one slice each way, then SIGKILLed and left unreaped
    # (a zombie answers kill(pid, 0)). Rank 0's waits must report it within a few patrols.
    monkeypatch.setenv("RINGCOMM_IB_TIMEOUT", "14")  # ibverbs: a lost QP is seen after ~0.5 s of retries
    with TCPStore("127.0.0.1", 0, is_server=True, token="k", timeout=60) as store:
        t = make_transport(kind, LinkContext(rank=0, world_size=2, store=store, prefix="kill", token="k",
                                             nslots=4, slot_bytes=SLOT[kind]))
        code = PEER.format(tests=os.path.dirname(__file__), kind=kind, port=store.port, slot=SLOT[kind])
        child = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))
        try:
            out, inp = t.connect_send(1, soon(kind, 30)), t.connect_recv(1, soon(kind, 30))
            send(out, pattern(0, 0, 16), soon(kind, 30))
            np.testing.assert_array_equal(recv(inp, soon(kind, 30)), np.arange(16, dtype=np.uint8))
            store.get("ready", timeout=30)
            os.kill(child.pid, signal.SIGKILL)
            _wait_for_zombie(child.pid)
            t0 = time.monotonic()
            with pytest.raises(PeerGone) as e:
                inp.wait(soon(kind, 30))
            assert (e.value.peer, e.value.transport) == (1, kind), e.value
            with pytest.raises(PeerGone):
                for i in range(10_000):
                    send(out, pattern(0, i, 16), soon(kind, 30))
            took = time.monotonic() - t0
            assert took < 10 * PATIENCE.get(kind, 1.0), f"the dead peer was seen after {took:.1f} s: {e.value}"
        finally:
            child.kill()
            child.wait(10)
            t.close()
            remove_stale(os.environ["RINGCOMM_JOB_ID"])  # what the killed rank left, as ringcomm-run does


def _wait_for_zombie(pid: int, timeout: float = 10.0) -> None:
    """Until the killed, unreaped child is a zombie (a condition polled with a deadline)."""
    deadline = time.monotonic() + timeout
    while open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1][1:2] != b"Z":
        assert time.monotonic() < deadline, "the killed child never became a zombie"
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_liveness_sees_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _wait_for_zombie(child.pid)
        os.kill(child.pid, 0)  # what liveness used to ask: the zombie still answers
        assert not pid_alive(child.pid)
        assert pid_alive(os.getpid()) and pid_alive(0)
    finally:
        child.wait(10)
    assert not pid_alive(child.pid)


# ---- shm's hooks for compiled code ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_shm_hands_its_counters_to_a_compiled_loop(monkeypatch):
    # Not part of every transport's contract: what ringcomm's native engine (engine_native.py)
    # relies on. A loop that follows the FIFO protocol itself reads the words and slots at
    # addresses(), keeps each end's count while it runs, and writes it back before it blocks in
    # wait() / acquire() again; writing it back also ends the hold wait() / acquire() gave.
    import ctypes
    from ringcomm.transport import shm
    monkeypatch.setenv("RINGCOMM_JOB_ID", f"conf{os.getpid()}")
    store, made = HashStore(timeout=10), []
    try:
        for r in (0, 1):
            made.append(make_transport("shm", LinkContext(rank=r, world_size=2, store=store, prefix="hooks",
                                                          token="t", nslots=2, slot_bytes=4096)))
        s01 = made[0].connect_send(1, soon("shm"))
        name = s01.seg.path
        assert not s01.settle() and os.path.exists(name)  # the receiver has not mapped it yet
        r01 = made[1].connect_recv(0, soon("shm"))
        assert s01.settle() and not os.path.exists(name)
        (sw, s0), (rw, r0) = s01.addresses(), r01.addresses()
        assert s0 - sw == shm.HDR
        words = np.ctypeslib.as_array((ctypes.c_int64 * (shm.HDR // 8)).from_address(sw))
        slots = np.ctypeslib.as_array((ctypes.c_uint8 * 8192).from_address(s0))
        for k in range(5):  # 5 slices through 2 slots: Python blocks, the "loop" moves the data
            s01.acquire(soon("shm"))            # a free slot (the loop would block here)
            slots[(k % 2) * 4096:(k % 2) * 4096 + 3] = (k, k + 1, k + 2)
            words[shm.SIZES + k % 2] = 3
            words[shm.POSTED] = k + 1           # what the loop stores, after the data
            s01.count = k + 1                   # and writes back before it blocks again
            got = np.array(r01.wait(soon("shm")))
            assert list(got) == [k, k + 1, k + 2]
            words[shm.RELEASED] = k + 1         # the receiving loop releases the slot itself
            r01.count = k + 1
        send(s01, pattern(0, 9, 7), soon("shm"))  # and Python takes over where the loop stopped
        np.testing.assert_array_equal(recv(r01, soon("shm")), pattern(0, 9, 7))
        assert (s01.count, r01.count) == (6, 6)
    finally:
        for t in made:
            t.close()
    with pytest.raises(Aborted, match="closed by this process"):
        s01.addresses()  # unmapped: compiled code must not get an address
    assert s01.settle() and s01.ready() and r01.ready()
