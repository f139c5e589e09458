"""A host's ranks kept spread over its cores: never two busy on one core while another has fewer.

With more ranks on a host than cores (4 ranks on 2), a collective runs at the pace of its most
crowded core. The scheduler starts the ranks two a core, but a short burst of other work can
leave them three on one core and one on the other, and Linux's load balancer may take tens of
milliseconds to undo that: it leaves a task that ran within the last half millisecond where its
cache is (sched_migration_cost), and ranks that hand a core to each other all the time always
did. Measured on a 2-core VM, 4 ranks, rows of ~5-10 ms of 64 KiB calls (600 rows, the rank
placement read at each row's end): rows that ended three-and-one ran 1.5-2.4x the median row,
those that ended two-and-two 1.00x, and a three-and-one placement lasted up to nine rows in a row
(ftrace showed the VM's agent taking a core for 3 ms, then a rank moved and kept there).

A core per rank does not always make it the scheduler's job alone. With busy processes on the
other core, two ranks put on one core take turns there (both pinned to one CPU: an 8-byte
all_reduce 14 us a call, against 2.2), and the balancer sees a core shared by two ranks that are
each half idle against one held by processes that never stop. 2 ranks, 8-byte all_reduce, two
nice-10 busy processes (examples/loaded_latency.py --peer mpi, each 100-call block's CPUs
recorded): with the balance off, 5 of 64 repetitions ran at 19-24 us a call for the whole
repetition, the others at 1.9-2.2 (MPICH 1.4); in each slow one whose placement was recorded the
two ranks shared a CPU in every block. With the balance on, 1 of 64 ran at 9.7 us and none shared
a CPU in any recorded block.

So each rank, at the start of a call and at most every PERIOD_S, reads the CPU where each of
its host's ranks last ran and whether it is runnable (/proc/PID/stat fields 39 and 3, kept open;
sched_getcpu for itself). If its own CPU has two or more runnable ranks more than another CPU it
may use has ranks at all, it moves itself there: sched_setaffinity to that one CPU (the kernel
migrates it at once), then back to its own mask (which leaves it where it is). Only the rank that
runs moves, and it moves only itself; the others see the new placement at their next check. A
sleeping rank counts where it last ran but not in the crowd: it may wake elsewhere.

Why every 20 ms and not more often: a check costs ~8 us on a quiet core and ~40 us between
stacked ranks (three preads of /proc, whose text the kernel formats), and while one rank checks
the whole ring waits for it. Every 4 ms, 4 ranks, 1 MiB all_reduce: 469-498 us a call against
443-465 with the balance off, and as much with the moves disabled; every 20 ms the two were level
within the runs' noise, and no 64 KiB row ran over 2x its median in six runs of 600 rows. With a
core per rank a check is cheap (~4 us, one /proc read per peer) and nobody waits behind a
stacked rank for it, so it runs every FREE_PERIOD_PER_PEER_S per peer on the host (2 ranks: every
5 ms). That is what ends a stacked pair soon. examples/unstack.py pins two ranks of 8-byte
all_reduces to one CPU for 50 calls every 0.4 s, gives them their whole mask back, and times how
long until they run on two CPUs again (Intel VM, 12 crowdings a run): balance off, a median 11.2 ms
(max 21.9; Linux's balancer leaves a task that ran within the last 0.5 ms where it is); every 5 ms,
1.3 (max 4.7). An earlier version that judged by the calls' pace found 13.3 ms (max 19.5) with
checks every 100 ms, 8.6 every 20, 4.8 every 10, 1.0 every 5, 0.9 every 2. The 8-byte
all_reduce's median stayed level (1M calls a run, 100 ms against 5 ms: 2.13-2.20 against
2.14-2.32 us), its p99.9 went from 9-23 to 15-18 us (a check, ~4 us, now falls in one call of
~2300). (4 ranks on 2 cores, 16 KiB all_reduces, three-and-one for 20 calls: even again after a
median 3.5 ms, max 15.3, with the 20 ms checks; 34.4, max 140, with the balance off.) Between checks a call pays
one comparison of the communicator's call count with the count at which tick() is next due (tick
returns how many calls that is, from their recent pace): a clock read every call had cost an
8-byte all_reduce 0.1 us of its 2.2.

A move that the scheduler undoes (a busy process the ranks do not see may make three-and-one
the fair placement) doubles the pause before the next check, from HOLD_S up to HOLD_MAX_S; a
check that finds the ranks even resets it.

Off where this rank may use only one CPU (`ringcomm-run --bind core` pins each rank: the user
chose), on a communicator that holds only some of the host's ranks (LOCAL_WORLD_SIZE; a `split`:
it would count too few), with a core per rank above FREE_MAX_RANKS ranks on the host (a check
reads every peer's /proc file), where /proc or sched_getcpu is missing, and with
RINGCOMM_BALANCE=0.
"""
from __future__ import annotations

import collections
import os
import time

from ringcomm.transport.base import CpuWatch, current_cpu

from .env import env_switch, oversubscribed

PERIOD_S = 20e-3     # between checks where ranks outnumber cores (see above for why not less)
FREE_PERIOD_PER_PEER_S = 5e-3  # between checks with a core per rank: this much per peer on the host
FREE_MAX_RANKS = 8   # with a core per rank, balanced up to this many ranks on the host
MAX_STRIDE = 64      # calls between two looks at the clock, at most
HOLD_S = 40e-3       # after a move, before the next check ...
HOLD_MAX_S = 1.0     # ... doubled at each move in a row, up to this


class CoreBalance:
    """Moves this rank off a CPU that holds too many of its host's ranks (see above).
    ``peers``: the pids of the other ranks on this host."""

    def __init__(self, peers: list[int], period: float = PERIOD_S):
        self.watches = [(pid, CpuWatch()) for pid in peers]
        self.period = period
        self._stride = 1          # the calls between the last two ticks
        self._last = time.monotonic()
        for pid, watch in self.watches:
            watch.where(pid)      # opens its stat file now: OSError where /proc or the peer is missing
        self.moves = 0            # how many times this rank moved itself (read by tests and benchmarks)
        self._next = 0.0          # time.monotonic() of the next check
        self._hold = HOLD_S

    @classmethod
    def for_host(cls, entries: list[dict], rank: int) -> CoreBalance | None:
        """The balance for ``rank`` given the roster's entries (pid and host of every rank), or
        None where it is off (see the module's docstring)."""
        me = entries[rank]
        peers = [e["pid"] for r, e in enumerate(entries) if r != rank and e["host"] == me["host"]]
        if not env_switch("RINGCOMM_BALANCE") or not peers or current_cpu() < 0:
            return None
        crowded = oversubscribed(len(peers) + 1)
        if len(os.sched_getaffinity(0)) < 2 or (not crowded and len(peers) + 1 > FREE_MAX_RANKS):
            return None
        if len(peers) + 1 < int(os.environ.get("LOCAL_WORLD_SIZE") or 0):
            return None  # a split that holds some of the host's ranks: it cannot see all who compete
        try:
            return cls(peers, PERIOD_S if crowded else free_period(len(peers)))
        except OSError:  # no /proc here, or a peer already gone: nothing to balance
            return None

    def tick(self) -> int:
        """At the start of a call the last tick said was due: check the placement if the period
        has passed since the last check; return the calls that should take until the next one, at
        the pace of those since the last tick (1 to MAX_STRIDE)."""
        now = time.monotonic()
        per_call = (now - self._last) / self._stride
        self._last = now
        if now >= self._next:
            if self.check():
                self._next = now + self._hold
                self._hold = min(self._hold * 2, HOLD_MAX_S)
            else:
                self._next = now + self.period
                self._hold = HOLD_S
        due = (self._next - now) / per_call if per_call > 0 else MAX_STRIDE
        self._stride = max(1, min(MAX_STRIDE, round(due)))
        return self._stride

    def placement(self, cpus, mine: int) -> tuple[int, dict[int, int]]:
        """(crowd, count): how many of the host's ranks are runnable on CPU ``mine`` now (this
        one, which runs there, included), and how many last ran on each of ``cpus`` whatever
        their state. A sleeping rank's CPU is only where it last ran, not where it will wake, so
        the crowd counts only runnable ones ("R")."""
        count = dict.fromkeys(cpus, 0)
        crowd = 1
        if mine in count:
            count[mine] += 1
        for pid, watch in self.watches:
            try:
                state, cpu = watch.where(pid)
            except OSError:  # that rank has exited: it needs no core
                continue
            if cpu in count:
                count[cpu] += 1
            crowd += cpu == mine and state == b"R"
        return crowd, count

    def check(self) -> bool:
        """Move this rank to the least crowded CPU it may use if it should (``target``); True if it moved."""
        cpus = os.sched_getaffinity(0)  # read each time: the program may have changed it (~1 us)
        mine = current_cpu()
        where = target(mine, *self.placement(cpus, mine))
        if where is None:
            return False
        try:
            os.sched_setaffinity(0, {where})
        except OSError:  # the CPU went offline, or a cgroup forbids it: stay
            return False
        finally:
            os.sched_setaffinity(0, cpus)
        self.moves += 1
        return True

    def close(self) -> None:
        for _, watch in self.watches:
            watch.close()
        self.watches = []


def free_period(peers: int) -> float:
    """Seconds between checks with a core per rank and ``peers`` other ranks on the host: a check
    reads one /proc file per peer, so its cost, and the pause between checks, grow with them."""
    return FREE_PERIOD_PER_PEER_S * max(1, peers)


def crowded(cpus, ncpus: int) -> bool:
    """Whether ranks seen on ``cpus`` (a CPU number each; -1, unknown, left out) crowd a CPU: some
    CPU holds more of them than an even spread over ``ncpus`` CPUs puts on one. What the examples
    that measure placement (loaded_latency.py, unstack.py) count."""
    seen = [int(c) for c in cpus if c >= 0]
    return bool(seen) and max(collections.Counter(seen).values()) > -(-len(cpus) // max(1, ncpus))


def target(mine: int, crowd: int, count: dict[int, int]) -> int | None:
    """Where a rank on CPU ``mine`` should move, given ``crowd`` ranks runnable there (itself
    included) and ``count`` ranks last placed on each CPU it may use: the CPU with the fewest,
    if that is two or more fewer than the crowd (one fewer would only swap the two CPUs' loads),
    else None."""
    if mine not in count:
        return None
    least = min(sorted(count), key=count.__getitem__)
    return least if crowd >= count[least] + 2 else None
