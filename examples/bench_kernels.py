"""Throughput of the host reduction kernels on one 512 KiB slice (the executor's largest), per dtype and op.

    python examples/bench_kernels.py [--kib 512] [--repeat 7]

GB/s counts the slice once (512 KiB / time), as a transport does; the kernel itself reads two slices and
writes one. "reduce" is in place (dst = dst op src), the executor's usual call; "copy" writes a third
array. A slice this size stays in cache, so these are upper bounds for the arithmetic, not for memory.
"""
import argparse
import time

import numpy as np

from ringcomm.kernels import host


def best_seconds(fn, repeat, budget=0.05):
    fn()
    n, t = 1, 0.0
    while t < budget / 10:                      # grow the inner loop to ~5 ms so timer noise vanishes
        n *= 2
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return min(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=512, help="slice size in KiB")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per figure (best is shown)")
    args = ap.parse_args()
    nbytes = args.kib * 1024
    rng = np.random.default_rng(0)
    ops = ("sum", "prod", "min", "max")
    print(f"reduce_copy / reduce / postprocess(avg) on {args.kib} KiB slices, GB/s (slice bytes / time)")
    print(f"{'dtype':>9} " + " ".join(f"{op + ' ' + kind:>11}" for op in ops for kind in ("copy", "reduce"))
          + f" {'avg div':>8}")
    for dt in host.SUPPORTED_DTYPES:
        n = nbytes // dt.itemsize
        if dt.kind in "iu":
            a, b = (rng.integers(0, 100, n).astype(dt) for _ in range(2))
        else:
            a, b = (rng.uniform(0.5, 2.0, n).astype(dt) for _ in range(2))   # no denormals, no overflow
        out = np.empty_like(a)
        t0 = time.perf_counter()
        host.reduce_copy(out, a, b, "sum")          # first call: compiles the 16-bit kernel (or loads it)
        first = time.perf_counter() - t0
        ones = np.ones_like(a)                       # in-place prod by 1: same work, no drift into
        cells = []                                   # overflow or (slow) denormals over many runs
        for op in ops:
            dst, src = a.copy(), ones if op == "prod" else b
            cells.append(best_seconds(lambda: host.reduce_copy(out, a, b, op), args.repeat))
            cells.append(best_seconds(lambda: host.reduce(dst, src, op), args.repeat))
        fresh = a.copy()

        def avg():
            np.copyto(fresh, a)                      # divide fresh values: repeated division would
            host.postprocess(fresh, "avg", 3)        # underflow into slow denormals
        copy_time = best_seconds(lambda: np.copyto(fresh, a), args.repeat)
        cells.append(max(best_seconds(avg, args.repeat) - copy_time, 1e-9))
        row = " ".join(f"{nbytes / s / 1e9:11.1f}" for s in cells[:-1]) + f" {nbytes / cells[-1] / 1e9:8.1f}"
        note = f"   (first call {first * 1e3:.0f} ms)" if first > 0.05 else ""
        print(f"{dt.name:>9} {row}{note}")


if __name__ == "__main__":
    main()
