"""Faults: every surviving rank ends with a clear error within its deadline, nothing is left behind.

A killed rank, a stalled rank (SIGSTOP), a mismatched collective and a store that
dies while ranks connect. (A link cut between two hosts is in test_two_hosts.py.)
Worlds leave no segment in /dev/shm: harness.World checks that on exit.
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
from cases import run_case, sample_cases
from harness import World

TIMEOUT = 6.0  # RINGCOMM_TIMEOUT of the faulty worlds
FAULT_ENV = {"RINGCOMM_TIMEOUT": str(TIMEOUT), "RINGCOMM_BUFFSIZE": "65536"}


def _collectives_until_error(comm, seed):
    """Random collectives (the same sequence on every rank) until one raises; returns its text."""
    cases = [c for c in sample_cases(comm.world_size, seed, big=0) if c["count"] > 0]
    deadline = time.monotonic() + 60
    i = 0
    warm_up_kernels()
    try:
        while time.monotonic() < deadline:
            case = dict(cases[i % len(cases)], count=5000 + 3 * i)
            err = run_case(comm, case)
            assert err is None, err
            if i == 0:
                comm._store.add("faults/started", 1)
            i += 1
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def warm_up_kernels():
    """Compile (or load from numba's cache) the 16-bit kernels before the clock matters: a
    rank compiling for a second looks, to peers with a short timeout, like a stalled one."""
    from ringcomm.kernels.host import BFLOAT16, FLOAT16, reduce_copy
    for dt in (FLOAT16, BFLOAT16):
        x = np.ones(4, dt)
        for op in ("sum", "prod", "min", "max"):
            reduce_copy(x, x, x, op)


def _wait_started(world, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while world.store.add("faults/started", 0) < n:
        assert time.monotonic() < deadline, "the ranks did not start their collectives"
        time.sleep(0.01)  # polling a counter with a deadline


def _assert_clear_errors(answers, victim, *, names_victim=False):
    for r, (status, text) in answers.items():
        assert status == "ok", f"rank {r} crashed instead of raising a ringcomm error: {text}"
        assert re.search(rf"^\w+: rank {r} \(this process\)", text), f"rank {r}: {text}"
        assert re.search(r"#\d+", text), f"rank {r} does not name the collective: {text}"
        assert re.search(rf"rank (?!{r}\b)\d+", text), f"rank {r} does not name a peer: {text}"
        assert re.search(r"over (shm|tcp)", text), f"rank {r}: {text}"
        if names_victim:  # the rank that died, even where this rank saw only a neighbour close its link
            assert re.search(rf"rank {victim}\b", text), f"rank {r} does not name rank {victim}: {text}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_killed_rank(n):
    rnd = random.Random()
    victim = rnd.randrange(n)
    with World(n, FAULT_ENV, timeout=TIMEOUT) as world:
        world.start(_collectives_until_error, rnd.randrange(1000))
        _wait_started(world, n)
        time.sleep(rnd.uniform(0, 0.3))  # the fault's random moment, not synchronisation
        world.procs[victim].kill()
        survivors = [r for r in range(n) if r != victim]
        t0 = time.monotonic()
        answers = world.collect(survivors, TIMEOUT * 2 + 10)
        assert time.monotonic() - t0 < TIMEOUT + 2  # liveness, not the deadline, finds a dead rank
        _assert_clear_errors(answers, victim, names_victim=True)


@pytest.mark.timeout(90)
def test_stalled_rank_shows_in_the_table():
    n, victim = 4, 2
    with World(n, FAULT_ENV, timeout=TIMEOUT) as world:
        world.start(_collectives_until_error, 7)
        _wait_started(world, n)
        os.kill(world.procs[victim].pid, signal.SIGSTOP)
        try:
            survivors = [r for r in range(n) if r != victim]
            answers = world.collect(survivors, TIMEOUT * 3 + 10)
        finally:
            world.procs[victim].kill()  # SIGKILL ends a stopped process too
        _assert_clear_errors(answers, victim)
        texts = [text for _, text in answers.values()]
        assert any("timed out" in t for t in texts), texts
        tables = [t for t in texts if "where every rank was" in t]
        assert len(tables) == 1, texts  # only the first rank to time out prints the table
        assert re.search(rf"^\s+{victim}\s+no answer", tables[0], re.M), tables[0]


def _joined(comm):
    return comm.rank   # the communicator exists (ringcomm.init returned); no link is made yet


def _first_all_reduce(comm):
    try:
        comm.all_reduce(np.ones(1000, np.float32), algo="ring")
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(90)
def test_a_rank_stalled_before_its_links_exist_shows_in_the_table():
    """Links are made at first use: a peer stopped before then fails the connection, not a
    wait, and that timeout names the call and brings the table as a wait's does."""
    n, victim = 3, 2
    with World(n, FAULT_ENV, timeout=TIMEOUT) as world:
        assert world.run(_joined, timeout=60) == list(range(n))
        os.kill(world.procs[victim].pid, signal.SIGSTOP)
        try:
            survivors = [r for r in range(n) if r != victim]
            world.start(_first_all_reduce, ranks=survivors)
            answers = world.collect(survivors, TIMEOUT * 3 + 10)
        finally:
            world.procs[victim].kill()
        _assert_clear_errors(answers, victim)
        texts = [text for _, text in answers.values()]
        # rank 0 receives from rank 2 (the ring 0 -> 1 -> 2 -> 0): its connection waits for rank 2
        assert "timed out" in answers[0][1] and "could not connect to rank 2 (recv, for all_reduce #1)" \
            in answers[0][1], answers[0][1]
        tables = [t for t in texts if "where every rank was" in t]
        assert len(tables) == 1, texts
        assert re.search(rf"^\s+{victim}\s+no answer", tables[0], re.M), tables[0]


def _first_call(comm, count):
    try:
        comm.all_reduce(np.ones(count, np.float32))
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("count", [1000, 1 << 16])   # links made through the store; the CMA probe
def test_a_rank_killed_before_its_links_exist_is_named_dead_at_once(count, victim):
    """No link tells of a peer that died before it was made: the roster (every rank's pid and
    meeting socket) does, at the wait's next patrol, not at the deadline. Rank 0 hosts the
    store, as under ringcomm-run, so its death also takes the store."""
    n, survivor = 2, 1 - victim
    with World(n, FAULT_ENV, timeout=TIMEOUT, rank0_hosts_store=True) as world:
        assert world.run(_joined, timeout=60) == list(range(n))
        world.procs[victim].kill()
        world.procs[victim].join(10)
        t0 = time.monotonic()
        world.start(_first_call, count, ranks=[survivor])
        (status, text), = world.collect([survivor], TIMEOUT * 2 + 10).values()
        assert time.monotonic() - t0 < TIMEOUT / 2, text
    assert status == "ok" and text.startswith(f"PeerFailure: rank {survivor} (this process)"), text
    assert "all_reduce #1" in text and "over shm" in text and f"rank {victim} (pid" in text \
        and "died" in text, text


def _mismatched(comm):
    x = np.ones(999 if comm.rank == 1 else 1000, np.float32)
    try:
        comm.all_reduce(x)
    except ringcomm.RingcommError as e:
        first = str(e)
    else:
        first = "no error"
    try:
        if comm.rank == 0:
            comm.broadcast(np.ones(8, np.int32), root=0)
        else:
            comm.all_reduce(np.ones(8, np.int32))
    except ringcomm.RingcommError as e:
        return first, str(e)
    return first, "no error"


@pytest.mark.timeout(60)
def test_mismatched_collective_is_named_on_every_rank():
    with World(3, {"RINGCOMM_DEBUG": "check", **FAULT_ENV}, timeout=TIMEOUT) as world:
        results = world.run(_mismatched, timeout=30)
    for r, (first, second) in enumerate(results):
        assert f"rank {r} (this process): the ranks disagree" in first
        assert "ranks 0, 2 called collective #1: all_reduce(count=1000" in first, first
        assert "rank 1 called collective #1: all_reduce(count=999" in first, first
        assert "rank 0 called collective #2: broadcast(count=8, dtype=int32, root=0" in second, second
        assert "ranks 1, 2 called collective #2: all_reduce(count=8, dtype=int32, op=sum" in second, second


def _rank_in_dead_store(rank, port, queue):
    from ringcomm.store import TCPStore
    try:
        comm = ringcomm.init(rank, 3, store=TCPStore("127.0.0.1", port, is_server=False, timeout=TIMEOUT),
                             timeout=TIMEOUT)
        comm.all_reduce(np.ones(10))
        queue.put((rank, "no error"))
    except ringcomm.RingcommError as e:
        queue.put((rank, f"{type(e).__name__}: {e}"))


def _serve_store(port_queue):
    from ringcomm.store import TCPStore
    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
    port_queue.put(store.port)
    threading_event_forever()


def threading_event_forever():
    import threading
    threading.Event().wait()


@pytest.mark.timeout(60)
def test_store_dies_while_ranks_connect():
    """Ranks 0 and 1 wait in the store for rank 2, which never comes; the store process dies."""
    from harness import SPAWN
    q = SPAWN.Queue()
    server = SPAWN.Process(target=_serve_store, args=(q,), daemon=True)
    server.start()
    port = q.get(timeout=30)
    ranks = [SPAWN.Process(target=_rank_in_dead_store, args=(r, port, q), daemon=True) for r in (0, 1)]
    try:
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 30
        while not _store_has_clients(port, 2) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling with a deadline
        server.kill()
        t0 = time.monotonic()
        got = dict(q.get(timeout=TIMEOUT + 10) for _ in ranks)
        assert time.monotonic() - t0 < TIMEOUT + 5
    finally:
        for p in ranks + [server]:
            p.kill()
            p.join(5)
    for r in (0, 1):
        assert re.search(rf"^\w+: rank {r} \(this process\)", got[r]), got[r]
    # The rank that was waiting in the store says so; its peer may instead see that rank close its links.
    lost_store = [t for t in got.values() if re.search(r"could not (connect to rank \d|join).*store", t)]
    assert lost_store, got


def _store_has_clients(port, n):
    """True once n ranks have joined (each published its host id), read with a fresh client."""
    from ringcomm.store import TCPStore
    try:
        with TCPStore("127.0.0.1", port, is_server=False, timeout=2) as probe:
            for r in range(n):
                probe.get(f"c1/host/{r}", timeout=0.05)
            return True
    except ringcomm.RingcommError:
        return False


def _abort_from_a_thread(comm):
    import threading
    timer = threading.Timer(0.3, comm.abort)  # the moment another thread gives up
    timer.start()
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(1000, np.float32))  # rank 1 never joins: this would wait TIMEOUT
    except ringcomm.RingcommError as e:
        first = (time.monotonic() - t0, str(e))
    else:
        first = (time.monotonic() - t0, "no error")
    try:
        comm.barrier()
    except ringcomm.CommunicatorClosed as e:
        return first, str(e)
    return first, "no error"


@pytest.mark.timeout(60)
def test_abort_wakes_the_wait_and_closes_the_communicator():
    with World(2, {"RINGCOMM_TIMEOUT": "30"}, timeout=30) as world:
        ((elapsed, first), second), = world.run(_abort_from_a_thread, ranks=[0], timeout=20)
    assert elapsed < 5, f"abort took {elapsed:.1f} s to wake the wait"
    assert "rank 0 (this process) was aborted" in first, first
    assert "comm.abort() was called" in second, second


def _interrupted_then_go_on(comm, registered):
    """Rank 0 is interrupted (Ctrl-C, here a SIGALRM handler raising KeyboardInterrupt) inside an
    all_reduce that rank 1 enters only afterwards; then each rank calls again. Returns what each
    call did: it must be an error, never a result."""
    # 1 MiB: registered, it takes the one-copy read schedule; its slices are all full, so a call
    # that takes an earlier call's slices finds every size as it expects
    count = (1 << 20) // 4
    x = comm.alloc(count, np.float32) if registered else np.ones(count, np.float32)
    x[...] = 1
    comm.all_reduce(x)            # connected and warm
    if comm.rank == 1:
        comm._store.wait(["faults/interrupted"], 30)
        return [_outcome(comm, x, 1), _outcome(comm, x, 10)]

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    x[...] = 1
    signal.setitimer(signal.ITIMER_REAL, 0.5)   # rank 1 is held back: this call cannot finish first
    try:
        comm.all_reduce(x)
        first = "returned"
    except KeyboardInterrupt:
        first = "KeyboardInterrupt"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    comm._store.set("faults/interrupted", b"1")
    return [first, _outcome(comm, x, 10)]


def _outcome(comm, x, value):
    x[...] = value
    try:
        comm.all_reduce(x)
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"
    return f"returned {np.unique(x)}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["native", "python", "tcp", "registered"])
def test_interrupted_call_breaks_the_communicator_instead_of_corrupting_the_next(where):
    # Before, the communicator stayed usable after the interrupt: rank 1's first call took the
    # interrupted call's slices for its own and returned 2, 10 and 12 mixed where 2 was due, rank 0's
    # next call 2, 11 and 12 where 20 was due, and nothing raised.
    env = {"native": {}, "python": {"RINGCOMM_ENGINE": "python"}, "tcp": {"RINGCOMM_TRANSPORT": "tcp"},
           "registered": {}}[where]
    with World(2, {**FAULT_ENV, **env}, timeout=TIMEOUT) as world:
        (first, later), (one, two) = world.run(_interrupted_then_go_on, where == "registered", timeout=40)
    assert first == "KeyboardInterrupt", first
    assert later.startswith("CommunicatorClosed") and "all_reduce #" in later and \
        "interrupted by KeyboardInterrupt" in later, later
    for text in (one, two):   # rank 1: its peer left mid-call; nothing returns a mixture
        assert not text.startswith("returned"), (one, two)
    assert re.search(r"rank 1 \(this process\).*rank 0", one), one


def _fork_a_child(comm):
    """Rank 0 forks a child that tries a collective, then ends as a program does: comm.close()
    (a ``with`` block's end, torch's exit hook) and ringcomm's at-exit unlink of its /dev/shm names.
    The parent and its peer then use a registered buffer (made before the fork, not yet mapped by
    the peer) and a plain one. Returns (what the child's collective said, the results)."""
    from ringcomm.transport import shm
    x = np.ones(1000, np.float32)
    comm.all_reduce(x)
    reg = comm.alloc((1 << 20) // 4, np.float32)   # named in /dev/shm until the peer maps it
    said = ""
    if comm.rank == 0:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                try:
                    comm.all_reduce(x)
                    text = "returned"
                except ringcomm.CommunicatorClosed as e:
                    text = str(e)
                comm.close()
                shm.unlink_named()
                os.write(w, text.encode())
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        said = os.read(r, 4096).decode()
        os.close(r)
    reg[...] = comm.rank + 1
    comm.all_reduce(reg)
    x[...] = comm.rank + 1
    comm.all_reduce(x)
    return said, float(reg.min()), float(reg.max()), float(x.min()), float(x.max())


@pytest.mark.timeout(60)
def test_a_forked_child_can_neither_use_nor_close_the_parents_communicator():
    # Before, the child's collective ran on the parent's FIFOs, and its close() at exit closed the
    # parent's links and unlinked its segments' names: the job's next collective failed everywhere.
    with World(2, FAULT_ENV, timeout=TIMEOUT) as world:
        (said, *got0), (_, *got1) = world.run(_fork_a_child, timeout=40)
    assert said.startswith("rank 0: rank 0's communicator was made in process") and "is a fork of it" in said, said
    assert got0 == got1 == [3.0] * 4, (got0, got1)


def test_a_failure_quoted_by_another_rank_names_its_rank_everywhere():
    """The first failure, as the ranks after it quote it: every "rank 2 (this process)" and "this
    rank" of rank 2's message become "rank 2" (the ibverbs messages name this rank twice)."""
    from ringcomm.watchdog import Watchdog
    said = ("rank 2 (this process) failed waiting for slice 3 of all_reduce #2 from rank 1 over ibverbs: the "
            "recv queue pair between rank 2 (this process) and rank 1 failed while this rank waited")
    quoted = Watchdog(2, 3, None, "c1").as_cause(said)
    assert "this process" not in quoted and "this rank" not in quoted, quoted
    assert quoted.count("rank 2") == 3 and quoted.startswith("rank 2 failed waiting"), quoted
