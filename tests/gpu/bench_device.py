"""Device benchmark: ringcomm's collectives on GPU buffers, ranks sharing GPU 0, against the ceiling of a
cupy device-to-device copy of the same size.

    python tests/gpu/bench_device.py [--ranks 2 4] [--sizes 1MiB 64MiB 1GiB] [--out bench.json]

Sizes follow nccl-tests: the bytes of the larger buffer (all_gather's output, reduce_scatter's input), float32.
A time is the slowest rank's mean over the timed iterations, host loop included, from a barrier to the
caller's stream having finished; algbw = size / time, busbw = algbw x (2(n-1)/n for all_reduce, (n-1)/n
for all_gather and reduce_scatter, 1 for broadcast). The copy moves ``size`` bytes once: its GB/s is the
most any of them can reach on one GPU. host us/slice: the host's time to queue a call (it never waits for
the GPU) over the call's slices; against time / slices it says whether the host or the GPU sets the pace.
Prints a table; exits 0 with a note where there is no GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import call_collective, unavailable

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def parse_size(text: str) -> int:
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def iterations(size: int) -> tuple[int, int]:
    """(warm-up, timed) iterations: more for small sizes, where a call takes milliseconds."""
    return (5, 20) if size <= 4 << 20 else (2, 5) if size <= 256 << 20 else (1, 3)


def rank_bench(comm, sizes, profile: bool = False) -> dict:
    """Runs on every rank; returns {"rows": [(collective, size, seconds per call, host us per slice)],
    "mem_ops": whether the GPU orders the FIFOs by stream memory operations (else the host polls),
    "profile": with ``profile``, rank 0's cProfile of its timed all_reduce loops (top functions)}."""
    import cProfile
    import io
    import pstats

    import cupy
    from ringcomm.transport import cuda_rt
    cupy.cuda.Device(0).use()
    n, r = comm.world_size, comm.rank
    stream = cupy.cuda.Stream(non_blocking=True)
    results = []
    prof = cProfile.Profile() if profile and r == 0 else None
    with stream:
        for size in sizes:
            count = size // 4 // n * n
            for coll in COLLECTIVES:
                big = cupy.ones(count, cupy.float32)
                part = big[r * (count // n):(r + 1) * (count // n)]     # in place, as nccl-tests can
                x, out = {"all_gather": (part, big), "reduce_scatter": (big, part)}.get(coll, (big, None))
                warm, timed = iterations(size)
                for _ in range(warm):
                    call_collective(comm, coll, x, out)
                stream.synchronize()
                comm.barrier()
                profiled = prof is not None and coll == "all_reduce"
                if profiled:
                    prof.enable()
                t0 = time.perf_counter()
                for _ in range(timed):
                    call_collective(comm, coll, x, out)
                host = time.perf_counter() - t0             # the host's own time: it never waits for the GPU
                if profiled:
                    prof.disable()
                stream.synchronize()
                slices = len(next(reversed(comm._device.executor._plans.values()))[1])
                results.append((coll, size, (time.perf_counter() - t0) / timed, host / timed / slices * 1e6))
                del big, part, x, out
                cupy.get_default_memory_pool().free_all_blocks()
    text = None
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        text = buf.getvalue()
    return {"rows": results, "mem_ops": cuda_rt.get().mem_ops(), "profile": text}


def copy_ceiling(size: int) -> float:
    """GB/s of one cudaMemcpyAsync device-to-device of ``size`` bytes on GPU 0."""
    import cupy
    rt = cupy.cuda.runtime
    with cupy.cuda.Device(0):
        a, b = cupy.ones(size // 4, cupy.float32), cupy.empty(size // 4, cupy.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        warm, timed = iterations(size)
        for i in range(warm + timed):
            if i == warm:
                start.record(stream)
            rt.memcpyAsync(b.data.ptr, a.data.ptr, a.nbytes, rt.memcpyDeviceToDevice, stream.ptr)
        stop.record(stream)
        stop.synchronize()
        seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / timed
        del a, b
        cupy.get_default_memory_pool().free_all_blocks()
    return size / seconds / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=["1MiB", "64MiB", "1GiB"])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--profile", action="store_true",
                    help="print rank 0's cProfile of its timed all_reduce loops (where the host's time per slice goes)")
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"device benchmark skipped: {why}")
        if args.out:
            json.dump({"skipped": why}, open(args.out, "w"), indent=1)
        return 0
    from harness import World
    sizes = [parse_size(s) for s in args.sizes]
    ceiling = {s: copy_ceiling(s) for s in sizes}
    rows, profiles = [], []
    print(f"{'ranks':>5} {'collective':<15}{'size':>10}{'time ms':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}"
          f"{'copy GB/s':>11}{'host us/slice':>14}", flush=True)
    for n in args.ranks:
        with World(n, {}, timeout=300) as w:
            answers = w.run(rank_bench, sizes, args.profile, timeout=600)
        per_rank = [a["rows"] for a in answers]
        profiles.append((n, answers[0]["profile"]))
        print(f"{n} ranks: stream memory operations {'on' if all(a['mem_ops'] for a in answers) else 'OFF'} "
              f"(off: the host polls each stream before moving a FIFO counter)", flush=True)
        for i, (coll, size, _, _) in enumerate(per_rank[0]):
            t = max(res[i][2] for res in per_rank)             # the slowest rank sets the pace
            algbw = size / t / 1e9
            host_us = max(res[i][3] for res in per_rank)
            row = dict(ranks=n, collective=coll, bytes=size, seconds=t, algbw_GBps=algbw,
                       busbw_GBps=algbw * BUS[coll](n), copy_GBps=ceiling[size], host_us_per_slice=host_us)
            rows.append(row)
            print(f"{n:>5} {coll:<15}{size:>10}{t * 1e3:>11.3f}{algbw:>12.1f}{row['busbw_GBps']:>12.1f}"
                  f"{ceiling[size]:>11.1f}{host_us:>14.1f}", flush=True)
    for n, text in profiles:
        if text:
            print(f"\nrank 0 of {n}, its timed all_reduce loops, by own time:\n{text}")
    if args.out:
        json.dump({"rows": rows, "note": "ranks share GPU 0; copy = cupy device-to-device memcpy"},
                  open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
