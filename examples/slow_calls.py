"""Time small all_reduces one by one and show the slow ones, with what this rank's process went through.

    ringcomm-run -n 2 examples/slow_calls.py [--calls 1000000] [--bytes 8] [--over-us 100]

Every rank times each call alone. For each call over --over-us it reads getrusage before and after:
major faults (a page read back from disk), minor faults, and voluntary / involuntary context
switches (the rank slept in a wait / was preempted). A slow call with none of them was a wait for a
peer that lost its core: find who took it with ``python -m ringcomm.bench.offcpu`` on a scheduler
trace recorded beside this run (docs/06 "Slow runs"). Each rank prints its median, p99.9, the count
of slow calls and the worst ones.
"""
from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import ringcomm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--bytes", type=int, default=8, help="the all_reduce's size (float32; default 8)")
    p.add_argument("--over-us", type=float, default=100.0, help="a call this slow is listed (default 100)")
    p.add_argument("--show", type=int, default=10, help="how many of the slowest calls to list")
    a = p.parse_args()
    with ringcomm.init() as comm:
        report(comm, a)


def report(comm, a) -> None:
    x = np.ones(max(1, a.bytes // 4), np.float32)
    y = np.empty_like(x)
    for _ in range(2000):                       # warm: compiled paths, remembered calls
        comm.all_reduce(x, out=y)
    clock, usage, me = time.perf_counter, resource.getrusage, resource.RUSAGE_SELF
    times, slow, limit = np.empty(a.calls), [], a.over_us * 1e-6
    for i in range(a.calls):
        before, t = usage(me), clock()
        comm.all_reduce(x, out=y)
        times[i] = took = clock() - t
        if took > limit:
            after = usage(me)
            slow.append((took, i, after.ru_majflt - before.ru_majflt, after.ru_minflt - before.ru_minflt,
                         after.ru_nvcsw - before.ru_nvcsw, after.ru_nivcsw - before.ru_nivcsw))
    if y[0] != comm.world_size:
        raise SystemExit(f"rank {comm.rank}: all_reduce gave {y[0]}, not {comm.world_size}")
    lines = [f"rank {comm.rank}: {a.calls} calls of {x.nbytes} B, median {np.median(times) * 1e6:.2f} us, "
             f"p99.9 {np.percentile(times, 99.9) * 1e6:.1f} us, max {times.max() * 1e6:.0f} us; "
             f"{len(slow)} over {a.over_us:g} us, {sum(1 for s in slow if s[2])} of them with a major fault"]
    for took, i, majflt, minflt, vcsw, ivcsw in sorted(slow, reverse=True)[:a.show]:
        lines.append(f"  call {i}: {took * 1e6:.0f} us  major faults {majflt}  minor {minflt}  "
                     f"slept {vcsw}x  preempted {ivcsw}x")
    print("\n".join(lines), flush=True)
    comm.barrier()


if __name__ == "__main__":
    main()
