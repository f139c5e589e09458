"""One backend's sweep as the parent sees it: the job's configuration, and its figures gathered
from rank 0's events (cli.py runs the jobs one after another, alternate.py in turns)."""
from __future__ import annotations

import secrets

from . import report


def job_config(backend, a, algos) -> dict:
    return {"collective": a.collective, "dtype": a.datatype, "op": a.op, "root": a.root, "sizes": a.sizes,
            "iters": a.iters, "warmup": a.warmup, "check": a.check, "algos": algos,
            "timeout": a.timeout, "job_id": "b" + secrets.token_hex(4), "transport": a.transport,
            "registered": a.registered and backend == "ringcomm",
            "engine": a.engine, "reproducible": a.reproducible, "bind": a.bind,
            "min_row_s": a.min_row_ms / 1e3}


class Sweep:
    """One backend's figures, gathered from its rank 0's events as they come."""

    def __init__(self, backend, a, progress):
        self.backend, self.a, self.progress = backend, a, progress
        self.facts, self.pending, self.rows = {}, {}, {}

    def take(self, ev) -> None:
        a = self.a
        if ev["event"] == "start":
            self.facts = ev["facts"]
        elif ev["event"] == "repro":
            label = ev["algo"] or "auto"
            self.progress.step(f"ringcomm {label} {ev['size']} B plain and reproducible")
            self.progress.done += 1      # the sweep counts two calls per size
            self.rows.setdefault(label, []).append(ev)
        elif ev["event"] == "row":
            label = ev["algo"] or "auto"
            name = f"ringcomm {label}" if self.backend == "ringcomm" else self.backend
            self.progress.step(f"{name} {ev['size']} B {'in' if ev['in_place'] else 'out-of'}-place")
            key = (label, ev["index"])
            self.pending.setdefault(key, {})["ip" if ev["in_place"] else "oop"] = ev
            if len(self.pending[key]) == 2:
                pair = self.pending.pop(key)
                self.rows.setdefault(label, []).append(report.make_row(
                    a.collective, a.ranks, a.datatype, a.op, a.root, pair["oop"], pair["ip"]))

    def result(self, job, trips) -> dict:
        return {"facts": self.facts, "pids": job.pids, "rows": self.rows, "round_trip_ns": trips}
