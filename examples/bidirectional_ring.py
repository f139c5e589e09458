"""A bidirectional ring all_reduce, written as chunk flows, registered, verified and run.

    ringcomm-run -n 4 examples/bidirectional_ring.py

Half of the chunks go round the ring clockwise (r -> r+1), the other half counter-clockwise
(r -> r-1), so both links of every rank carry data in both directions; each half is NCCL's
ring all_reduce (reduce-scatter, then all-gather). Every rank builds the same program,
registers it as algo="bidir_ring", checks it symbolically (ringcomm.verify), then
all-reduces random integers and compares with numpy.
"""
import sys

import numpy as np

import ringcomm
from ringcomm.schedule.lang import Program, program_builder


def bidirectional_ring(n: int) -> Program:
    # With 2 ranks both directions share the one pair of links: two chunks posted at once fill a
    # 2-slot FIFO and the ranks deadlock (register_algorithm's check says so), so go one way.
    directions = ((+1, 0), (-1, n)) if n > 2 else ((+1, 0),)
    p = Program("all_reduce", n, nchunks=n * len(directions), name="bidir_ring")
    for direction, first in directions:                # chunks 0..n-1 clockwise, n..2n-1 counter
        for c in range(n):
            chunk, start = first + c, (c + 1) % n      # the chunk starts at rank c+1 ...
            at = lambda k: (start + direction * k) % n  # noqa: E731 - k hops along this direction
            v = p.chunk(start, chunk)
            for k in range(1, n):                      # ... collects one contribution per hop,
                v = p.chunk(at(k), chunk).reduce(v, output=(k == n - 1))
            for k in range(n, 2 * n - 1):              # ... and the finished sum goes round again
                v = v.copy(at(k))
    if n == 1:
        p.chunk(0, 0).output()
    return p


def main() -> int:
    ringcomm.register_algorithm("bidir_ring", "all_reduce", program_builder(bidirectional_ring))
    with ringcomm.init() as comm:
        n, r = comm.world_size, comm.rank
        report = ringcomm.verify("all_reduce", "bidir_ring", n, count=1000)
        if r == 0:
            print(report.summary())
        x = np.random.default_rng([1, r]).integers(-1000, 1000, 100_003).astype(np.int64)
        want = sum(np.random.default_rng([1, k]).integers(-1000, 1000, 100_003).astype(np.int64)
                   for k in range(n))
        comm.all_reduce(x, algo="bidir_ring")
        ok = bool((x == want).all()) and report.ok
        print(f"rank {r} of {n}: bidir_ring all_reduce of {x.size} int64 {'OK' if ok else 'WRONG'}")
        comm.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
