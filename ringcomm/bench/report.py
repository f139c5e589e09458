"""Rows and the table, in nccl-tests' layout (src/common.cu: the header printf, BenchTime's row printf,
the two footer lines), with the peers' columns appended to the right of each row.

A row's time is the mean per iteration of the slowest rank. #wrong is summed over ranks; "Out of
bounds values" counts (rank, row, placement) triples with any wrong element, as nccl-tests does with
one GPU per process.
"""
from __future__ import annotations

from . import spec

_HEAD_FMT = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
_UNIT_FMT = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
_PEER_HEAD = "  %7s  %6s  %6s"
PEER_WIDTH = len(_PEER_HEAD % ("", "", ""))


def placement(coll: str, n: int, size: int, ev: dict) -> dict:
    """One placement's figures from a worker's row event."""
    seconds = max(ev["rank_seconds"])
    algbw, busbw = spec.bandwidth(coll, size, seconds, n)
    wrong = ev["rank_wrong"]
    return {"seconds": seconds, "rank_seconds": ev["rank_seconds"], "algbw": algbw, "busbw": busbw,
            "wrong": None if wrong is None else sum(wrong), "rank_wrong": wrong, "skipped": ev.get("skipped"),
            "iters": ev.get("iters"), "span": ev.get("span"), "steal_s": ev.get("steal_s"),
            "on_cpu": ev.get("on_cpu"), "ran": ev.get("ran")}


def make_row(coll: str, n: int, dtype: str, op: str, root: int, oop: dict, ip: dict) -> dict:
    """A table row from the out-of-place and in-place events of one size."""
    return {"size": oop["size"], "count": oop["count"], "type": dtype,
            "redop": op if coll in spec.REDUCING else "none", "root": root if coll in spec.ROOTED else -1,
            "oop": placement(coll, n, oop["size"], oop), "ip": placement(coll, n, ip["size"], ip)}


def fmt_time(us: float) -> str:
    """nccl-tests' time column: fewer decimals as the number grows."""
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def _wrong(w) -> str:
    return "%5s" % "N/A" if w is None else "%5g" % w


def ratio(mine: float, theirs: float) -> str:
    return "%6s" % "N/A" if not theirs or not mine else "%6.2f" % (mine / theirs)


def header(peer_names) -> list[str]:
    """The three column-header lines; each peer adds time / busbw / ratio (of its out-of-place call)."""
    top = "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          " % (
        "", "", "", "", "")
    names = _HEAD_FMT % ("size", "count", "type", "redop", "root",
                         "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong")
    units = _UNIT_FMT % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                         "(us)", "(GB/s)", "(GB/s)", "")
    top = top.ljust(len(names))
    for p in peer_names:
        top += f"{p} (out-of-place)".center(PEER_WIDTH)
        names += _PEER_HEAD % ("time", "busbw", "ratio")
        units += _PEER_HEAD % ("(us)", "(GB/s)", "")
    return [top.rstrip(), names, units]


def row_line(row: dict, peer_rows=()) -> str:
    """One row; ``peer_rows`` holds each peer's row for the same size (or None where it has none)."""
    line = "%12li  %12li  %8s  %6s  %6s" % (row["size"], row["count"], row["type"], row["redop"],
                                           "%6i" % row["root"])
    for key in ("oop", "ip"):
        p = row[key]
        if p.get("skipped"):  # never run (all_to_all in place)
            line += "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
            continue
        line += "  %7s  %6.2f  %6.2f  %5s" % (fmt_time(p["seconds"] * 1e6), p["algbw"], p["busbw"],
                                            _wrong(p["wrong"]))
    for pr in peer_rows:
        if pr is None:
            line += _PEER_HEAD % ("N/A", "N/A", "N/A")
        else:
            q = pr["oop"]
            line += "  %7s  %6.2f  %6s" % (fmt_time(q["seconds"] * 1e6), q["busbw"],
                                          ratio(row["oop"]["busbw"], q["busbw"]))
    return line


def out_of_bounds(rows) -> int:
    """(rank, row, placement) triples that had a wrong element."""
    return sum(sum(1 for w in (r[k]["rank_wrong"] or []) if w) for r in rows for k in ("oop", "ip"))


def avg_busbw(rows) -> float:
    vals = [r[k]["busbw"] for r in rows for k in ("oop", "ip") if not r[k].get("skipped")]
    return sum(vals) / len(vals) if vals else 0.0


def footer(rows) -> list[str]:
    """nccl-tests' closing lines, spacing included."""
    bad = out_of_bounds(rows)
    return ["# Out of bounds values : %d %s" % (bad, "FAILED" if bad else "OK"),
            "# Avg bus bandwidth    : %g " % avg_busbw(rows), "#"]


def peer_footer(name: str, rows, library: str) -> str:
    bad = out_of_bounds(rows)
    return "# peer %s (%s): out of bounds values %d %s, avg bus bandwidth %g" % (
        name, library, bad, "FAILED" if bad else "OK", avg_busbw(rows))
