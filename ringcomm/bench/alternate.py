"""`ringcomm-bench --alternate`: every library's job at once, rows taking turns.

Without it the libraries run one after the other, each its whole sweep: a size's figures are taken
seconds to minutes apart, and a VM moves its vCPUs every few seconds (bench/placement.py), so a
ratio may compare two placements as much as two libraries. Here all the jobs start together and
each row (a size, out of place or in place) runs in every library before the next row runs in
any: ringcomm's, then each peer's, a second or so apart.

The turns: each job has a gate, a named pipe that its ranks read one byte from before every row
(worker.gate). The parent writes one byte per rank to let the job run one row, then waits for that
row's report. A job at its gate is blocked in read(): it holds no CPU while another job measures.
The parent holds the pipe open for writing, so a rank's read ends (and its job with it) if the
parent dies. The placement is measured before each size, once every job's rank 0 has said that it
waits at its gate (so not while a job starts up, which would spoil the timing).
"""
from __future__ import annotations

import os
import shutil
import tempfile

from . import placement
from .jobs import Job, JobFailed, skip_reason
from .sweep import Sweep, job_config

# A row's warm-up lasts this long at least: the ranks come from a wait at the gate, and a VM's idle
# vCPUs are halted. Without it, 2-rank all_gather timed 20 calls of 256 KiB in 28-30 us a call
# here against 16-22 us in a sweep without gates (1 MiB: 76-97 against 49-59 us).
WARM_S = 0.05


class Gate:
    """A job's turnstile: one byte lets one rank through to its next row."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.dir = tempfile.mkdtemp(prefix="rcbench-gate-")
        self.path = os.path.join(self.dir, "gate")
        os.mkfifo(self.path, 0o600)
        # Read and write: opening does not wait for a reader, and the ranks' opens for reading
        # find a writer already there, so they do not wait either.
        self.fd = os.open(self.path, os.O_RDWR)

    def open(self) -> None:
        os.write(self.fd, b"g" * self.ranks)

    def close(self) -> None:
        os.close(self.fd)
        shutil.rmtree(self.dir, ignore_errors=True)


def run(a, backends, progress, skipped) -> dict:
    """Every backend's sweep, rows alternating: {backend: result as cli.run_job gives it}. A peer
    that fails or cannot run the sweep goes into ``skipped`` (name -> why) and the others go on;
    ringcomm's failure is a JobFailed."""
    where = (lambda: None) if a.no_placement else placement.round_trip_ns
    jobs, gates, sweeps, trips, by_size = {}, {}, {}, [where()], {}
    ok = False

    def each(do):
        """do(name) for every job still running; a peer whose job fails is dropped, with why."""
        for name in list(jobs):
            try:
                do(name)
            except JobFailed as e:
                if name == "ringcomm":
                    raise
                skipped[name] = skip_reason(e)
                progress.note(f"ringcomm-bench: peer {name} skipped: {skipped[name]}", always=True)
                jobs.pop(name).close()
                gates.pop(name).close()

    def row(name):
        gates[name].open()
        _until(jobs[name], sweeps[name], "row")

    try:
        for name in backends:
            gates[name] = Gate(a.ranks)
            config = job_config(name, a, a.algos if name == "ringcomm" else [None])
            jobs[name] = Job(name, a.ranks, dict(config, gate=gates[name].path, warm_s=WARM_S))
            sweeps[name] = Sweep(name, a, progress)
        for size in a.sizes:
            for in_place in (False, True):
                each(lambda name: _until(jobs[name], sweeps[name], "gate"))   # every job waits
                if not in_place:
                    by_size[size] = where()
                each(row)
        each(lambda name: _until(jobs[name], sweeps[name], "done"))
        trips.append(where())
        ok = True
    finally:
        for job in jobs.values():
            job.close(wait_s=30.0 if ok else 0.0)
        for gate in gates.values():
            gate.close()
    results = {}
    for name, job in jobs.items():
        results[name] = sweeps[name].result(job, trips)
        results[name]["round_trip_ns_by_size"] = by_size
    return results


def _until(job, sweep, kind: str) -> None:
    """Follow ``job``'s events (each to its sweep) up to the first of this ``kind``."""
    while True:
        ev = job.next_event()
        sweep.take(ev)
        if ev["event"] == kind:
            return
