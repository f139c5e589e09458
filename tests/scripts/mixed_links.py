"""Run on 2 nodes x 3 ranks with the default FIFO and slice sizes: in a ring or a tree some ranks
have only shm links (their calls run in the native engine) and their neighbours a tcp link too (the
reference engine); both must cut a call in the same slices. 1M floats: several slices a chunk."""
import sys

import numpy as np

import ringcomm

with ringcomm.init() as comm:
    n, r = comm.world_size, comm.rank
    bad = []
    for algo in ("ring", "tree", "doubling", "rabenseifner"):
        x = np.full(1_000_003, r + 1, dtype=np.float32)
        comm.all_reduce(x, algo=algo)
        if not (x == n * (n + 1) / 2).all():
            bad.append(f"all_reduce {algo}")
    for algo in ("ring", "binomial"):
        b = np.arange(1_000_003, dtype=np.float32) if r == 0 else np.zeros(1_000_003, np.float32)
        comm.broadcast(b, 0, algo=algo)
        if not (b == np.arange(1_000_003, dtype=np.float32)).all():
            bad.append(f"broadcast {algo}")
    kinds = sorted({comm.transport_to(p) for p in range(n) if p != r})
    print(f"rank {r}: links {kinds} {'OK' if not bad else 'WRONG ' + ', '.join(bad)}")
sys.exit(0 if not bad else 1)
