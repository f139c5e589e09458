"""Ranks that outnumber their cores, kept evenly spread over them.

With more ranks on a host than cores (4 ranks on 2), a collective runs at the pace of its most
crowded core. The scheduler starts the ranks two a core, but a short burst of other work can
leave them three on one core and one on the other, and Linux's load balancer may take tens of
milliseconds to undo that: it leaves a task that ran within the last half millisecond where its
cache is (sched_migration_cost), and ranks that hand a core to each other all the time always
did. Measured on a 2-core VM, 4 ranks, rows of ~5-10 ms of 64 KiB calls (600 rows, the rank
placement read at each row's end): rows that ended three-and-one ran 1.5-2.4x the median row,
those that ended two-and-two 1.00x, and a three-and-one placement lasted up to nine rows in a row
(ftrace showed the VM's agent taking a core for 3 ms, then a rank moved and kept there).

So each rank, at the start of a call and at most every PERIOD_S, reads the CPU where each of
its host's ranks last ran (/proc/PID/stat field 39, kept open; sched_getcpu for itself). If its
own CPU holds two or more of them more than another CPU it may use, it moves itself there:
sched_setaffinity to that one CPU (the kernel migrates it at once), then back to its own mask
(which leaves it where it is). Only the rank that runs moves, and it moves only itself; the
others see the new placement at their next check. A move that the scheduler undoes (a busy
process the ranks do not see may make three-and-one the fair placement) doubles the pause
before the next check, up to HOLD_MAX_S; a check that finds the ranks even resets it.

Off where the ranks do not outnumber the cores, where this rank may use only one CPU
(`ringcomm-run --bind core` pins each rank: the user chose), where /proc or sched_getcpu is
missing, and with RINGCOMM_BALANCE=0.
"""
from __future__ import annotations

import os
import time

from ringcomm.transport.base import current_cpu

from .env import env_switch, oversubscribed

PERIOD_S = 4e-3      # between checks: 3-5 preads of ~3 us each, ~0.4% of a rank's time at most
HOLD_S = 20e-3       # after a move, before the next check ...
HOLD_MAX_S = 1.0     # ... doubled at each move in a row, up to this


class CoreBalance:
    """Moves this rank off a CPU that holds too many of its host's ranks (see above).
    ``peers``: the pids of the other ranks on this host."""

    def __init__(self, peers: list[int]):
        self.fds = [os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC) for pid in peers]
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
        if len(os.sched_getaffinity(0)) < 2 or not oversubscribed(len(peers) + 1):
            return None
        try:
            return cls(peers)
        except OSError:  # no /proc here, or a peer already gone: nothing to balance
            return None

    def tick(self) -> None:
        """At the start of a call: check the placement if PERIOD_S has passed since the last."""
        now = time.monotonic()
        if now < self._next:
            return
        if self.check():
            self._next = now + self._hold
            self._hold = min(self._hold * 2, HOLD_MAX_S)
        else:
            self._next = now + PERIOD_S
            self._hold = HOLD_S

    def placement(self, cpus, mine: int) -> dict[int, int]:
        """How many of the host's ranks (this one, on CPU ``mine``, included) last ran on each of
        ``cpus``."""
        count = dict.fromkeys(cpus, 0)
        if mine in count:
            count[mine] += 1
        for fd in self.fds:
            try:
                fields = os.pread(fd, 1024, 0).rsplit(b")", 1)[-1].split()
            except OSError:  # that rank has exited: it needs no core
                continue
            if len(fields) > 36 and int(fields[36]) in count:  # fields[36] is field 39, processor
                count[int(fields[36])] += 1
        return count

    def check(self) -> bool:
        """Move this rank to the least crowded CPU if its own holds two or more ranks more; True
        if it moved."""
        cpus = os.sched_getaffinity(0)  # read each time: the program may have changed it (~1 us)
        mine = current_cpu()
        count = self.placement(cpus, mine)
        target = min(sorted(count), key=count.__getitem__)
        if mine not in count or count[mine] < count[target] + 2:
            return False
        try:
            os.sched_setaffinity(0, {target})
        except OSError:  # the CPU went offline, or a cgroup forbids it: stay
            return False
        finally:
            os.sched_setaffinity(0, cpus)
        self.moves += 1
        return True

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
