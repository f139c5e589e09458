"""comm.split and comm.shrink: new communicators over a subset, even after rank 0 (the store's host) died.

The worlds here are real processes. The communicators a test makes live on in each worker
between calls, in ``_COMMS`` (a module global of the worker process, keyed by name).
RINGCOMM_SHRINK_RUNS=20 repeats the kill-and-shrink chain (default: once).
"""
from __future__ import annotations

import os
import random
import re
import signal
import time

import numpy as np
import pytest

import ringcomm
from harness import World, leaked_since, resources

_COMMS: dict = {}
TIMEOUT = 8.0  # RINGCOMM_TIMEOUT of the worlds that lose ranks
SHRINK_RUNS = int(os.environ.get("RINGCOMM_SHRINK_RUNS", "1"))


def _sum_check(comm, tag):
    """all_reduce of an odd count; returns what every rank must agree on."""
    x = np.full(1001, float(tag + 1), np.float64)
    comm.all_reduce(x)
    assert np.all(x == x[0]), f"rank {comm.rank}: all_reduce disagrees with itself"
    return float(x[0])


# ---- arguments -----------------------------------------------------------------------------

def test_bad_arguments_raise_before_anything_moves():
    comm = ringcomm.init(0, 1)
    try:
        for color, key, kind in [(-1, 0, ValueError), (1.5, 0, TypeError), (True, 0, TypeError),
                                 ("0", 0, TypeError), (0, "k", TypeError), (0, 2.0, TypeError),
                                 (0, 1 << 70, ValueError), (1 << 64, 0, ValueError)]:
            with pytest.raises(kind):
                comm.split(color, key)
        for exclude, kind in [([0], ValueError), ([1], ValueError), ([-1], ValueError), (0, TypeError),
                              (["1"], TypeError), ("1", TypeError), ([False], TypeError)]:
            with pytest.raises(kind):
                comm.shrink(exclude)
        assert comm.split(None) is None
        for sub in (comm.split(np.int32(4), key=np.int64(-9)), comm.shrink(), comm.shrink([])):
            assert (sub.rank, sub.world_size) == (0, 1)
            assert _sum_check(sub, 2) == 3.0
            sub.close()
    finally:
        comm.close()
    with pytest.raises(ringcomm.CommunicatorClosed):
        comm.shrink()
    with pytest.raises(ringcomm.CommunicatorClosed):
        comm.split(0)


def test_a_zombie_counts_as_dead():
    """A SIGKILLed rank its parent has not reaped yet is a zombie: kill(pid, 0) still succeeds,
    but shm peers and shrink must see it as dead."""
    import subprocess
    import sys

    from ringcomm.transport.base import process_gone
    from ringcomm.transport.shm import _pid_alive
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_gone(p.pid) and _pid_alive(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not process_gone(p.pid):  # the kernel makes it a zombie; we have not reaped it
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)  # polling /proc with a deadline
        assert not _pid_alive(p.pid)
    finally:
        p.kill()
        p.wait()


def test_callers_that_disagree_on_exclude_are_told():
    """Three ranks of one process (threads) meet; rank 2 passes another exclude than rank 0."""
    from link_helpers import run_threads

    from ringcomm.meet import meet
    from ringcomm.roster import Roster
    from ringcomm.store import HashStore
    store, deadline = HashStore(timeout=5), time.monotonic() + 5
    rosters = [Roster(r, 3, "this host") for r in range(3)]
    results = {}

    def rank(r, exclude):
        def body():
            rosters[r].join(store, "p", deadline)
            try:
                results[r] = meet(rosters[r], frozenset(exclude), "", time.monotonic() + 2, lambda m: "")
            except ringcomm.RingcommError as e:
                results[r] = e
        return body

    try:
        run_threads(rank(0, []), rank(1, []), rank(2, [1]), timeout=20)
    finally:
        for ro in rosters:
            ro.close()
    assert all(isinstance(e, ringcomm.RingcommError) for e in results.values()), results
    for r in (0, 2):
        assert re.search(rf"^rank {r} \(this process\).*the ranks disagree: rank 2 called "
                         rf"shrink\(exclude=\[1\]\), rank 0 called shrink\(exclude=\[\]\)",
                         str(results[r])), results[r]


# ---- split ---------------------------------------------------------------------------------

SPLITS = [  # (name, color of rank r in a world of 8, key of rank r): children of every size 1..8
    ("1+7", lambda r: int(r > 0), lambda r: 0),
    ("2+6", lambda r: int(r >= 2), lambda r: -r),                # negative keys: reversed order
    ("3+5", lambda r: 7 if r % 3 == 0 else 2, lambda r: -(r // 2)),  # ties broken by old rank
    ("4+4", lambda r: r % 2, lambda r: 0),
    ("8", lambda r: 0, lambda r: 5),
    ("7+None", lambda r: None if r == 3 else 1, lambda r: r),
]


def _expected(n, color_of, key_of, r):
    mine = color_of(r)
    if mine is None:
        return None
    group = sorted((key_of(q), q) for q in range(n) if color_of(q) == mine)
    ranks = [q for _, q in group]
    return ranks.index(r), len(ranks), float(sum(q + 1 for q in ranks))


def _split_all(comm):
    # The parent's own connections are made at its first calls: make them before counting.
    comm.split(0).close()
    _sum_check(comm, 0)
    _COMMS["before"] = resources()
    got = []
    for name, color_of, key_of in SPLITS:
        sub = comm.split(color_of(comm.rank), key_of(comm.rank))
        if sub is None:
            got.append(None)
            continue
        got.append((sub.rank, sub.world_size, _sum_check(sub, comm.rank)))
        _COMMS[name] = sub
    return got


def _interleave_and_close(comm):
    """Parent and children take turns; a child closed first leaves its parent working, a parent
    closed first leaves its child (and the child's child) working."""
    a, b = _COMMS.pop("4+4"), _COMMS.pop("3+5")
    total = _sum_check(comm, comm.rank) + _sum_check(a, comm.rank) + _sum_check(comm, 0)
    a.close()                                       # child first ...
    total += _sum_check(comm, comm.rank)            # ... the parent goes on
    nested = b.split(b.rank % 2, key=-b.rank)       # a child's child
    b.close()                                       # parent first ...
    total += _sum_check(nested, comm.rank)          # ... its child goes on
    whole = _COMMS["8"].shrink()                    # shrink with nobody dead: every rank, same order
    total += _sum_check(whole, comm.rank)
    out = (nested.rank, nested.world_size, whole.rank, whole.world_size, total)
    before = _COMMS.pop("before")
    for c in (nested, whole, *_COMMS.values()):
        c.close()
    _COMMS.clear()
    leaked = leaked_since(before)
    assert not leaked, f"rank {comm.rank}: open after closing, not before the splits: {leaked}"
    return out


def _nested_expected(n, r):
    b = [q for _, q in sorted((-(q // 2), q) for q in range(n) if (7 if q % 3 == 0 else 2) == (7 if r % 3 == 0 else 2))]
    mine = [q for _, q in sorted((-i, q) for i, q in enumerate(b) if i % 2 == b.index(r) % 2)]
    a = [q for q in range(n) if q % 2 == r % 2]
    s = n * (n + 1) / 2
    total = s + sum(q + 1 for q in a) + n + s + sum(q + 1 for q in mine) + s
    return mine.index(r), len(mine), r, n, total


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_split_sizes_keys_nesting_and_closing_order(transport):
    n = 8
    with World(n, {"RINGCOMM_TRANSPORT": transport, "RINGCOMM_BUFFSIZE": "65536"}) as world:
        got = world.run(_split_all, timeout=120)
        for r in range(n):
            want = [_expected(n, c, k, r) for _, c, k in SPLITS]
            assert got[r] == want, f"rank {r}: {got[r]} != {want}"
        got = world.run(_interleave_and_close, timeout=60)
        assert got == [_nested_expected(n, r) for r in range(n)]


# ---- shrink --------------------------------------------------------------------------------

def _shrink_excluding(comm, exclude):
    before = resources()
    sub = comm.shrink(exclude=exclude)
    out = (sub.rank, sub.world_size, _sum_check(sub, comm.rank))
    sub.close()
    leaked = leaked_since(before)
    assert not leaked, f"rank {comm.rank}: open after closing the shrunk communicator, not before: {leaked}"
    return out


def _shrink_timed(comm):
    t0 = time.monotonic()
    try:
        comm.shrink()
        return "no error", time.monotonic() - t0
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


@pytest.mark.timeout(120)
def test_shrink_with_exclude_a_stopped_rank_and_a_leader_that_dies():
    """exclude (the excluded rank does not call); then a stopped rank: every caller gets a clear
    timeout naming it within the deadline, and excluding it then works. Last, the rank that
    would lead (rank 0) dies while the others wait for it: they go on to the next one."""
    n, stopped, t = 4, 2, 4.0
    with World(n, {"RINGCOMM_TIMEOUT": str(t)}, timeout=t, rank0_hosts_store=True) as world:
        got = world.run(_shrink_excluding, [1], ranks=[0, 2, 3], timeout=60)
        assert got == [(0, 3, 8.0), (1, 3, 8.0), (2, 3, 8.0)]  # ranks 0, 2, 3: 1 + 3 + 4
        callers = [0, 1, 3]
        os.kill(world.procs[stopped].pid, signal.SIGSTOP)
        try:
            got = world.run(_shrink_timed, ranks=callers, timeout=60)
            for r, (text, elapsed) in zip(callers, got):
                assert re.search(rf"^CollectiveTimeout: rank {r} \(this process\).*shrink.*"
                                 rf"rank {stopped} is alive", text, re.S), text
                assert elapsed < t, (r, elapsed, text)
            got = world.run(_shrink_excluding, [stopped], ranks=callers, timeout=60)
            assert got == [(0, 3, 7.0), (1, 3, 7.0), (2, 3, 7.0)]  # ranks 0, 1, 3: 1 + 2 + 4
        finally:
            world.procs[stopped].kill()
        world.start(_shrink_and_check, ranks=[1, 3])  # they reach rank 0, which is not in shrink
        time.sleep(0.5)  # the fault's moment: any works, this one makes them wait for rank 0 first
        world.procs[0].kill()
        got = world.collect([1, 3], 30)
        assert [value for _, value in got.values()] == [(0, 2, 6.0), (1, 2, 6.0)], got  # 2 + 4
        for status, value in got.values():
            assert status == "ok", value


def _shrink_and_check(comm):
    t0 = time.monotonic()
    sub = comm.shrink()
    assert time.monotonic() - t0 < comm.timeout
    out = (sub.rank, sub.world_size, _sum_check(sub, comm.rank))
    sub.close()
    return out


def _loop_until_error(comm, seed):
    """all_reduces of changing sizes until one fails (a rank was killed); returns the error."""
    c = _COMMS.get("current", comm)
    rnd = random.Random(seed)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            x = np.ones(rnd.randrange(1, 200_000), np.float32)
            c.all_reduce(x)
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _shrink_after_failure(comm):
    old = _COMMS.get("current", comm)
    with pytest.raises(ringcomm.CommunicatorClosed, match="unusable after an earlier error"):
        old.split(0)  # a broken communicator refuses every call but shrink and close
    t0 = time.monotonic()
    new = old.shrink()
    elapsed = time.monotonic() - t0
    if old is not comm:
        old.close()
    _COMMS["current"] = new
    return elapsed, new.rank, new.world_size, _sum_check(new, comm.rank)


def _close_current(comm):
    _COMMS.pop("current").close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("run", range(SHRINK_RUNS))
def test_shrink_after_sigkill_of_rank_0_then_a_middle_then_the_last(transport, run):
    """One world loses its rank 0 (init's store host), then the middle rank of the survivors, then
    the last one, then the first again (the host of a store a shrink made); each time the
    survivors' collective fails, shrink returns within the timeout and the new communicator's
    all_reduce is right."""
    n = 6
    rnd = random.Random()
    env = {"RINGCOMM_TRANSPORT": transport, "RINGCOMM_BUFFSIZE": "65536"}
    with World(n, env, timeout=TIMEOUT, rank0_hosts_store=True) as world:
        world.run(_sum_check, 0, timeout=60)
        alive = list(range(n))
        for where in ("first", "middle", "last", "first"):
            position = {"first": 0, "middle": len(alive) // 2, "last": len(alive) - 1}[where]
            world.start(_loop_until_error, rnd.randrange(1000), ranks=alive)
            time.sleep(rnd.uniform(0.05, 0.3))  # the fault's random moment, not synchronisation
            victim = alive.pop(position)
            world.procs[victim].kill()
            errors = world.collect(alive, TIMEOUT + 30, "all_reduce until error")
            for r, (status, text) in errors.items():
                assert status == "ok" and re.match(r"\w+: rank \d+ \(this process\)", text), (r, text)
            got = world.run(_shrink_after_failure, ranks=alive, timeout=TIMEOUT + 30)
            total = float(sum(r + 1 for r in alive))
            for i, (r, (elapsed, rank, size, value)) in enumerate(zip(alive, got)):
                assert elapsed < TIMEOUT, f"rank {r}'s shrink took {elapsed:.1f} s (victim {victim})"
                assert (rank, size, value) == (i, len(alive), total), (r, victim, got)
            print(f"{transport}: rank {victim} killed ({where}); slowest shrink "
                  f"{max(e for e, *_ in got):.3f} s of {len(alive)} survivors")  # shown by pytest -s
        world.run(_close_current, ranks=alive, timeout=30)
