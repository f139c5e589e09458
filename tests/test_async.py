"""Non-blocking calls (async_op=True -> Work) and groups (with comm.group(): ...).

The multi-rank checks run inside spawned ranks (module-level functions, so spawn can import them).
A "slow peer" is a rank the test has not yet told to call: the harness starts ranks one by one.
"""
from __future__ import annotations

import inspect
import threading
import time

import numpy as np
import pytest

import ringcomm
from ringcomm.errors import CollectiveTimeout, CommunicatorClosed, PeerFailure, RingcommError

from harness import World

FIFO = 65536                 # RINGCOMM_BUFFSIZE in these worlds
BIG = 10 * FIFO // 4         # float32 elements in a message of 10 FIFOs
_kept: dict = {}             # what a rank keeps between two calls of the harness


@pytest.fixture
def comm():
    with ringcomm.init(0, 1) as c:
        yield c


# ---- one rank: argument checks, Work basics ---------------------------------------------------

def test_work_of_one_rank_and_argument_errors(comm):
    x = np.arange(5, dtype=np.float32)
    comm.all_reduce(x)
    comm.barrier()
    assert not comm._progress.alive()  # blocking calls on an idle communicator run inline: no thread yet
    w = comm.all_reduce(x, async_op=True)
    assert isinstance(w, ringcomm.Work)
    assert w.wait(timeout=10) is True and w.is_completed() and w.exception() is None
    with pytest.raises(TypeError, match="async_op"):
        comm.all_reduce(x, async_op="yes")
    with pytest.raises(ValueError, match="timeout"):
        w.wait(timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        w.wait(timeout="1")
    with pytest.raises(TypeError, match="complex"):
        comm.all_reduce(np.zeros(3, complex), async_op=True)  # refused on the caller, before queueing
    assert "async_op=False" in str(inspect.signature(comm.broadcast))


def test_group_of_one_rank_refuses_async_and_discards_on_error(comm):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"async_op=True\) inside comm.group"):
        with comm.group():
            comm.all_reduce(x, async_op=True)
    with pytest.raises(ValueError, match="out of range"):
        with comm.group():
            comm.all_reduce(x)
            comm.broadcast(x, root=3)
    with comm.group():
        pass
    with comm.group():
        comm.all_reduce(x)
        with comm.group():  # nested: joins the outer group
            comm.all_gather(x, y := np.zeros(4, np.float32))
    assert (y == 1).all()


def test_callbacks_run_in_order_and_cannot_wait_for_later_calls(comm):
    gate = threading.Event()
    comm._progress.submit("gate", lambda: gate.wait(30))  # holds the queue until the callback is in place
    x = np.ones(3)
    w1, w2 = comm.all_reduce(x, async_op=True), comm.all_reduce(x, async_op=True)
    seen = []

    def on_w1(w):
        seen.append((w is w1, w2.is_completed()))
        try:
            w2.wait()
        except RingcommError as e:
            seen.append(str(e))
    w1.add_done_callback(on_w1)
    gate.set()
    assert w2.wait(timeout=30)
    assert seen[0] == (True, False) and "would never return" in seen[1]


# ---- several ranks: order, groups ---------------------------------------------------------------

def _ordered(comm):
    """Async calls on one buffer run in issue order: SUM, PROD, then a blocking MAX that queues."""
    n, x = comm.world_size, np.full(7, comm.rank + 1, np.float64)
    works = [comm.all_reduce(x, ringcomm.SUM, async_op=True), comm.all_reduce(x, ringcomm.PROD, async_op=True)]
    comm.all_reduce(x, ringcomm.MAX)  # blocking, behind the two: returns after both
    assert all(w.is_completed() and w.exception() is None and w.wait() for w in works)
    assert (x == float(n * (n + 1) // 2) ** n).all(), x
    y = np.arange(3, dtype=np.int32) + comm.rank
    w1, w2 = comm.broadcast(y, root=n - 1, async_op=True), comm.barrier(async_op=True)
    assert w2.wait() and w1.is_completed() and (y == np.arange(3) + n - 1).all()


def _ring_shift(comm):
    """Everyone sends to rank + 1 before receiving from rank - 1, messages of 10 FIFOs, and a
    second, small message on the same pair that must match in issue order."""
    n, r = comm.world_size, comm.rank
    a, c = np.full(BIG, r, np.float32), np.arange(5, dtype=np.int64) * (r + 1)
    b, d = np.empty(BIG, np.float32), np.empty(5, np.int64)
    with comm.group():
        comm.send(a, (r + 1) % n)
        comm.send(c, (r + 1) % n)
        comm.recv(b, (r - 1) % n)
        comm.recv(d, (r - 1) % n)
    assert (b == (r - 1) % n).all() and (d == np.arange(5) * ((r - 1) % n + 1)).all()


def _with_itself(comm):
    """A group's sends to this rank itself and receives from it pair up in issue order, beside
    the messages to its neighbours (NCCL allows both in a group)."""
    n, r = comm.world_size, comm.rank
    mine, theirs = [np.arange(4.0) + 10 * r + k for k in range(2)], np.full(3, float(r))
    got, back = [np.empty(4) for _ in range(2)], np.empty(3)
    with comm.group():
        comm.recv(got[0], r)
        if n > 1:
            comm.send(theirs, (r + 1) % n)
        comm.send(mine[0], r)
        if n > 1:
            comm.recv(back, (r - 1) % n)
        comm.send(mine[1], r)
        comm.recv(got[1], r)
    assert all((g == m).all() for g, m in zip(got, mine)) and (n == 1 or (back == (r - 1) % n).all())


def test_a_world_of_one_sends_to_itself_in_a_group(comm):
    _ring_shift(comm)
    _with_itself(comm)
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"1 send\(s\) to this rank itself and 0 receive"):
        with comm.group():
            comm.send(x, 0)
    with pytest.raises(ValueError, match="has 4 float32, the receive it pairs with 3 float32"):
        with comm.group():
            comm.send(x, 0)
            comm.recv(np.empty(3, np.float32), 0)
    with pytest.raises(ValueError, match=r"is this rank itself \(inside comm.group\(\)"):
        comm.send(x, 0)   # alone, a send to itself would wait for ever for its own receive


def _all_to_all(comm):
    """An all-to-all as n - 1 sends and n - 1 receives, receives issued first, each 10 FIFOs."""
    n, r = comm.world_size, comm.rank
    out = np.full((n, BIG), -1, np.float32)
    out[r] = r * n + r
    blocks = {p: np.full(BIG, r * n + p, np.float32) for p in range(n) if p != r}
    with comm.group():
        for p in blocks:
            comm.recv(out[p], p)
        for p, blk in blocks.items():
            comm.send(blk, p)
    assert (out == (np.arange(n) * n + r)[:, None]).all()


def _mixed(comm):
    """Collectives and point-to-point calls interleaved in one group: the receive after a collective
    that the matching send precedes."""
    n, r = comm.world_size, comm.rank
    x, g = np.full(BIG, r + 1, np.float32), np.empty(3 * n, np.int32)
    s, t = np.full(BIG, r, np.float32), np.empty(BIG, np.float32)
    z = np.full(11, r, np.int64)
    with comm.group():
        comm.all_reduce(x)
        comm.send(s, (r + 1) % n)
        comm.all_gather(np.full(3, r, np.int32), g)
        comm.recv(t, (r - 1) % n)
        comm.broadcast(z, root=n - 1)
    assert (x == n * (n + 1) / 2).all() and (t == (r - 1) % n).all()
    assert (g == np.repeat(np.arange(n), 3)).all() and (z == n - 1).all()
    comm.all_reduce(x)  # the communicator goes on after a group
    assert (x == n * n * (n + 1) / 2).all()


def _reproducible(comm):
    """reproducible=True (passes that read each other's results) queued and grouped: the same bits."""
    n, r = comm.world_size, comm.rank
    x = np.random.default_rng(r).standard_normal(1001)
    want = comm.all_reduce(x.copy(), reproducible=True)
    y, z, t = x.copy(), x.copy(), np.empty(5)
    w = comm.all_reduce(y, reproducible=True, async_op=True)
    with comm.group():
        comm.send(np.full(5, r, np.float64), (r + 1) % n)
        comm.all_reduce(z, reproducible=True)
        comm.recv(t, (r - 1) % n)
    assert w.wait() and y.tobytes() == want.tobytes() == z.tobytes() and (t == (r - 1) % n).all()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_order_and_groups(n, transport):
    env = {"RINGCOMM_TRANSPORT": transport, "RINGCOMM_BUFFSIZE": str(FIFO)}
    if (n, transport) == (3, "tcp"):
        env["RINGCOMM_DEBUG"] = "check"  # the fingerprints of grouped and queued collectives too
    with World(n, env=env) as w:
        for fn in (_ordered, _ring_shift, _with_itself, _all_to_all, _mixed, _reproducible):
            w.run(fn, timeout=120)


# ---- failures: a slow peer, errors through wait(), a group's deadline ---------------------------

def _start_async(comm):
    x = np.full(4, comm.rank + 1.0)
    w = _kept["w"] = comm.all_reduce(x, async_op=True)
    _kept["x"] = x
    # Rank 1 has not been told to call yet: the call cannot complete.
    assert w.wait(timeout=0.2) is False and not w.is_completed() and w.exception() is None


def _join(comm):
    x = np.full(4, comm.rank + 1.0)
    comm.all_reduce(x)
    assert (x == 3).all()


def _finish_async(comm):
    assert _kept["w"].wait() is True and (_kept["x"] == 3).all()


def _lonely_group(comm):
    b = np.empty(16, np.float32)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as e:
        with comm.group():
            comm.recv(b, 1)
    return str(e.value), time.monotonic() - t0


def _peer_gone(comm):
    w1 = comm.recv(np.empty(16, np.float32), 0, async_op=True)
    w2 = comm.all_reduce(np.ones(4), async_op=True)  # queued behind w1
    with pytest.raises(PeerFailure, match="rank 0"):
        w1.wait()
    assert isinstance(w1.exception(), PeerFailure) and w1.is_completed()
    with pytest.raises(CommunicatorClosed):
        w2.wait()
    with pytest.raises(CommunicatorClosed):
        comm.barrier(async_op=True)  # refused when issued


@pytest.mark.timeout(120)
def test_slow_peer_errors_and_group_deadline():
    with World(2, env={"RINGCOMM_BUFFSIZE": str(FIFO)}, timeout=4.0) as w:
        w.run(_start_async, ranks=[0])
        w.run(_join, ranks=[1])
        w.run(_finish_async, ranks=[0])
        # A group whose peer never sends: the communicator's deadline, a message naming the call.
        (msg, took), = w.run(_lonely_group, ranks=[0], timeout=60)
        assert "timed out after 4 s in a group" in msg and "recv #" in msg and "from rank 1 over shm" in msg
        assert took < 30
        w.run(_peer_gone, ranks=[1], timeout=60)  # rank 0 broke and closed its links


# ---- abort and close with work queued -----------------------------------------------------------

def _abort_queued(comm):
    w1 = comm.recv(np.empty(4), 1, async_op=True)  # rank 1 never sends
    w2, w3 = comm.all_reduce(np.ones(4), async_op=True), comm.barrier(async_op=True)
    assert w1.wait(timeout=0.1) is False
    t = threading.Thread(target=comm.abort)
    t.start()
    t.join(10)
    with pytest.raises(RingcommError, match="abort"):
        w1.wait()
    for w in (w2, w3):
        with pytest.raises(CommunicatorClosed, match="abort"):
            w.wait()


def _close_with_queued(comm):
    w1 = comm.all_reduce(np.ones(4), async_op=True)  # rank 0 will never answer: it aborted
    w2 = comm.barrier(async_op=True)
    t0 = time.monotonic()
    comm.close()
    took = time.monotonic() - t0
    assert w1.exception() is not None and isinstance(w2.exception(), CommunicatorClosed)
    return took


def _close_drains(comm):
    x = np.full(4, comm.rank + 1.0)
    w = comm.all_reduce(x, async_op=True)
    comm.close()  # waits for the queued call (rank 1 joins it), within the timeout
    assert w.wait(timeout=0) and (x == 3).all()


@pytest.mark.timeout(120)
def test_abort_and_close_with_queued_work():
    with World(2, timeout=4.0) as w:
        w.start(_close_drains, ranks=[0])
        w.run(_join, ranks=[1])
        status, value = w.collect([0], 60)[0]
        assert status == "ok", value
    with World(2, timeout=4.0) as w:
        w.run(_abort_queued, ranks=[0])
        took, = w.run(_close_with_queued, ranks=[1], timeout=60)
        assert took < 4.0 + 10, took
