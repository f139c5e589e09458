"""Small all_reduce latency, idle against loaded, side by side in one run (issue 12, point 5).

    python examples/loaded_latency.py [--ranks 2] [--bytes 8] [--reps 5] [--hogs 2] [--peer mpi]

Each repetition times the same all_reduce twice: with the machine as it is ("idle"), then with
``--hogs`` busy processes at nice 10 (``while 1: pass``) sharing the cores ("loaded"), the hogs
killed afterwards. A timing is the median over blocks of 100 calls of the block's mean time per
call on rank 0 (a block absorbs the clock's cost; the median keeps one scheduler stall from
deciding the figure). ringcomm ranks are started by ``ringcomm-run``; with ``--peer mpi`` MPICH's
(mpi4py) figure is taken in the same repetition, right after ringcomm's, under the same load.
Prints one line per repetition and the medians, and loaded / idle for each library. Each block
also notes where every rank ran (sched_getcpu after it); a repetition whose ranks were crowded on
one CPU in some block (two ranks with a core each on one core, say) is flagged with the share of
such blocks: the slow repetitions under load were those (ringcomm/core_balance.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import os, sys, time
import numpy as np
lib, nbytes, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = np.ones(max(1, nbytes // 4), np.float32)
if lib == "mpi":
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    y = np.empty_like(x)
    rank, call, barrier = comm.rank, (lambda: comm.Allreduce(x, y)), comm.Barrier
    size, gather = comm.size, (lambda a, b: comm.Allgather(a, b))
else:
    import ringcomm
    comm = ringcomm.init()
    rank, call, barrier = comm.rank, (lambda: comm.all_reduce(x)), comm.barrier
    size, gather = comm.world_size, comm.all_gather
for _ in range(200):
    call()
barrier()
from ringcomm.transport.base import current_cpu
blocks, cpus = [], []
for _ in range(calls // 100):
    t0 = time.perf_counter()
    for _ in range(100):
        call()
    blocks.append((time.perf_counter() - t0) / 100)
    cpus.append(current_cpu())
blocks.sort()
mine, every = np.array(cpus, np.int64), np.empty(len(cpus) * size, np.int64)
gather(mine, every)
if rank == 0:
    # a block is crowded where some CPU held more of the ranks than an even spread puts on one
    from ringcomm.core_balance import crowded as over_even
    ncpus = len(os.sched_getaffinity(0))
    rows = every.reshape(size, -1).T
    crowded = sum(1 for row in rows if over_even(row, ncpus)) / len(rows)
    print("RESULT", blocks[len(blocks) // 2] * 1e6, crowded, flush=True)
if lib != "mpi":
    comm.close()
"""


def run(lib: str, ranks: int, nbytes: int, calls: int, worker: str) -> tuple[float, float]:
    """(median time per call in us, share of blocks in which the ranks were crowded on a CPU)."""
    py = sys.executable
    args = [worker, lib, str(nbytes), str(calls)]
    if lib == "mpi":
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(py)) or shutil.which("mpiexec")
        cmd = [mpiexec, "-n", str(ranks), py] + args
    else:
        cmd = [py, "-m", "ringcomm.launch", "--nproc-per-node", str(ranks)] + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if "RESULT " in line:  # ringcomm-run prefixes "[rank 0] "
            us, crowded = line.split("RESULT ")[1].split()
            return float(us), float(crowded)
    raise RuntimeError(f"{lib} run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--peer", action="append", default=[], choices=["mpi"])
    a = ap.parse_args()
    libs = ["ringcomm"] + a.peer
    got = {(lib, load): [] for lib in libs for load in ("idle", "loaded")}
    stacked = dict.fromkeys(got, 0)    # repetitions with ranks crowded on a CPU in some block
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    try:
        measure(a, libs, got, stacked, f.name)
    finally:
        os.unlink(f.name)
    with open("/proc/loadavg") as f:
        print(f"# {a.ranks} ranks, {a.bytes} B all_reduce, {a.hogs} nice-10 hogs when loaded; load now {f.read().split()[0]}")
    for lib in libs:
        idle, loaded = statistics.median(got[lib, "idle"]), statistics.median(got[lib, "loaded"])
        print(f"{lib:9s} median idle {idle:8.1f} us   loaded {loaded:8.1f} us   loaded/idle {loaded / idle:5.2f}x"
              f"   runs loaded: {', '.join(f'{v:.1f}' for v in got[lib, 'loaded'])}"
              f"   crowded runs idle / loaded: {stacked[lib, 'idle']} / {stacked[lib, 'loaded']}")


def measure(a, libs, got, stacked, worker) -> None:
    notes = []
    for rep in range(a.reps):
        for load in ("idle", "loaded"):
            procs = hogs(a.hogs) if load == "loaded" else []
            try:
                time.sleep(0.2 if procs else 0)  # let the hogs reach their busy loop
                for lib in libs:
                    us, crowded = run(lib, a.ranks, a.bytes, a.calls, worker)
                    got[lib, load].append(us)
                    if crowded:
                        stacked[lib, load] += 1
                        notes.append(f"{lib} {load}: ranks crowded on a CPU in {crowded:.0%} of blocks")
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        print(f"rep {rep}: " + "  ".join(f"{lib} {load} {got[lib, load][-1]:.1f} us"
                                         for lib in libs for load in ("idle", "loaded"))
              + "".join(f"  [{n}]" for n in notes), flush=True)
        notes.clear()


if __name__ == "__main__":
    main()
