"""How long two ranks stay on one CPU after something put them there, and then set them free.

    ringcomm-run -n 2 examples/unstack.py [--episodes 12] [--every-s 0.4] [--pin-calls 50]

Every --every-s, rank 0 pins every rank to the first CPU it may use (the kernel moves them there
at once), the ranks make --pin-calls 8-byte all_reduces stacked there, and rank 0 gives every rank
its whole CPU mask back. From that moment nothing keeps them together, but nothing pulls them
apart either: Linux's balancer leaves a task that ran in the last 0.5 ms where it is, and ranks
that hand a core to each other always did. ringcomm's core balance (ringcomm/core_balance.py)
checks the placement now and then; RINGCOMM_BALANCE=0 leaves it to the scheduler.

Rank 0 prints, for each stacking, how long after the release the ranks ran apart: until the first
200 calls in a row that each took under 4x the median call. Needs two CPUs or more.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringcomm

APART_CALLS = 200   # this many calls in a row at a normal pace: the ranks are apart again
SLOW = 4.0          # a call over this many median calls is not at a normal pace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=12, help="how many times the ranks are stacked")
    p.add_argument("--every-s", type=float, default=0.4, help="seconds between stackings")
    p.add_argument("--pin-calls", type=int, default=50, help="calls made while stacked")
    a = p.parse_args()
    with ringcomm.init() as comm:
        ends, releases = run(comm, a)
        if comm.rank == 0:
            print(report(ends, releases), flush=True)


def run(comm, a):
    """Every call's end time on this rank, and the call indices at which the ranks were set free."""
    x, y = np.ones(2, np.float32), np.empty(2, np.float32)
    for _ in range(2000):                                       # warm: compiled paths, remembered calls
        comm.all_reduce(x, out=y)
    pids = np.empty(comm.world_size, np.int64)
    comm.all_gather(np.array([os.getpid()], np.int64), pids)
    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        raise SystemExit("unstack.py: this rank may use one CPU only: nothing to stack onto or apart from")
    ends, releases, due = [], [], np.zeros(1, np.int64)
    next_at = time.perf_counter() + a.every_s
    while len(releases) < a.episodes:
        if len(ends) % 64 == 0:                                 # rank 0 says when; all stay in step
            due[0] = comm.rank == 0 and time.perf_counter() >= next_at
            comm.broadcast(due, 0)
            if due[0]:
                stack(comm, pids, {min(mask)}, x, y, a.pin_calls)
                stack(comm, pids, mask, x, y, 0)
                releases.append(len(ends))
                next_at = time.perf_counter() + a.every_s
        comm.all_reduce(x, out=y)
        if y[0] != comm.world_size:
            raise SystemExit(f"rank {comm.rank}: all_reduce gave {y[0]}, not {comm.world_size}")
        ends.append(time.perf_counter())
    for _ in range(APART_CALLS * 50):                           # the last stacking's calls after it
        comm.all_reduce(x, out=y)
        ends.append(time.perf_counter())
    return np.array(ends), releases


def stack(comm, pids, cpus, x, y, calls: int) -> None:
    """Rank 0 gives every rank the CPU mask ``cpus``; then ``calls`` all_reduces; then a barrier."""
    comm.barrier()
    if comm.rank == 0:
        for pid in pids:
            os.sched_setaffinity(int(pid), cpus)
    comm.barrier()
    for _ in range(calls):
        comm.all_reduce(x, out=y)
    comm.barrier()


def report(ends: np.ndarray, releases: list) -> str:
    took = np.diff(ends)
    median = float(np.median(took))
    apart = [apart_ms(ends, took, r, median) for r in releases]
    known = [v for v in apart if v is not None]
    lines = [f"median call {median * 1e6:.2f} us; ranks apart again after (ms): "
             + " ".join("never" if v is None else f"{v:.1f}" for v in apart)]
    if known:
        lines.append(f"apart after: median {np.median(known):.1f} ms, max {max(known):.1f} ms, "
                     f"{len(known)} of {len(apart)} stackings")
    return "\n".join(lines)


def apart_ms(ends, took, released: int, median: float) -> float | None:
    """Milliseconds from the release to the first of APART_CALLS calls in a row at a normal pace."""
    run = 0
    for i in range(released, len(took)):
        run = run + 1 if took[i] < SLOW * median else 0
        if run == APART_CALLS:
            return (ends[i - APART_CALLS + 1] - ends[released]) * 1e3
    return None


if __name__ == "__main__":
    main()
