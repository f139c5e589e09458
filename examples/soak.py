"""Soak: thousands of random collectives, every result checked, memory watched.

    ringcomm-run -n 4 examples/soak.py --iterations 10000

Every rank draws the same random sequence of (collective, count, dtype, op,
algorithm, root, in place), builds every rank's input from the iteration number,
so it can compute the exact expected result itself, and counts wrong elements.
Resident memory is read after a warm-up and at the end; rank 0 prints the summary.
"""
import argparse
import random
import sys
import time

import ml_dtypes
import numpy as np

import ringcomm
from ringcomm.kernels.host import reference_reduce

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.uint8,
          np.int32, np.uint32, np.int64, np.uint64]
COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
               "scatter"]
BLOCKS = {"all_to_all": [None, "pairwise", "bruck"], "gather": [None, "linear", "binomial"],
          "scatter": [None, "linear", "binomial"]}
TREES = {"all_reduce", "broadcast", "reduce"}


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_input(i, rank, size, dtype, op):
    rng = np.random.default_rng([i, rank])
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=size, dtype=dt, endpoint=True)
    if op == "prod":
        return rng.choice(np.array([-2, -1, 1, 2], np.float32), size=size).astype(dt)
    return rng.integers(-4, 5, size=size).astype(dt)


def expected(op, inputs):
    dt = inputs[0].dtype
    if op != "avg" or dt.kind in "iu":
        return reference_reduce(inputs, op)
    return (np.sum([x.astype(np.float64) for x in inputs], axis=0) / len(inputs)).astype(dt)


def wrong(got, want, op):
    if op == "avg" and got.dtype.kind not in "iu":  # one rounding of the quotient
        g, w = got.astype(np.float64), want.astype(np.float64)
        return int((np.abs(g - w) > 2 ** -7 * np.abs(w)).sum())
    return int((got != want).sum())


def blocks(comm, i, rnd, coll, dtype, count):
    """all_to_all (half the time with random packed counts, zeros among them), gather, scatter."""
    n, r = comm.world_size, comm.rank
    algo, root, packed = rnd.choice(BLOCKS[coll]), rnd.randrange(n), rnd.random() < 0.5
    if coll == "all_to_all":
        c = [[rnd.randrange(0, 2 * count + 1) if packed else count for _ in range(n)] for _ in range(n)]
        ins = [make_input(i, k, sum(c[k]), dtype, "sum") for k in range(n)]
        want = np.concatenate([ins[k][sum(c[k][:r]):sum(c[k][:r + 1])] for k in range(n)])
        kw = dict(send_counts=c[r], recv_counts=[row[r] for row in c]) if packed else {}
        got = comm.all_to_all(ins[r], np.empty_like(want), algo="pairwise" if packed else algo, **kw)
        return wrong(got, want, "sum")
    if coll == "gather":
        ins = [make_input(i, k, count, dtype, "sum") for k in range(n)]
        out = np.empty(n * count, ins[r].dtype) if r == root else None
        got = comm.gather(ins[r], out, root, algo=algo)
        return wrong(got, np.concatenate(ins), "sum") if r == root else 0
    src = make_input(i, root, n * count, dtype, "sum")
    got = comm.scatter(src if r == root else None, np.empty(count, src.dtype), root, algo=algo)
    return wrong(got, src[r * count:(r + 1) * count], "sum")


def one(comm, i, rnd):
    n, r = comm.world_size, comm.rank
    coll = rnd.choice(COLLECTIVES)
    dtype, op = rnd.choice(DTYPES), rnd.choice(["sum", "prod", "min", "max", "avg"])
    count = rnd.choice([0, 1, 7, rnd.randrange(1, 5000), rnd.randrange(1, 200_000)])
    if coll in BLOCKS:
        return blocks(comm, i, rnd, coll, dtype, count)
    algo = rnd.choice([None, "ring", "tree"] if coll in TREES else [None, "ring"])
    root, inplace = rnd.randrange(n), rnd.random() < 0.5
    size = count * n if coll == "reduce_scatter" else count
    inputs = [make_input(i, k, size, dtype, op) for k in range(n)]
    x = inputs[r].copy()
    if coll == "all_reduce":
        got = comm.all_reduce(x, op, out=None if inplace else np.empty_like(x), algo=algo)
        return wrong(got, expected(op, inputs), op)
    if coll == "reduce":
        got = comm.reduce(x, root, op, out=None if inplace else np.empty_like(x), algo=algo)
        return wrong(got, expected(op, inputs), op) if r == root else 0
    if coll == "broadcast":
        return wrong(comm.broadcast(x, root, algo=algo), inputs[root], "sum")
    if coll == "all_gather":
        out = np.empty(count * n, x.dtype)
        return wrong(comm.all_gather(x, out, algo=algo), np.concatenate(inputs), "sum")
    out = np.empty(count, x.dtype)
    want = expected(op, inputs)[r * count:(r + 1) * count]
    return wrong(comm.reduce_scatter(x, out, op, algo=algo), want, op)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args()
    with ringcomm.init() as comm:
        rnd = random.Random(args.seed)  # the same stream on every rank
        bad, t0, rss0 = 0, time.monotonic(), None
        for i in range(args.iterations):
            if i == args.warmup:
                rss0 = rss_mib()
            bad += one(comm, i, rnd)
            if comm.rank == 0 and i and i % 1000 == 0:
                print(f"{i} collectives, {time.monotonic() - t0:.0f} s, rss {rss_mib():.1f} MiB", flush=True)
        rss1 = rss_mib()
        totals = comm.all_reduce(np.array([bad], np.int64))
        rss = comm.all_gather(np.array([rss0, rss1]), np.empty(2 * comm.world_size))
        if comm.rank == 0:
            print(f"soak: {args.iterations} random collectives on {comm.world_size} ranks in "
                  f"{time.monotonic() - t0:.0f} s; wrong elements: {int(totals[0])}")
            for r in range(comm.world_size):
                a, b = rss[2 * r], rss[2 * r + 1]
                print(f"  rank {r}: resident {a:.1f} MiB after {args.warmup} warm-up collectives, "
                      f"{b:.1f} MiB at the end ({100 * (b - a) / a:+.1f}%)")
        return 0 if totals[0] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
