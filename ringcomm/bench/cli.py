"""`ringcomm-bench`: nccl-tests' all_reduce_perf and friends for ringcomm, with peers side by side.

    ringcomm-bench COLLECTIVE -n RANKS -b MIN -e MAX -f FACTOR -d DTYPE -o OP -r ROOT --iters N
                   --warmup W --check [--algo A] [--transport T] [--engine python|native] [--registered] [--bind]
                   [--json FILE] [--plot FILE.png] [--peer gloo|mpi|nccl]... [--alternate] [--runs N]
                   [--reproducible]

It starts its own ranks: ringcomm's first, then each peer's (the same sweep, one job after the
other; with --alternate all at once, each row run by every library before the next: alternate.py),
and prints one table whose rows gain each peer's out-of-place time, busbw and the ratio
ringcomm / peer. With --runs N the whole sweep runs N times and each row shows the median of its
runs, with each row's spread after the table, and every run over 2x its row's median listed with
what the machine did meanwhile: the hypervisor's steal, each rank's share of the run on a CPU
(runs.py). Exit status 1 when any result was wrong (or
ringcomm failed), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from . import alternate, machine, placement, report, reproducible, runs, spec
from .jobs import Job, JobFailed, missing_reason, skip_reason
from .sweep import Sweep, job_config

PEERS = ("gloo", "mpi", "nccl")


def _size(text):
    try:
        return spec.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv):
    p = argparse.ArgumentParser(prog="ringcomm-bench", description=__doc__.splitlines()[0])
    p.add_argument("collective", choices=spec.COLLECTIVES)
    p.add_argument("-n", "--ranks", type=int, default=2, help="ranks to start on this host (default 2)")
    p.add_argument("-b", "--minbytes", type=_size, default=8, help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", type=_size, default=64 << 20, help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("-d", "--datatype", default="float", help="int8 uint8 int32 uint32 int64 uint64 half "
                   "float double bfloat16 (numpy names too); default float")
    p.add_argument("-o", "--op", default="sum", choices=spec.OPS)
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast, reduce, gather, scatter")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    p.add_argument("--min-row-ms", type=float, default=0.0, metavar="MS",
                   help="time at least --iters calls per row and as many more as last about MS ms at the "
                        "pace of a few untimed calls, so that a moment's preemption stays small in a "
                        "row's mean (default 0: exactly --iters, as nccl-tests)")
    p.add_argument("--check", action="store_true", help="verify every result (#wrong)")
    p.add_argument("--algo", default=None, help="ringcomm algorithm: ring, tree, auto, a comma list or all")
    p.add_argument("--transport", choices=("shm", "tcp"), default=None, help="force ringcomm's transport")
    p.add_argument("--engine", choices=("native", "python"), default=None,
                   help="ringcomm's engine over shm (RINGCOMM_ENGINE; default native)")
    p.add_argument("--registered", action="store_true",
                   help="ringcomm's buffers from comm.alloc (peers map them: one-copy 'read' algorithms); "
                        "peers keep plain buffers")
    p.add_argument("--bind", action="store_true",
                   help="every library's rank i runs on usable CPU i mod their number, as "
                        "ringcomm-run --bind core places ranks (default: the scheduler places them)")
    p.add_argument("--peer", action="append", default=[], choices=PEERS, help="also run this library")
    p.add_argument("--json", metavar="FILE", help="write every figure, versions and machine facts")
    p.add_argument("--plot", metavar="FILE.png", help="busbw against size, with the memcpy ceiling")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a job may go without finishing a row before it is stopped (default 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--no-placement", action="store_true",
                   help="skip the placement line (a cache line's round trip between two CPUs, timed with "
                        "numba: ~0.5 s, far longer under an emulated CPU)")
    p.add_argument("--alternate", action="store_true",
                   help="start every library's ranks at once and run each row in every library before the "
                        "next (a second or so apart, in the same vCPU placement); one ringcomm algorithm")
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="run the whole sweep this many times (with --alternate, alternating each time); each "
                        "row shows the median of its runs, and the spread follows the table (default 1)")
    p.add_argument("--reproducible", action="store_true",
                   help="time plain and reproducible=True calls alternately, print both and their ratio, "
                        "and check that the reproducible bits are identical across runs, ranks and algorithms")
    a = p.parse_args(argv)
    try:
        a.datatype = spec.dtype_name(a.datatype)
        a.sizes = spec.sweep(a.minbytes, a.maxbytes, a.stepfactor)
        a.algos = _algos(a.collective, a.algo, a.registered)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= a.ranks <= 64:
        p.error(f"-n must be between 1 and 64 ranks on one host, got {a.ranks}")
    if a.collective == "sendrecv" and a.ranks < 2:
        p.error("sendrecv needs at least 2 ranks")
    if not 0 <= a.root < a.ranks:
        p.error(f"root {a.root} is out of range for {a.ranks} ranks")
    if a.iters < 1 or a.warmup < 0 or not 0 <= a.min_row_ms <= 60000:
        p.error("--iters must be >= 1, --warmup >= 0 and --min-row-ms between 0 and 60000")
    if a.runs < 1 or (a.runs > 1 and a.reproducible):
        p.error("--runs must be >= 1, and 1 with --reproducible (which alternates its own two calls)")
    a.peer = list(dict.fromkeys(a.peer))
    if a.alternate and (len(a.algos) > 1 or a.reproducible):
        p.error("--alternate takes turns row by row with the peers: one ringcomm algorithm, no --reproducible")
    why = reproducible.check_args(a) if a.reproducible else None
    if why:
        p.error(why)
    return a


def _algos(coll: str, text, registered: bool = False):
    """[None] for automatic, else the algorithm names, checked against what ringcomm has. "all"
    leaves out "read" unless the buffers are registered (--registered): it reads peers' buffers."""
    if text in (None, "", "auto"):
        return [None]
    from ringcomm.catalogue import ALGOS
    have = list(ALGOS.get(coll, {}))
    if text == "all":
        names = [name for name in have if registered or name != "read"]
    else:
        names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name != "auto" and name not in have:
            raise ValueError(f"{coll} has no algorithm {name!r}; it has: {', '.join(have) or 'none'} "
                             f"(or auto)")
    return [None if name == "auto" else name for name in names] or [None]


def run_job(backend, a, algos, progress):
    """One backend's sweep: {"facts", "pids", "rows": {algo label: [row, ...]}}; JobFailed on failure."""
    where = (lambda: None) if a.no_placement else placement.round_trip_ns
    before = where()
    job = Job(backend, a.ranks, job_config(backend, a, algos))
    sweep, ok = Sweep(backend, a, progress), False
    try:
        for ev in job.events():
            sweep.take(ev)
        ok = True
    finally:
        job.close(wait_s=30.0 if ok else 0.0)
    return sweep.result(job, [before, where()])


def _table(a, mine, peers, skipped, memcpy, facts) -> list[str]:
    lines = [f"# ringcomm-bench {a.collective} ({mine['facts'].get('library', 'ringcomm')})",
             "# nRanks %d minBytes %d maxBytes %d step: %d(factor) warmup iters: %d iters: %d "
             "validation: %d" % (a.ranks, a.minbytes, a.maxbytes, a.stepfactor, a.warmup, a.iters,
                                 int(a.check)), "#", "# Using ranks"]
    for r, pid in enumerate(mine["pids"]):
        lines.append("#  Rank %2d Pid %6d on %10s cpu %s" % (r, pid, facts["host"], facts["cpu"]))
    links = mine["facts"].get("transports_from_rank0")
    if links:
        lines.append("#  rank 0 reaches " + ", ".join(f"rank {p} over {t}" for p, t in links.items()))
    if mine["facts"].get("engine"):
        lines.append(f"#  ringcomm engine: {mine['facts']['engine']}")
    lines.append("# Machine: %s cores (%s usable), Python %s, numpy %s, load average at start %s" % (
        facts["cores"], facts["cores_usable"], facts["python"], facts["numpy"],
        "n/a" if facts["loadavg_at_start"] is None else "%.2f" % facts["loadavg_at_start"][0]))
    lines.append("# memcpy (one core, 64 MiB, measured in this run): %.2f GB/s" % memcpy)
    if facts.get("damon"):
        lines.append("# DAMON is on (%s): its kernel thread takes a core from a rank now and then (on the "
                     "2-core dev VM ~1 ms every 0.5 s); a short run it lands in is slow (docs/06)"
                     % ", ".join(facts["damon"]))
    trips = [("ringcomm" if name is None else name, run.get("round_trip_ns") or [None, None])
             for name, run in [(None, mine), *peers.items()]]
    if any(t is not None for _, pair in trips for t in pair):
        lines.append("# Placement: a cache line's round trip between 2 CPUs before / after each sweep (ns; a "
                     "VM's vCPUs move): " + ", ".join(f"{n} {_ns(b)} / {_ns(e)}" for n, (b, e) in trips))
    if a.alternate:
        lines.append("# Rows: alternating (every library's ranks started at once; each row ran in every "
                     "library before the next)")
    if a.registered:
        lines.append("# Buffers: ringcomm's from comm.alloc (registered: peers read them directly); "
                     "peers' plain numpy")
    if a.bind:
        lines.append("# Binding: every library's rank i on usable CPU i mod their number (--bind)")
    if a.collective == "broadcast":
        lines.append("# broadcast takes one buffer a rank (as MPI_Bcast and torch's do): out of place the root "
                     "passes its send buffer, in place its receive buffer; the call is the same")
    if a.min_row_ms:
        lines.append(f"# Rows: at least {a.min_row_ms:g} ms of timed calls each (--min-row-ms; at least "
                     f"{a.iters} calls, each row's count in --json)")
    for name, run in peers.items():
        lines.append(f"# Peer {name}: {run['facts'].get('library', '?')}")
    for name, why in skipped.items():
        lines.append(f"# Peer {name}: skipped: {why}")
    all_rows = []
    for label, rows in mine["rows"].items():
        lines += ["#", f"# Algorithm: {label}", "#"] + report.header(list(peers))
        by_size = {name: {r["size"]: r for r in run["rows"].get("auto", [])} for name, run in peers.items()}
        for row in rows:
            lines.append(report.row_line(row, [by_size[p].get(row["size"]) for p in peers]))
        all_rows += rows
    lines += report.footer(all_rows)
    lines += [report.peer_footer(n, r["rows"].get("auto", []), r["facts"].get("library", "?"))
              for n, r in peers.items()]
    return lines


def _stop(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through Job.close(): no rank outlives us


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        old = signal.signal(signal.SIGTERM, _stop)
    except ValueError:  # not the main thread (called from a test or an embedding program)
        old = None
    try:
        return _main(a, argv)
    except KeyboardInterrupt:
        print("ringcomm-bench: interrupted; the ranks were stopped", file=sys.stderr)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _main(a, argv) -> int:
    facts = machine.facts()
    progress = machine.Progress(len(a.sizes) * 2 * (len(a.algos) + len(a.peer)) * a.runs,
                                enabled=not a.no_progress)
    memcpy = machine.memcpy_gbps()
    try:
        if a.reproducible:
            mine = run_job("ringcomm", a, a.algos, progress)
        else:
            mine, peers, skipped = _sweeps(a, progress)
    except JobFailed as e:
        progress.close()
        print(f"ringcomm-bench: error: ringcomm's sweep failed: {e}", file=sys.stderr)
        return 1
    progress.close()
    if a.reproducible:
        lines, ok = reproducible.table(a, mine["rows"], (_load(facts["loadavg_at_start"]), _load(os.getloadavg())))
        print("\n".join(lines), flush=True)
        return 0 if ok else 1
    lines = _table(a, mine, peers, skipped, memcpy, facts)
    if a.runs > 1:
        lines += runs.spread_lines(a.runs, mine["rows"], peers) + runs.slow_lines(mine["rows"], peers)
    print("\n".join(lines), flush=True)
    rows = [r for rs in mine["rows"].values() for r in rs]
    peer_rows = [r for run in peers.values() for rs in run["rows"].values() for r in rs]
    if a.json:
        _write_json(a, argv, facts, memcpy, mine, peers, skipped, rows)
    drawn = True
    if a.plot:
        try:
            _plot(a, mine, peers, memcpy)
        except (RuntimeError, OSError) as e:   # no matplotlib, an unwritable path: said, the table stands
            print(f"ringcomm-bench: the plot was not drawn: {e}", file=sys.stderr)
            drawn = False
    return 1 if report.out_of_bounds(rows) or report.out_of_bounds(peer_rows) or not drawn else 0


def _sweeps(a, progress):
    """(ringcomm's result, the peers' results, the peers skipped and why): one sweep, or --runs of
    them combined row by row (a peer skipped in any run is left out)."""
    results, skipped = [], {}
    for _ in range(a.runs):
        if a.alternate:
            mine, peers, why = _alternating(a, progress)
        else:
            mine = run_job("ringcomm", a, a.algos, progress)
            progress.note(f"ringcomm-bench: ringcomm done ({a.collective}, {a.ranks} ranks)")
            peers, why = _one_after_another(a, progress)
        results.append((mine, peers))
        skipped.update(why)
    if a.runs == 1:
        return results[0][0], results[0][1], skipped
    mine = runs.combine(a.collective, a.ranks, [m for m, _ in results])
    names = [name for name in results[0][1] if name not in skipped and all(name in p for _, p in results)]
    peers = {name: runs.combine(a.collective, a.ranks, [p[name] for _, p in results]) for name in names}
    return mine, peers, skipped


def _one_after_another(a, progress):
    peers, skipped = {}, {}
    for peer in a.peer:
        why = missing_reason(peer)
        if why is None:
            try:
                peers[peer] = run_job(peer, a, [None], progress)
                progress.note(f"ringcomm-bench: peer {peer} done")
                continue
            except JobFailed as e:  # PeerUnsupported too: one line, the sweep goes on without it
                why = skip_reason(e)
        skipped[peer] = why
        progress.done += 2 * len(a.sizes)
        progress.note(f"ringcomm-bench: peer {peer} skipped: {why}", always=True)
    return peers, skipped


def _alternating(a, progress):
    skipped = {peer: why for peer in a.peer if (why := missing_reason(peer)) is not None}
    for peer, why in skipped.items():
        progress.done += 2 * len(a.sizes)
        progress.note(f"ringcomm-bench: peer {peer} skipped: {why}", always=True)
    backends = ["ringcomm"] + [peer for peer in a.peer if peer not in skipped]
    results = alternate.run(a, backends, progress, skipped)
    mine = results.pop("ringcomm")
    return mine, results, skipped


def _ns(value) -> str:
    return "n/a" if value is None else "%.0f" % value


def _load(avg) -> str:
    return "n/a" if avg is None else "%.2f" % avg[0]


def _write_json(a, argv, facts, memcpy, mine, peers, skipped, rows):
    doc = {"command": ["ringcomm-bench"] + list(sys.argv[1:] if argv is None else argv),
           "config": {k: getattr(a, k) for k in ("collective", "ranks", "minbytes", "maxbytes", "stepfactor",
                                                  "datatype", "op", "root", "iters", "warmup", "check",
                                                  "algos", "transport", "engine", "registered", "sizes",
                                                  "runs", "bind")},
           "machine": facts, "memcpy_gbps": memcpy, "ringcomm": mine, "peers": peers, "skipped": skipped,
           "summary": {"out_of_bounds": report.out_of_bounds(rows), "avg_busbw": report.avg_busbw(rows)}}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)


def _plot(a, mine, peers, memcpy):
    from . import plot
    lines = {f"ringcomm ({label})": [(r["size"], r["oop"]["busbw"]) for r in rows]
             for label, rows in mine["rows"].items()}
    for name, run in peers.items():
        lines[f"{name}: {run['facts'].get('library', '?')}"] = [
            (r["size"], r["oop"]["busbw"]) for r in run["rows"].get("auto", [])]
    title = f"{a.collective}, {a.ranks} ranks, {a.datatype}" + (f" {a.op}" if a.collective in spec.REDUCING else "")
    plot.draw(a.plot, title, lines, memcpy)


if __name__ == "__main__":
    sys.exit(main())
