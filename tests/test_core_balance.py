"""A host's ranks spread themselves over its cores (ringcomm/core_balance.py).

The unit tests stand real processes in for a rank's peers: `sleep` children pinned to a CPU,
whose /proc/PID/stat then names that CPU as where they last ran and says they sleep.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from ringcomm import core_balance
from ringcomm.core_balance import CoreBalance
from ringcomm.transport.base import current_cpu

from harness import World

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2 or current_cpu() < 0,
                               reason="moving a rank between CPUs needs two usable CPUs and sched_getcpu")


def _last_cpu(pid: int) -> tuple[str, int]:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[36])


@pytest.fixture
def sleepers():
    """sleepers(cpu, k): k sleeping children that last ran on ``cpu``; killed afterwards."""
    procs = []

    def make(cpu: int, k: int) -> list[int]:
        for _ in range(k):
            p = subprocess.Popen(["sleep", "120"], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
            procs.append(p)
            deadline = time.monotonic() + 10
            while _last_cpu(p.pid) != ("S", cpu):  # asleep in `sleep`, on that CPU
                assert time.monotonic() < deadline, f"sleep {p.pid} never settled on CPU {cpu}"
                os.sched_yield()
        return [p.pid for p in procs[-k:]]

    yield make
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def on_cpu():
    """on_cpu(c): put this thread on CPU c, its mask left whole (as a rank's is); restored after."""
    def put(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})
        os.sched_setaffinity(0, CPUS)
        assert current_cpu() == cpu
    yield put
    os.sched_setaffinity(0, CPUS)


@needs_two
def test_placement_reads_where_each_rank_last_ran_and_who_is_runnable(sleepers, on_cpu):
    a, b = CPUS[:2]
    balance = CoreBalance(sleepers(a, 2) + sleepers(b, 1))
    try:
        on_cpu(a)
        crowd, count = balance.placement(CPUS, a)
        assert count == {**dict.fromkeys(CPUS, 0), a: 3, b: 1}
        assert crowd == 1   # the sleepers on a wait for no core: only this thread runs there
    finally:
        balance.close()


def test_the_rule_moves_only_off_a_cpu_two_runnable_ranks_more_crowded():
    assert core_balance.target(0, 3, {0: 3, 1: 1}) == 1        # three and one: move
    assert core_balance.target(0, 4, {0: 4, 1: 0, 2: 1}) == 1  # to the emptiest
    assert core_balance.target(0, 2, {0: 2, 1: 2}) is None     # even
    assert core_balance.target(0, 3, {0: 3, 1: 2}) is None     # one more: a move would only swap them
    assert core_balance.target(0, 1, {0: 3, 1: 1}) is None     # the others on 0 sleep
    assert core_balance.target(5, 3, {0: 0, 1: 0}) is None     # this CPU is not one it may use
    assert core_balance.crowded([0, 0, 1, 1], 2) is False        # two and two
    assert core_balance.crowded([0, 0, 0, 1], 2) is True         # three and one
    assert core_balance.crowded([3, 3], 2) is True               # a pair on one CPU
    assert core_balance.crowded([3, 3], 1) is False              # ... which is all there is
    assert core_balance.crowded([2, -1], 2) is False             # one unknown: left out
    assert core_balance.crowded([-1, -1], 2) is False            # nothing known


@needs_two
def test_a_crowded_rank_moves_itself_and_keeps_its_mask(sleepers, on_cpu, monkeypatch):
    a, b = CPUS[:2]
    balance = CoreBalance(sleepers(a, 1))
    try:
        on_cpu(a)
        monkeypatch.setattr(balance, "placement", lambda cpus, mine: (3, {**dict.fromkeys(cpus, 1), a: 3, b: 0}))
        assert balance.check()
        assert current_cpu() == b and balance.moves == 1
        assert sorted(os.sched_getaffinity(0)) == CPUS   # the mask it had, restored
        monkeypatch.undo()
        assert not balance.check()  # for real now: one sleeper on a, this thread on b
        assert current_cpu() == b and balance.moves == 1
    finally:
        balance.close()


@needs_two
def test_after_a_move_the_checks_pause_and_the_pause_doubles(sleepers, monkeypatch):
    balance = CoreBalance(sleepers(CPUS[0], 1))
    now = [100.0]
    monkeypatch.setattr(core_balance.time, "monotonic", lambda: now[0])
    checks = []
    moving = [True]
    monkeypatch.setattr(balance, "check", lambda: checks.append(now[0]) or moving[0])
    try:
        balance.tick()                                     # moves: next check after HOLD_S
        now[0] += core_balance.HOLD_S * 0.9
        balance.tick()
        now[0] += core_balance.HOLD_S * 0.2
        balance.tick()                                     # moves again: next after 2 HOLD_S
        now[0] += core_balance.HOLD_S * 1.5
        balance.tick()
        now[0] += core_balance.HOLD_S * 0.6
        moving[0] = False
        balance.tick()                                     # even: back to checks every PERIOD_S
        now[0] += core_balance.PERIOD_S * 1.01
        balance.tick()
        hold, period = core_balance.HOLD_S, core_balance.PERIOD_S
        assert checks == pytest.approx([100.0, 100.0 + hold * 1.1, 100.0 + hold * 3.2,
                                        100.0 + hold * 3.2 + period * 1.01])
    finally:
        balance.close()


@needs_two
def test_it_is_off_where_there_is_nothing_to_balance(sleepers, monkeypatch):
    pid = os.getpid()
    peers = sleepers(CPUS[0], 3)
    entries = [{"pid": pid, "host": "h"}] + [{"pid": p, "host": "h"} for p in peers]
    os.sched_setaffinity(0, CPUS[:2])                           # 4 ranks on 2 CPUs
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        made = CoreBalance.for_host(entries, 0)
        assert made is not None and made.period == core_balance.PERIOD_S
        made.close()
        monkeypatch.setenv("RINGCOMM_BALANCE", "0")
        assert CoreBalance.for_host(entries, 0) is None
        monkeypatch.delenv("RINGCOMM_BALANCE")
        elsewhere = [entries[0]] + [dict(e, host="other") for e in entries[1:]]
        assert CoreBalance.for_host(elsewhere, 0) is None        # no peer on this host
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        made = CoreBalance.for_host(entries[:2], 0)              # a core per rank: on, every 5 ms a peer
        assert made is not None and made.period == core_balance.free_period(1) == 5e-3
        made.close()
        many = entries + [{"pid": p, "host": "h"} for p in sleepers(CPUS[1], core_balance.FREE_MAX_RANKS)]
        crowded = core_balance.oversubscribed
        monkeypatch.setattr(core_balance, "oversubscribed", lambda n: False)   # as on a host of many cores
        made = CoreBalance.for_host(entries, 0)                  # 4 ranks, a core each: a /proc read a peer
        assert made is not None and made.period == core_balance.free_period(3) == 15e-3
        made.close()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(many)))
        assert CoreBalance.for_host(many, 0) is None             # too many to read at every check
        monkeypatch.setattr(core_balance, "oversubscribed", crowded)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
        assert CoreBalance.for_host(entries, 0) is None          # a split of the host's ranks: it sees
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")              # not all who compete for the cores
        os.sched_setaffinity(0, {CPUS[0]})
        assert CoreBalance.for_host(entries, 0) is None          # bound to one CPU: the user chose
    finally:
        os.sched_setaffinity(0, CPUS)


def _three_and_one(comm):
    """Stack ranks 0-2 on one CPU and rank 3 on another, then call until the balance has spread
    them (placement two and two) or 5 s pass; every result checked."""
    cpus = sorted(os.sched_getaffinity(0))
    balance = comm._executor.balance
    os.sched_setaffinity(0, {cpus[0] if comm.rank < 3 else cpus[1]})
    os.sched_setaffinity(0, cpus)
    comm.barrier()
    x = np.full(16384, comm.rank + 1, np.float32)
    right, t0, even = True, time.monotonic(), None
    while time.monotonic() - t0 < 5.0:
        y = comm.all_reduce(x, out=np.empty_like(x))
        right &= bool((y == 10).all())
        flag = np.array([max(balance.placement(cpus[:2], current_cpu())[1].values()) <= 2], np.int64)
        even = bool(comm.all_reduce(flag, "min")[0])
        if even:
            break
    return balance is not None, balance.moves, right, even


@needs_two
@pytest.mark.skipif(len(CPUS) >= 4, reason="4 ranks do not outnumber this machine's cores")
@pytest.mark.timeout(120)
def test_four_ranks_on_two_cores_end_up_two_and_two():
    with World(4, {"RINGCOMM_TRANSPORT": "shm"}, timeout=60) as w:
        results = w.run(_three_and_one, timeout=90)
    assert all(has and right and even for has, _, right, even in results), results


@needs_two
def test_left_counts_the_calls_until_the_next_check_is_due(sleepers, monkeypatch):
    """Between ticks a call only compares counts (as comm._execute_now does); tick() says how
    many calls until the next, from the pace of those since the last, so checks keep their period."""
    balance = CoreBalance(sleepers(CPUS[0], 1), period=0.02)
    now = [100.0]
    monkeypatch.setattr(core_balance.time, "monotonic", lambda: now[0])
    balance._last = now[0]
    checks = []
    monkeypatch.setattr(balance, "check", lambda: checks.append(round(now[0], 6)) and False)

    count, due, strides = [0], [0], []

    def calls(n, seconds):           # as comm._execute_now counts them
        for _ in range(n):
            now[0] += seconds
            if count[0] >= due[0]:
                strides.append(balance.tick())
                due[0] = count[0] + strides[-1]
            count[0] += 1
    try:
        calls(1, 0.0)                 # the first call checks; no pace yet: MAX_STRIDE calls to the next look
        assert checks == [100.0] and strides == [core_balance.MAX_STRIDE]
        calls(core_balance.MAX_STRIDE, 1e-3)          # 1 ms calls: the next check, then one every 20 calls
        assert checks == [100.0, 100.064] and strides[-1] == 20
        calls(40, 1e-3)
        assert checks == [100.0, 100.064, 100.084, 100.104]
        calls(20 + 2 * core_balance.MAX_STRIDE, 1e-6)   # fast calls: the clock read every MAX_STRIDE calls
        assert strides[-1] == core_balance.MAX_STRIDE and checks[-1] == 100.104
    finally:
        balance.close()


@needs_two
def test_a_rank_sharing_its_core_with_a_runnable_peer_would_move_to_a_free_one():
    """Two ranks, a core each, stacked on one (busy processes holding the other, as
    examples/loaded_latency.py found): the peer here is a spinning child pinned to CPU a, and this
    thread is pinned there too while it looks (unpinned, the kernel may move it first: then there
    is nothing to see). The move itself: test_a_crowded_rank_moves_itself_and_keeps_its_mask."""
    a, b = CPUS[:2]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {a}))
    balance = None
    try:
        balance = CoreBalance([spinner.pid], core_balance.free_period(1))
        os.sched_setaffinity(0, {a})
        deadline = time.monotonic() + 10
        while _last_cpu(spinner.pid) != ("R", a):    # runnable on a, waiting for this thread's slice
            assert time.monotonic() < deadline, "the spinner never ran on its CPU"
            os.sched_yield()
        crowd, count = balance.placement(CPUS, current_cpu())
        assert current_cpu() == a and crowd == 2 and count[a] == 2 and count[b] == 0
        assert core_balance.target(a, crowd, count) == b
    finally:
        os.sched_setaffinity(0, CPUS)
        spinner.kill()
        spinner.wait()
        if balance is not None:
            balance.close()


def _balance_of(comm):
    balance = comm._executor.balance
    x = np.ones(4, np.float32)
    for _ in range(200):                       # calls tick the balance now and then
        comm.all_reduce(x, out=np.empty_like(x))
    return balance is not None and balance.period, 0 < comm._balance_at - comm._ordinal <= core_balance.MAX_STRIDE


@needs_two
@pytest.mark.timeout(120)
def test_two_ranks_with_a_core_each_check_the_balance_every_5_ms():
    with World(2, {"RINGCOMM_TRANSPORT": "shm"}, timeout=60) as w:
        results = w.run(_balance_of, timeout=90)
    assert results == [(core_balance.free_period(1), True)] * 2, results


@pytest.mark.timeout(120)
def test_loaded_latency_example_reports_times_and_crowding():
    """examples/loaded_latency.py, the figure issue 12's point 5 asks for: one repetition, idle and
    with one busy process, each library's median and the count of crowded repetitions."""
    root = os.path.join(os.path.dirname(__file__), "..")
    out = subprocess.run([sys.executable, "examples/loaded_latency.py", "--reps", "1", "--hogs", "1",
                          "--calls", "300"], capture_output=True, text=True, timeout=110, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"^rep 0: ringcomm idle [\d.]+ us  ringcomm loaded [\d.]+ us", out.stdout, re.M), out.stdout
    summary = re.search(r"^ringcomm  median idle +([\d.]+) us .*crowded runs idle / loaded: (\d) / (\d)$",
                        out.stdout, re.M)
    assert summary and float(summary[1]) > 0, out.stdout


@needs_two
@pytest.mark.timeout(120)
def test_unstack_example_stacks_the_ranks_and_times_their_parting():
    """examples/unstack.py, the measurement behind FREE_PERIOD_PER_PEER_S, under the launcher: two
    crowdings, each with how long the ranks took to spread again (or "never", on a machine whose
    other CPU stayed taken), and the results it checked (a wrong one exits non-zero)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", "examples/unstack.py",
                          "--episodes", "2", "--every-s", "0.05", "--pin-calls", "20"],
                         capture_output=True, text=True, timeout=110, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    found = re.search(r"median call ([\d.]+) us; ranks spread again after \(ms\): (.*)", out.stdout)
    assert found and float(found[1]) > 0, out.stdout
    parted = found[2].split()
    assert len(parted) == 2 and all(p == "never" or float(p) >= 0 for p in parted), out.stdout
