"""How long ranks stay crowded on one CPU after something put them there and then set them free.

    ringcomm-run -n 2 examples/unstack.py [--episodes 12] [--every-s 0.4] [--pin-calls 50] [--bytes 8]

Every --every-s, rank 0 crowds the ranks (two ranks: both on the first CPU they may use; more:
all but the last there, the last on the second CPU, as three-and-one on two cores), they make
--pin-calls all_reduces of --bytes crowded so, and rank 0 gives every rank its whole CPU mask back.
From that moment nothing keeps them together, but nothing pulls them apart either: Linux's
balancer leaves a task that ran in the last 0.5 ms where it is, and ranks that hand a core to
each other always did. ringcomm's core balance (ringcomm/core_balance.py) checks the placement now
and then; RINGCOMM_BALANCE=0 leaves it to the scheduler.

Every rank records the CPU it is on after each call. Rank 0 prints, for each crowding, how long
after the release the ranks were spread again: the first of SPREAD_CALLS calls in a row after which
no CPU held more ranks than an even spread puts there. Needs two CPUs or more.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringcomm
from ringcomm.core_balance import crowded
from ringcomm.transport.base import current_cpu

SPREAD_CALLS = 50   # this many calls in a row with the ranks spread: they are apart again


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=12, help="how many times the ranks are crowded")
    p.add_argument("--every-s", type=float, default=0.4, help="seconds between crowdings")
    p.add_argument("--pin-calls", type=int, default=50, help="calls made while crowded")
    p.add_argument("--bytes", type=int, default=8, help="the all_reduce's size (float32; default 8)")
    a = p.parse_args()
    if a.episodes < 1 or a.pin_calls < 0:
        p.error("--episodes must be 1 or more, --pin-calls 0 or more")
    with ringcomm.init() as comm:
        mask = sorted(os.sched_getaffinity(0))
        if len(mask) < 2 or current_cpu() < 0:
            raise SystemExit("unstack.py: needs two CPUs or more, and sched_getcpu")
        ends, cpus, releases = run(comm, a, mask)
        every = np.empty(comm.world_size * cpus.size, np.int64)
        comm.all_gather(cpus, every)
        if comm.rank == 0:
            print(report(ends, every.reshape(comm.world_size, cpus.size), releases, len(mask)), flush=True)


def run(comm, a, mask):
    """This rank's end time and CPU after every call, and the call indices at which the ranks
    were set free."""
    count = max(1, a.bytes // 4)
    x, y = np.ones(count, np.float32), np.empty(count, np.float32)
    for _ in range(500):                                        # warm: compiled paths, remembered calls
        comm.all_reduce(x, out=y)
    pids = np.empty(comm.world_size, np.int64)
    comm.all_gather(np.array([os.getpid()], np.int64), pids)
    n = comm.world_size
    stacked = [{mask[0]}] * n if n == 2 else [{mask[0]}] * (n - 1) + [{mask[1]}]
    ends, cpus, releases, due = [], [], [], np.zeros(1, np.int64)
    next_at = time.perf_counter() + a.every_s
    while len(releases) < a.episodes or len(ends) < releases[-1] + 20 * SPREAD_CALLS:
        if len(ends) % 16 == 0 and len(releases) < a.episodes:   # rank 0 says when; all stay in step
            due[0] = comm.rank == 0 and time.perf_counter() >= next_at
            comm.broadcast(due, 0)
            if due[0]:
                pin(comm, pids, stacked)
                for _ in range(a.pin_calls):
                    comm.all_reduce(x, out=y)
                pin(comm, pids, [set(mask)] * n)
                releases.append(len(ends))
                next_at = time.perf_counter() + a.every_s
        comm.all_reduce(x, out=y)
        if y[0] != n:
            raise SystemExit(f"rank {comm.rank}: all_reduce gave {y[0]}, not {n}")
        ends.append(time.perf_counter())
        cpus.append(current_cpu())
    return np.array(ends), np.array(cpus, np.int64), releases


def pin(comm, pids, masks) -> None:
    """Rank 0 gives rank i the CPU mask ``masks[i]``, between two barriers."""
    comm.barrier()
    if comm.rank == 0:
        for pid, cpus in zip(pids, masks):
            os.sched_setaffinity(int(pid), cpus)
    comm.barrier()


def report(ends: np.ndarray, cpus: np.ndarray, releases: list, ncpus: int) -> str:
    """``cpus``: (ranks, calls), where each rank was after each call."""
    spread = [not crowded(col, ncpus) for col in cpus.T]
    took = [spread_ms(ends, spread, r) for r in releases]
    known = [v for v in took if v is not None]
    lines = [f"median call {np.median(np.diff(ends)) * 1e6:.2f} us; ranks spread again after (ms): "
             + " ".join("never" if v is None else f"{v:.1f}" for v in took)]
    if known:
        lines.append(f"spread again after: median {np.median(known):.1f} ms, max {max(known):.1f} ms, "
                     f"{len(known)} of {len(took)} crowdings")
    return "\n".join(lines)


def spread_ms(ends, spread, released: int) -> float | None:
    """Milliseconds from the release to the first of SPREAD_CALLS calls in a row with the ranks spread."""
    run = 0
    for i in range(released, len(spread)):
        run = run + 1 if spread[i] else 0
        if run == SPREAD_CALLS:
            return (ends[i - SPREAD_CALLS + 1] - ends[released]) * 1e3
    return None


if __name__ == "__main__":
    main()
