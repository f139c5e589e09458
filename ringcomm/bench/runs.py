"""`ringcomm-bench --runs N`: the whole sweep N times; each row's time is the median of its runs.

On a shared or virtual machine one run of a row can be far from its usual time (a vCPU moved, a
neighbour woke up, the scheduler stacked two ranks on one core), in either library. A single
sweep's ratio then says as much about that moment as about the libraries. With ``--runs N``
every library's sweep runs N times (with --alternate: N alternating sweeps, each with fresh
jobs), and the table shows, per row, the median of the N runs' mean times, with the bandwidths
worked out from it; #wrong adds up the runs. After the table, one line per row gives its spread:
the slowest run's time over the median, for ringcomm's two placements and each peer's out of
place, so a reader sees which rows to trust (and whether any run was slower than 2x its median).
Each run over 2x its median then gets a line of its own that says where its time went (slow_lines).
"""
from __future__ import annotations

import statistics

from . import spec


def combine(coll: str, ranks: int, results: list[dict]) -> dict:
    """One backend's result (as cli.run_job gives it) from its results of several runs of the same
    sweep: rows by median time, every run's times kept as ``run_seconds``, when each run's timed
    calls began and ended (rank 0's CLOCK_MONOTONIC) as ``run_spans``, and the CPU time the
    hypervisor took meanwhile (machine.steal_seconds; None where unknown) as ``run_steal_s``."""
    first = results[0]
    rows = {label: [_median_row(coll, ranks, [r["rows"][label][j] for r in results]) for j in range(len(rs))]
            for label, rs in first["rows"].items()}
    trips = [t for r in results for t in (r.get("round_trip_ns") or [])]
    return {**first, "rows": rows, "runs": len(results),
            "round_trip_ns": [trips[0], trips[-1]] if trips else [None, None]}


def _median_row(coll: str, ranks: int, same: list[dict]) -> dict:
    row = dict(same[0])
    for key in ("oop", "ip"):
        placed = [r[key] for r in same]
        if placed[0].get("skipped"):
            continue
        seconds = [p["seconds"] for p in placed]
        median = statistics.median(seconds)
        middle = min(placed, key=lambda p: abs(p["seconds"] - median))   # its ranks' times stand for the row
        algbw, busbw = spec.bandwidth(coll, row["size"], median, ranks)
        wrong = [p["wrong"] for p in placed]
        rank_wrong = [w for p in placed for w in (p["rank_wrong"] or [])]
        row[key] = {**middle, "seconds": median, "algbw": algbw, "busbw": busbw, "run_seconds": seconds,
                    "run_spans": [p.get("span") for p in placed], "run_steal_s": [p.get("steal_s") for p in placed],
                    "run_on_cpu": [p.get("on_cpu") for p in placed],
                    "wrong": None if all(w is None for w in wrong) else sum(w or 0 for w in wrong),
                    "rank_wrong": rank_wrong if any(p["rank_wrong"] is not None for p in placed) else None}
    return row


def spread(placed: dict) -> float | None:
    """The slowest run's time over the median (1.0: every run at or below it); None if not run."""
    if placed.get("skipped") or not placed.get("run_seconds"):
        return None
    return max(placed["run_seconds"]) / placed["seconds"] if placed["seconds"] else None


def spread_lines(runs: int, mine: dict, peers: dict) -> list[str]:
    """The block after the table: per row (of each ringcomm algorithm in ``mine``, {label: rows}),
    each column's slowest run over its median."""
    names = list(peers)
    by_size = {name: {r["size"]: r for r in run["rows"].get("auto", [])} for name, run in peers.items()}
    head = "# %10s  %12s  %8s" % ("size", "ringcomm oop", "in-place") + "".join("  %8s" % n for n in names)
    lines = [f"# Runs: {runs}. Each time above is the median of the runs' means; below, per row, the slowest "
             f"run's time over that median"]
    mine_rows = []
    for label, rows in mine.items():
        lines += ([f"# Algorithm: {label}"] if len(mine) > 1 else []) + [head]
        lines += [_spread_row(row, names, by_size) for row in rows]
        mine_rows += rows
    worst = max((c for row in mine_rows for c in (spread(row["oop"]), spread(row["ip"])) if c is not None),
                default=None)
    if worst is not None:
        lines.append(f"# ringcomm's slowest run over its row's median: {worst:.2f}x")
    return lines


SLOW = 2.0   # a run this much over its row's median is listed with what the hypervisor took during it


def slow_lines(mine: dict, peers: dict, slow: float = SLOW) -> list[str]:
    """Every run (ringcomm's placements, each peer's out of place) that took over ``slow`` times its
    row's median, with two readings that say where its time went: the CPU time the hypervisor
    stole from the VM while it ran (a vCPU the host descheduled: the guest's scheduler saw nothing),
    and each rank's share of the run on a CPU (time.thread_time of the calling thread over the
    run's length: a rank with a core of its own that spins is near 100%; two ranks stacked on one
    core near 50% each; a rank preempted by another thread lower). Nothing when no run was that
    slow (docs/06, "Slow runs")."""
    cells = [(f"ringcomm{'' if len(mine) == 1 else ' ' + label}", key, row)
             for label, rows in mine.items() for row in rows for key in ("oop", "ip")]
    cells += [(name, "oop", row) for name, run in peers.items() for row in run["rows"].get("auto", [])]
    lines = []
    for who, key, row in cells:
        placed = row[key]
        if placed.get("skipped") or not placed.get("run_seconds") or not placed["seconds"]:
            continue
        each = [placed.get(field) or [None] * len(placed["run_seconds"])
                for field in ("run_spans", "run_steal_s", "run_on_cpu")]
        for k, (took, span, stolen, on_cpu) in enumerate(zip(placed["run_seconds"], *each)):
            if took > slow * placed["seconds"]:
                lines.append("#   %d %s %s, run %d: %.1fx (%s a call, median %s%s); steal %s; on CPU %s" % (
                    row["size"], who, "in place" if key == "ip" else "out of place", k + 1,
                    took / placed["seconds"], _time(took), _time(placed["seconds"]),
                    "" if not span else f"; the run took {_time(span[1] - span[0])}", _steal(stolen),
                    _shares(on_cpu)))
    if lines:
        lines.insert(0, f"# Runs over {slow:g}x their row's median; the CPU time the hypervisor took from the VM "
                        "while each ran (/proc/stat steal, all vCPUs, in clock ticks); and the share of the run "
                        "each rank's calling thread spent on a CPU (rank 0, 1, ...):")
    return lines


def _shares(on_cpu) -> str:
    return "unknown" if not on_cpu else " ".join("%.0f%%" % (100 * s) for s in on_cpu)


def _time(seconds: float) -> str:
    return "%.3g ms" % (seconds * 1e3) if seconds >= 1e-3 else "%.3g us" % (seconds * 1e6)


def _steal(seconds) -> str:
    return "unknown" if seconds is None else "none" if seconds == 0 else "%.0f ms" % (seconds * 1e3)


def _spread_row(row: dict, names: list, by_size: dict) -> str:
    cells = [spread(row["oop"]), spread(row["ip"])]
    cells += [spread(by_size[n][row["size"]]["oop"]) if row["size"] in by_size[n] else None for n in names]
    return ("# %10d  %12s  %8s" % (row["size"], _x(cells[0]), _x(cells[1]))
            + "".join("  %8s" % _x(c) for c in cells[2:]))


def _x(value) -> str:
    return "N/A" if value is None else "%.2fx" % value
