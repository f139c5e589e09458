"""One rank of a benchmark job: the sweep of sizes, out of place then in place, for one backend.

    python -m ringcomm.bench.worker BACKEND CONFIG_JSON

Started by jobs.py (ringcomm, gloo, nccl: torchrun's environment; mpi: under mpiexec). Rank 0 reports
on stdout, one `RCBENCH {json}` line per event (start, row, unsupported, error, done); the other
ranks print nothing there. Rows carry raw figures (every rank's mean time, every rank's #wrong);
the parent turns them into algbw / busbw.

With --alternate the parent runs every library's job at once and lets one row run at a time, rows
taking turns: before each row every rank reads one byte from the job's gate (a named pipe; gate()),
so a job that waits holds no CPU, and the libraries' figures for one size are taken a second or so
apart, in the same placement (a VM moves its vCPUs every few seconds: bench/placement.py).

A row follows nccl-tests' BenchTime: `warmup` calls, a barrier, `iters` timed calls (each rank's mean),
then, with check on, fresh inputs, a poisoned output, one more call and a count of wrong elements.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import numpy as np

from . import machine, reproducible, spec, verify
from .backends import Unsupported, make_backend, python_facts

PREFIX = "RCBENCH "
ROW_STATS = 3   # what every rank gathers after a row's timed calls (measure): time, wrong, on-CPU share
# Test hook: flip one element of rank 0's checked result in every ringcomm row, so a test can prove
# that a wrong result is counted (and fails the run). Never set it outside a test.
CORRUPT_ENV = "RINGCOMM_BENCH_CORRUPT"


def emit(event: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def gate(cfg, rank: int) -> None:
    """With --alternate: block until the parent lets this job run its next row (one byte for each
    rank). Rank 0 first says it is there (the parent times the placement only while every job
    waits). The pipe is opened once; the parent holds a writer, so an end of file means it is gone."""
    path = cfg.get("gate")
    if not path:
        return
    if rank == 0:
        emit({"event": "gate"})
    fd = _GATE.get(path)
    if fd is None:
        fd = _GATE[path] = os.open(path, os.O_RDONLY)
    if os.read(fd, 1) != b"g":
        raise RuntimeError(f"ringcomm-bench's parent closed the gate {path}: it stopped")


_GATE: dict = {}


def views(coll, in_place, rank, n, root, send_buf, recv_buf, count, recv_n, send_n):
    """(inp, out, checked) for one call: the arrays passed and whether `out` is checked on this rank.
    In place follows nccl-tests' offsets: all_gather's input is block `rank` of the output,
    reduce_scatter's output is block `rank` of the input, the others share one buffer."""
    if not in_place:
        inp, out = send_buf[:send_n], recv_buf[:recv_n]
    elif coll in ("all_gather", "gather"):
        out = recv_buf[:recv_n]
        inp = out[rank * count:(rank + 1) * count]
    elif coll in ("reduce_scatter", "scatter"):
        inp = recv_buf[:send_n]
        out = inp[rank * count:(rank + 1) * count]
    else:
        inp = out = recv_buf[:recv_n]
    checked = not (coll in ("reduce", "gather") and rank != root)  # only their root gets a result
    return inp, out, checked


def fill_input(inp, tables):
    """This rank's input: its table tiled (reduce_scatter's input is indexed across all its blocks)."""
    verify.fill_tiled(inp, tables["input"])


def fill_expected(coll, exp, tables, rank, n, root, count):
    """What this rank's output must hold."""
    if coll in ("all_reduce", "reduce"):
        verify.fill_tiled(exp, tables["reduced"])
    elif coll == "reduce_scatter":
        verify.fill_tiled(exp, tables["reduced"], start=rank * count)
    elif coll == "broadcast":
        verify.fill_tiled(exp, tables["inputs"][root])
    elif coll == "sendrecv":
        verify.fill_tiled(exp, tables["inputs"][(rank - 1) % n])
    elif coll in ("all_gather", "gather"):
        for j in range(n):
            verify.fill_tiled(exp[j * count:(j + 1) * count], tables["inputs"][j])
    elif coll == "scatter":
        verify.fill_tiled(exp, tables["inputs"][root], start=rank * count)
    elif coll == "all_to_all":  # block j of rank j's input, which starts where rank j's table does
        for j in range(n):
            verify.fill_tiled(exp[j * count:(j + 1) * count], tables["inputs"][j], start=rank * count)


def check(be, cfg, tables, exp_buf, fn, inp, result, coll, count, checked) -> int:
    """One more call on fresh inputs into a poisoned output; the number of wrong elements here
    (every rank makes the call; a rank without a result, a reduce's non-root, counts 0)."""
    n, r = be.world_size, be.rank
    exp = exp_buf[:result.size]
    fill_expected(coll, exp, tables, r, n, cfg["root"], count)
    verify.poison(result, exp)  # first: for in-place calls the input then overwrites its share
    fill_input(inp, tables)
    be.upload(result)
    be.upload(inp)
    be.barrier()  # no rank may start the check call while another still writes its inputs
    fn()
    be.sync()
    if not checked:
        return 0
    got = be.download(result)
    if os.environ.get(CORRUPT_ENV) and be.name == "ringcomm" and r == 0 and got.size:
        bits = got[:1].view(np.dtype(f"u{got.itemsize}"))
        np.invert(bits, out=bits)
    return verify.count_wrong(got, exp)


# A job's first row warms up this long at least, in every library: the ranks have just started, and
# the first milliseconds of a job are not its steady state (a library's adaptive choices, the
# scheduler's placement of the ranks). 5 warm-up calls then 20 timed ones of a 2-rank 64 KiB
# all_reduce: 16.7-18.4 us a call in the first row against 10-12 later; 4 ranks, 64 KiB broadcast:
# 48-51 against 29-33 with 100 warm-up calls. (--warmup 0 asks for none: then none.)
FIRST_ROW_WARM_S = 0.05


def measure(be, cfg, tables, bufs, coll, size, in_place, warm_s=0.0) -> dict:
    n, r, root, op = be.world_size, be.rank, cfg["root"], cfg["op"]
    send_buf, recv_buf, exp_buf = bufs
    count, send_n, recv_n, row_bytes = spec.counts(coll, size, send_buf.itemsize, n)
    if in_place and coll in spec.NEVER_IN_PLACE:  # a row of N/A, as nccl-tests reports no error there
        return {"size": row_bytes, "count": count, "in_place": True, "rank_seconds": [0.0] * n,
                "rank_wrong": None, "skipped": f"{coll} has no in-place form"}
    inp, out, checked = views(coll, in_place, r, n, root, send_buf, recv_buf, count, recv_n, send_n)
    fill_input(inp, tables)
    be.upload(inp)
    fn, result = be.call(coll, inp, out, op, root, in_place)
    warming, t0 = max(cfg.get("warm_s", 0.0), warm_s), time.perf_counter()
    for _ in range(cfg["warmup"]):
        fn()
    # After a wait at the gate (--alternate) the cores have idled, and a VM's idle vCPUs are halted;
    # a job's first row follows its start: warm up for that long at least (every rank takes the
    # slowest rank's time, so all agree).
    while warming and be.gather_f64([time.perf_counter() - t0]).max() < warming:
        for _ in range(max(1, cfg["warmup"])):
            fn()
    iters = timed_calls(be, cfg, fn)
    be.sync()
    be.barrier()
    stolen = machine.steal_seconds() if r == 0 else None   # the machine's, so rank 0's read will do
    on_cpu = time.thread_time()   # this thread's CPU time: below the run's length, it waited off its CPU
    began, t0 = time.monotonic(), time.perf_counter()
    for _ in range(iters):
        fn()
    be.sync()
    seconds = (time.perf_counter() - t0) / iters
    on_cpu = (time.thread_time() - on_cpu) / max(seconds * iters, 1e-9)
    span = [began, time.monotonic()]   # CLOCK_MONOTONIC: a run can be cut out of `perf record -k CLOCK_MONOTONIC`
    if stolen is not None:
        now = machine.steal_seconds()
        stolen = None if now is None else now - stolen   # a counter that only grows
    wrong = -1.0  # not checked: nccl-tests prints N/A (and does not check in-place sendrecv either)
    if cfg["check"] and not (coll == "sendrecv" and in_place):
        wrong = float(check(be, cfg, tables, exp_buf, fn, inp, result, coll, count, checked))
    stats = be.gather_f64([seconds, wrong, on_cpu])   # ROW_STATS values
    return {"size": row_bytes, "count": count, "in_place": in_place, "iters": iters, "span": span, "steal_s": stolen,
            "ran": be.ran(),   # what the timed calls ran (automatic choice)
            "rank_seconds": stats[:, 0].tolist(), "on_cpu": stats[:, 2].tolist(),
            "rank_wrong": None if stats[0, 1] < 0 else [int(w) for w in stats[:, 1]]}


MAX_TIMED_CALLS = 1_000_000   # --min-row-ms's ceiling, whatever a call's pace
PROBE_CALLS = 5               # --min-row-ms times at least this many calls for their pace


def timed_calls(be, cfg, fn) -> int:
    """How many calls a row times: --iters, or with --min-row-ms as many more as last that long at
    the pace of a few untimed calls: each timed alone, their median (one of them preempted does not
    move it), the slowest rank's (so that every rank makes the same number). A short row is at the
    mercy of anything else that takes a core for a moment: on the VMs these pages were measured on,
    the VM's own agent (nice -10) takes one vCPU for ~3 ms about 1.5 times a second, and a 30-call
    row of 0.5 ms that it hits runs 7x its median, in every library."""
    iters, want = cfg["iters"], cfg.get("min_row_s", 0.0)
    if not want:
        return iters
    took = []
    for _ in range(max(PROBE_CALLS, cfg["warmup"], iters // 4)):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    be.sync()
    pace = be.gather_f64([float(np.median(took))]).max()
    return int(min(MAX_TIMED_CALLS, max(iters, math.ceil(want / max(pace, 1e-9)))))


def run(be, cfg) -> None:
    coll = cfg["collective"]
    dt = spec.numpy_dtype(cfg["dtype"])
    n = be.world_size
    be.check(coll, dt, cfg["op"])
    op = cfg["op"] if coll in spec.REDUCING else "sum"
    inputs = [verify.input_table(dt, op, n, r) for r in range(n)]
    tables = {"inputs": inputs, "input": inputs[be.rank], "reduced": verify.reduced_table(dt, op, n)}
    largest = max(spec.counts(coll, s, dt.itemsize, n)[3] for s in cfg["sizes"]) // dt.itemsize
    # Allocated once at the largest size and touched, as nccl-tests does: no row pays page faults
    # for the benchmark's own buffers.
    registered = cfg.get("registered", False)  # ringcomm-bench --registered: comm.alloc buffers
    bufs = tuple(be.alloc(max(largest, 1), dt) if registered and i < 2 else np.zeros(max(largest, 1), dt)
                 for i in range(3))
    for b in bufs:
        b[...] = 0  # np.zeros maps untouched pages; writing them faults them in now
    be.register(bufs[0], bufs[1])
    # The rows' own bookkeeping once, before any row is timed: the first gather_f64 makes ringcomm
    # load its native loop for float64 (~20 ms of CPU) and the first barrier connects ranks that no
    # collective has connected (~20 ms on 4 ranks). Done inside a row, by a rank that finished its
    # timed calls first, it took a core from peers still timing theirs: their last call of the
    # first row took 2-10 ms (4 ranks on 2 cores, 64 KiB all_reduce).
    be.gather_f64([0.0] * ROW_STATS)   # as each row gathers
    be.barrier()
    first_warm_s = FIRST_ROW_WARM_S if cfg["warmup"] else 0.0
    for algo in cfg["algos"]:
        if be.name == "ringcomm":
            be.algo = algo
        for i, size in enumerate(cfg["sizes"]):
            if cfg.get("reproducible"):
                row = reproducible.measure(be, cfg, bufs, size)
                if be.rank == 0:
                    emit({**row, "algo": algo, "index": i})
                continue
            for in_place in (False, True):
                gate(cfg, be.rank)
                row = measure(be, cfg, tables, bufs, coll, size, in_place, first_warm_s)
                first_warm_s = 0.0
                if be.rank == 0:
                    emit({"event": "row", "algo": algo, "index": i, **row})


def bind(cfg) -> None:
    """--bind: this rank on usable CPU (local rank) mod their number, whichever library it runs
    (ringcomm-run --bind core's rule); RINGCOMM_HOST_CPUS keeps ringcomm's oversubscription rules
    counting the CPUs the ranks share. The local rank is torchrun's, or MPICH's hydra's."""
    if not cfg.get("bind"):
        return
    from ringcomm.env import HOST_CPUS_ENV
    from ringcomm.launch import core_for, usable_cpus
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("MPI_LOCALRANKID") or os.environ.get("PMI_RANK") or 0)
    os.environ[HOST_CPUS_ENV] = str(len(usable_cpus()))
    os.sched_setaffinity(0, {core_for(local)})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name, cfg = argv[0], json.loads(argv[1])
    be = None
    try:
        bind(cfg)
        be = make_backend(name, None)
        if be.rank == 0:
            emit({"event": "start", "facts": {**python_facts(), **be.facts()}, "world_size": be.world_size})
        run(be, cfg)
        be.barrier()
        if be.rank == 0:
            emit({"event": "done"})
        return 0
    except Unsupported as e:
        if be is None or be.rank == 0:
            emit({"event": "unsupported", "message": str(e)})
        return 3
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line, with the trace on stderr
        traceback.print_exc()
        emit({"event": "error", "message": f"{type(e).__name__}: {e}".splitlines()[0]})
        return 1
    finally:
        if be is not None:
            try:
                be.close()
            except Exception:  # noqa: BLE001 - closing after a failure must not hide it
                pass


if __name__ == "__main__":
    sys.exit(main())
