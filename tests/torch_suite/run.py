"""Run PyTorch's DistributedTest suite on ringcomm and on gloo, and print a table per collective.

    python tests/torch_suite/run.py                      # ringcomm and gloo, 2 and 3 ranks
    python tests/torch_suite/run.py --world 2 -k 'all_reduce|broadcast'
    python tests/torch_suite/run.py --report DIR         # tables from an earlier run's results

Each (backend, world) runs in its own process (suite.py) writing DIR/BACKEND-WORLD.jsonl. The
tables count passed / failed / skipped per group; below them, every test that passes on gloo but
not on ringcomm, with the first line of its error. Needs torch's test dependency ``expecttest``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
BACKENDS = ("ringcomm", "gloo")

# A test's group: the first pattern its name matches (test_ prefix stripped), in this order.
GROUPS = [
    ("ddp", r"^ddp|^DistributedDataParallel|_ddp|join"),
    ("sparse", r"sparse"),
    ("all_to_all", r"all_to_all|alltoall"),
    ("reduce_scatter", r"reduce_scatter"),
    ("all_gather", r"all_gather|allgather"),
    ("all_reduce", r"all_reduce|allreduce"),
    ("reduce", r"^reduce"),
    ("broadcast", r"broadcast"),
    ("gather", r"^gather"),
    ("scatter", r"^scatter"),
    ("send_recv", r"send|recv|p2p|isend|irecv"),
    ("barrier", r"barrier"),
    ("groups", r"group|new_subgroups|backend"),
    ("objects", r"object"),
    ("other", r""),
]


def group_of(test: str) -> str:
    name = test.removeprefix("test_")
    return next(g for g, pattern in GROUPS if re.search(pattern, name))


def run_one(backend: str, world: int, out: pathlib.Path, pattern: str, timeout: float) -> bool:
    """Run one (backend, world); False, with the end of its log shown, if it recorded no test at all."""
    out.unlink(missing_ok=True)
    env = {**os.environ, "BACKEND": backend, "WORLD_SIZE": str(world),
           "RINGCOMM_TIMEOUT": os.environ.get("RINGCOMM_TIMEOUT", "60")}
    cmd = [sys.executable, str(HERE / "suite.py"), str(out), pattern]
    print(f"== {backend}, {world} ranks: {' '.join(cmd)}", flush=True)
    try:
        subprocess.run(cmd, env=env, timeout=timeout, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"))
    except subprocess.TimeoutExpired:
        print(f"   stopped after {timeout:g} s; the table counts the tests that ended", flush=True)
    if out.exists():
        return True
    log = out.with_suffix(".log").read_text().strip().splitlines()
    print("   no test ran; the end of " + str(out.with_suffix(".log")) + ":\n      " + "\n      ".join(log[-5:]),
          flush=True)
    return False


def load(path: pathlib.Path) -> dict:
    if not path.exists():
        return {}
    return {d["test"]: d for d in map(json.loads, path.read_text().splitlines())}


def table(world: int, results: dict) -> str:
    """One row per group: passed / failed / skipped on each backend."""
    counts = {b: collections.defaultdict(collections.Counter) for b in BACKENDS}
    for b in BACKENDS:
        for name, d in results[b].items():
            counts[b][group_of(name)][d["outcome"]] += 1
            counts[b]["TOTAL"][d["outcome"]] += 1
    head = f"{'group (' + str(world) + ' ranks)':<18}" + "".join(f"{b + ' pass/fail/skip':>28}" for b in BACKENDS)
    rows = [head, "-" * len(head)]
    for g in [g for g, _ in GROUPS] + ["TOTAL"]:
        if any(counts[b][g] for b in BACKENDS):
            cells = "".join(f"{c['passed']:>14}/{c['failed']:>4}/{c['skipped']:>4}      "
                            for c in (counts[b][g] for b in BACKENDS))
            rows.append(f"{g:<18}{cells}".rstrip())
    missing = sorted(n for n, d in results["gloo"].items()
                     if d["outcome"] == "passed" and results["ringcomm"].get(n, {}).get("outcome") != "passed")
    gp = sum(d["outcome"] == "passed" for d in results["gloo"].values())
    rows.append(f"\n{gp - len(missing)} of the {gp} tests gloo passes pass on ringcomm")
    for n in missing:
        d = results["ringcomm"].get(n)
        why = "not run" if d is None else f"{d['outcome']}: {_first_error(d['why'])}"
        rows.append(f"  {n}: {why}")
    return "\n".join(rows)


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"Error|Exception|assert|Timeout", ln)]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "?")[:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="2,3", help="comma-separated world sizes (default 2,3)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("-k", default="", help="run only tests whose name matches this regex")
    ap.add_argument("--out", help="results folder (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per backend and world")
    ap.add_argument("--report", help="print the tables of the results in this folder; run nothing")
    a = ap.parse_args()
    out = pathlib.Path(a.report or a.out or tempfile.mkdtemp(prefix="torch-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in a.world.split(",")]
    ran = True
    if not a.report:
        for world in worlds:
            for b in a.backends.split(","):
                ran = run_one(b, world, out / f"{b}-{world}.jsonl", a.k, a.timeout) and ran
    for world in worlds:
        results = {b: load(out / f"{b}-{world}.jsonl") for b in BACKENDS}
        if any(results.values()):
            print(table(world, results) + "\n")
    print(f"results: {out}")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
