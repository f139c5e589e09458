"""Run on 2 nodes x 2 ranks: checks results and that links across hosts are TCP, within a host shm."""
import sys

import numpy as np

import ringcomm

with ringcomm.init() as comm:
    n, r = comm.world_size, comm.rank
    ok = True
    for algo in ("ring", "tree"):
        x = np.full(300_001, r + 1, dtype=np.float64)
        comm.all_reduce(x, algo=algo)
        ok &= bool((x == n * (n + 1) / 2).all())
    out = np.empty(4 * n, np.int32)
    comm.all_gather(np.full(4, r, np.int32), out)
    ok &= bool((out == np.repeat(np.arange(n), 4)).all())
    b = np.arange(1000.0) if r == n - 1 else np.zeros(1000)
    comm.broadcast(b, root=n - 1)
    ok &= bool((b == np.arange(1000.0)).all())
    comm.barrier()
    kinds = {p: comm.transport_to(p) for p in range(n) if p != r}
    node = r // 2
    ok &= all(kind == ("shm" if p // 2 == node else "tcp") for p, kind in kinds.items())
    print(f"rank {r}: links {kinds} {'OK' if ok else 'WRONG'}")
sys.exit(0 if ok else 1)
