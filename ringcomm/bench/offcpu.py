"""Who took a rank's core: the stretches a rank spent off its CPU, read from the kernel's scheduler trace.

A benchmark row that takes twice its median is nearly always a rank that lost its core: the peer
that waits for it spins or sleeps, and the call's time is the absent rank's. Record the
scheduler's switches while a benchmark runs, then read them here::

    perf record -k CLOCK_MONOTONIC -e sched:sched_switch -a -o sched.data -- sleep 20
                   # beside ringcomm-bench, or ringcomm-run -n 2 examples/slow_calls.py
    perf script -i sched.data [--time START,END] > sched.txt
    python -m ringcomm.bench.offcpu sched.txt                           # the 2 busiest python3 threads

With ``-k CLOCK_MONOTONIC`` the trace's times are those of ringcomm-bench's ``run_spans`` (--json:
when each run's timed calls began and ended), so ``--time`` cuts out exactly a slow run.

Each stretch over --min-us is printed with the state the rank left in (R: preempted, still
runnable; S: it slept, e.g. on a futex; D: uninterruptible, e.g. a page fault on a file) and what
ran on its CPU meanwhile ("RANK" for another of the ranks read: two ranks sharing one core). On
the 2-core dev VM this named DAMON's kernel thread (docs/06 "Slow runs").
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass, field

SWITCH = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:\s+prev_comm=(.*?) prev_pid=(\d+) "
                    r"prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")


@dataclass(frozen=True)
class Switch:
    cpu: int
    t: float                # seconds (the trace's clock)
    prev_comm: str
    prev_tid: int
    prev_state: str
    next_comm: str
    next_tid: int


@dataclass
class Stretch:
    tid: int
    start: float
    state: str              # the state the thread left its CPU in
    cpu: int                # the CPU it left
    back_on: int = -1       # the CPU it came back on
    seconds: float = 0.0
    ran: collections.Counter = field(default_factory=collections.Counter)   # who ran on `cpu` meanwhile


def parse(lines) -> list[Switch]:
    """The sched_switch events of `perf script` output (other lines are skipped)."""
    out = []
    for line in lines:
        m = SWITCH.search(line)
        if m:
            out.append(Switch(int(m[1]), float(m[2]), m[3], int(m[4]), m[5], m[6], int(m[7])))
    return out


def busiest(switches: list[Switch], comm: str, n: int) -> list[int]:
    """The ``n`` threads named ``comm`` that were switched out most often (spinning ranks are)."""
    count = collections.Counter(s.prev_tid for s in switches if s.prev_comm == comm)
    return [tid for tid, _ in count.most_common(n)]


def stretches(switches: list[Switch], tids: list[int], min_seconds: float = 0.0) -> list[Stretch]:
    """Every stretch one of ``tids`` spent off-CPU (from its switch-out to its next switch-in), in
    trace order, keeping those of at least ``min_seconds``."""
    away: dict[int, Stretch] = {}
    done = []
    for s in switches:
        if s.prev_tid in tids:
            away[s.prev_tid] = Stretch(s.prev_tid, s.t, s.prev_state, s.cpu)
        for st in away.values():
            if st.cpu == s.cpu and s.next_tid != st.tid:
                st.ran["RANK" if s.next_tid in tids else s.next_comm] += 1
        st = away.pop(s.next_tid, None)
        if st is not None:
            st.seconds, st.back_on = s.t - st.start, s.cpu
            if st.seconds >= min_seconds:
                done.append(st)
    return done


def summary(found: list[Stretch]) -> list[str]:
    """One line per stretch, then how many stretches each thief was seen in."""
    lines = [f"{st.start:.4f}  tid {st.tid}  {st.seconds * 1e6:7.0f} us off  left {st.state:<3} cpu {st.cpu}->"
             f"{st.back_on}  ran meanwhile: " + ", ".join(f"{k} x{v}" for k, v in st.ran.most_common())
             for st in found]
    thieves = collections.Counter(k for st in found for k in st.ran)
    lines.append(f"{len(found)} stretches; seen running in them: "
                 + (", ".join(f"{k} {v}" for k, v in thieves.most_common()) or "nothing"))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringcomm.bench.offcpu", description=__doc__.split("\n")[0])
    p.add_argument("trace", help="`perf script` output of a sched:sched_switch recording ('-': stdin)")
    p.add_argument("--comm", default="python3", help="the ranks' thread name (default python3)")
    p.add_argument("--ranks", type=int, default=2, help="how many of its busiest threads are ranks (default 2)")
    p.add_argument("--tid", type=int, action="append", help="a rank's thread id (instead of --comm/--ranks)")
    p.add_argument("--min-us", type=float, default=500.0, help="shortest stretch to print (default 500 us)")
    a = p.parse_args(argv)
    with (sys.stdin if a.trace == "-" else open(a.trace)) as f:
        switches = parse(f)
    tids = a.tid or busiest(switches, a.comm, a.ranks)
    if not tids:
        print(f"no sched_switch of a thread named {a.comm!r} in {a.trace}", file=sys.stderr)
        return 1
    print(f"ranks' threads: {tids}")
    print("\n".join(summary(stretches(switches, tids, a.min_us * 1e-6))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
