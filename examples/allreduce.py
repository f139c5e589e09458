"""The Quick-start demo: every rank contributes its rank + 1, all_reduce sums them.

    ringcomm-run -n 4 examples/allreduce.py

Each rank prints its result and whether it is right; the exit status is non-zero
if any rank got a wrong answer. The same script runs under torchrun and mpirun.
"""
import sys

import numpy as np

import ringcomm


def main() -> int:
    with ringcomm.init() as comm:
        n, r = comm.world_size, comm.rank
        x = np.full(1 << 20, r + 1, dtype=np.float32)        # 4 MiB per rank
        comm.all_reduce(x, ringcomm.SUM)
        want = n * (n + 1) / 2
        ok = bool((x == want).all())
        print(f"rank {r} of {n}: all_reduce(sum) of {x.size} floats -> {x[0]:g} "
              f"(expected {want:g}) {'OK' if ok else 'WRONG'}")

        blocks = np.empty(n * 4, dtype=np.int64)
        comm.all_gather(np.full(4, r, dtype=np.int64), blocks)
        gathered_ok = bool((blocks == np.repeat(np.arange(n), 4)).all())
        print(f"rank {r}: all_gather -> {blocks[::4].tolist()} {'OK' if gathered_ok else 'WRONG'}")
        comm.barrier()
    return 0 if ok and gathered_ok else 1


if __name__ == "__main__":
    sys.exit(main())
