"""`ringcomm-bench --reproducible`: the plain and the reproducible call side by side, and their bits.

Each rank's input is random floats over 40 binades (seeded per rank), whose plain float sum depends on
the order -- so an identical result means something. Per size, the two calls alternate (plain,
reproducible, plain, ...) after the warmup, each call timed on its own: a machine loaded by others
disturbs both alike. A row shows the medians (per iteration the slowest rank) and their ratio.

Bit identity: every reproducible result (out of place, the inputs never change) is compared with the
first one on that rank (#diff counts those that differ), and its CRC-32 is reported; the parent checks
that every algorithm and, for all_reduce, every rank got the very same CRC. The run fails (exit 1) if
any of this differs.
"""
from __future__ import annotations

import os
import time
import zlib

import numpy as np

from . import report, spec

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce")
CORRUPT_ENV = "RINGCOMM_BENCH_CORRUPT"     # worker.py's test hook, read here too


def inputs(inp: np.ndarray, seed: int, rank: int) -> None:
    rng = np.random.default_rng([seed, rank])
    vals = rng.standard_normal(inp.size) * np.exp2(rng.integers(-20, 20, inp.size).astype(np.float64))
    inp[...] = vals.astype(inp.dtype)


def measure(be, cfg, bufs, size) -> dict:
    """One size: alternating timed calls; rank 0 returns the row event (others: the same, unused)."""
    coll, n, r, root, op = cfg["collective"], be.world_size, be.rank, cfg["root"], cfg["op"]
    send_buf, recv_buf, _ = bufs
    count, send_n, recv_n, row_bytes = spec.counts(coll, size, send_buf.itemsize, n)
    inp, out = send_buf[:send_n], recv_buf[:recv_n]
    inputs(inp, 14, r)
    plain = be.call(coll, inp, out, op, root, False)[0]
    repro = be.call(coll, inp, out, op, root, False, reproducible=True)[0]
    for _ in range(cfg["warmup"]):
        plain()
        repro()
    be.barrier()
    times, first, diff = [], None, 0
    for _ in range(cfg["iters"]):
        for fn in (plain, repro):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if os.environ.get(CORRUPT_ENV) and be.rank == 0 and first is not None and out.size:
            bits = out[:1].view(np.dtype(f"u{out.itemsize}"))      # test hook: one run's bits flipped
            np.invert(bits, out=bits)
        if first is None:
            first = out.copy()
        elif not np.array_equal(out.view(np.uint8), first.view(np.uint8)):
            diff += 1
    has_result = not (coll == "reduce" and r != root)
    crc = float(zlib.crc32(first.view(np.uint8))) if has_result and first is not None else -1.0
    stats = be.gather_f64(times + [diff, crc])
    t = stats[:, :-2].max(axis=0)                   # per call, the slowest rank
    return {"event": "repro", "size": row_bytes, "count": count,
            "plain": float(np.median(t[0::2])), "reproducible": float(np.median(t[1::2])),
            "rank_diff": stats[:, -2].astype(int).tolist(), "rank_crc": stats[:, -1].astype(int).tolist()}


def check_args(a) -> str | None:
    """Why --reproducible cannot run this sweep, or None."""
    if a.collective not in COLLECTIVES:
        return f"--reproducible works for {', '.join(COLLECTIVES)}, not {a.collective}"
    if a.op not in ("sum", "avg"):
        return f"--reproducible works for op sum and avg, not {a.op}"
    if a.datatype not in ("half", "bfloat16", "float", "double"):
        return f"--reproducible works for half, bfloat16, float and double, not {a.datatype}"
    if a.peer:
        return "--reproducible compares ringcomm with itself: drop --peer"
    return None


def table(a, rows_by_algo: dict, loads) -> tuple[list[str], bool]:
    """The lines to print, and whether every bit-identity check passed."""
    from ringcomm import reproducible
    lines = [f"# ringcomm-bench {a.collective} --reproducible: {a.ranks} ranks, {a.datatype} {a.op}, "
             f"{a.iters} alternating iterations after {a.warmup} warmup; medians of the slowest rank",
             f"# load average at start {loads[0]}, at end {loads[1]}",
             f"# reproducible mode: {reproducible.describe(spec.numpy_dtype(a.datatype), a.ranks)}",
             "# %10s  %12s  %8s  %10s  %10s  %6s  %5s  %10s" % (
                 "size", "count", "algo", "plain(us)", "repro(us)", "ratio", "#diff", "crc32")]
    ok, crcs = True, {}
    for algo, rows in rows_by_algo.items():
        for row in rows:
            ranks_crc = [c for c in row["rank_crc"] if c >= 0]
            if a.collective == "all_reduce" and len(set(ranks_crc)) > 1:
                ok = False
            crcs.setdefault(row["size"], set()).add(tuple(row["rank_crc"]))
            ok &= not any(row["rank_diff"])
            lines.append("%12li  %12li  %8s  %10s  %10s  %6s  %5d  %10s" % (
                row["size"], row["count"], algo, report.fmt_time(row["plain"] * 1e6).strip(),
                report.fmt_time(row["reproducible"] * 1e6).strip(),
                report.ratio(row["reproducible"], row["plain"]).strip(), sum(row["rank_diff"]),
                "%08x" % ranks_crc[0] if ranks_crc else "-"))
    same_algos = all(len(v) == 1 for v in crcs.values())
    ok &= same_algos
    lines.append(f"# bit identity across iterations, ranks{' and algorithms' if len(rows_by_algo) > 1 else ''}: "
                 f"{'OK' if ok else 'FAILED'}")
    return lines, ok
