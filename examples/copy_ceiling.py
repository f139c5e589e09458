"""How fast can one or two cores fill a shared-memory buffer? The ceiling of a host copy collective.

    python examples/copy_ceiling.py [--sizes 1M,16M,64M] [--reps 9]

A 2-rank broadcast must write the whole vector into the receiver's buffer, and an all_gather must
write every rank's whole output: on a host, these collectives are copies, and no library can move
the bytes faster than the cores can write them. This program measures that ceiling on this
machine: one process copying N bytes into a /dev/shm buffer, then two processes each copying half
of it at the same time (what a broadcast could reach if the root wrote half of the receiver's
buffer while the receiver copied the other half), and two processes each filling a buffer of its
own at once (what an out-of-place all_gather on 2 ranks asks of the machine: every rank writes its
whole output). The last column fills each buffer with no source at all (a memset): the cheapest
way a byte can land, so no copy collective writes faster than that. Prints GB/s of the
destination filled, the median of ``--reps`` timed copies (or fills).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

from ringcomm.bench.spec import parse_size


def _copy(name: str, lo: int, hi: int, reps: int, start, done, times, source: bool = True) -> None:
    """Copy a private source into bytes [lo, hi) of segment ``name`` ``reps`` times (or, with no
    ``source``, fill them with a byte), each started together with the other writers (``start``)."""
    seg = shared_memory.SharedMemory(name=name)
    dst = np.ndarray(hi - lo, np.uint8, seg.buf, offset=lo)
    src = np.ones(hi - lo, np.uint8)  # written once: its pages are mapped before the clock starts
    dst[:] = 0
    for i in range(reps):
        start.wait()
        t0 = time.perf_counter()
        if source:
            dst[:] = src
        else:
            dst.fill(i & 0xFF)
        times.put((i, time.perf_counter() - t0))
        done.wait()
    del dst
    seg.close()


def fill(nbytes: int, writers: int, shared: bool, reps: int, source: bool = True) -> float:
    """GB/s of destination bytes per second, each repetition timed by its slowest writer.
    shared: the writers fill halves of one buffer; else each fills a whole buffer of its own.
    source: copy from a private buffer; else write a byte everywhere (memset)."""
    segs = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(1 if shared else writers)]
    try:
        start, done, times = mp.Barrier(writers), mp.Barrier(writers), mp.Queue()
        procs = []
        for w in range(writers):
            seg, lo, hi = (segs[0], w * nbytes // writers, (w + 1) * nbytes // writers) if shared \
                else (segs[w], 0, nbytes)
            procs.append(mp.Process(target=_copy, args=(seg.name, lo, hi, reps, start, done, times, source)))
        for p in procs:
            p.start()
        slowest = [0.0] * reps  # a round takes as long as its slowest writer
        for _ in range(reps * writers):
            i, t = times.get(timeout=120)
            slowest[i] = max(slowest[i], t)
        for p in procs:
            p.join(30)
        written = nbytes * (1 if shared else writers)
        return written / statistics.median(slowest) / 1e9
    finally:
        for seg in segs:
            seg.close()
            seg.unlink()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M", help="destination sizes, K/M/G suffixes (default 1M,16M,64M)")
    p.add_argument("--reps", type=int, default=9, help="timed copies per figure (default 9)")
    a = p.parse_args(argv)
    print(f"{'bytes':>10}  {'1 core':>8}  {'2 cores, halves of one buffer':>30}  {'2 cores, a buffer each':>23}"
          f"  {'the same, memset':>20}   (GB/s)")
    for n in (parse_size(s) for s in a.sizes.split(",")):
        one = fill(n, 1, True, a.reps)
        halves = fill(n, 2, True, a.reps)
        each = fill(n, 2, False, a.reps)
        unread = fill(n, 2, False, a.reps, source=False)
        print(f"{n:>10}  {one:>8.1f}  {halves:>21.1f} ({halves / one:.2f}x)  {each:>14.1f} ({each / one:.2f}x)"
              f"  {unread:>11.1f} ({unread / one:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
