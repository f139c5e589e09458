"""Run on 2 nodes x 2 ranks under numba's CUDA simulator: device buffers between hosts (staged through the
network transport's registered host slots) and on one host (cuda_ipc); checks results and link kinds."""
import sys

import numpy as np
from numba import cuda

import ringcomm

with ringcomm.init() as comm:
    n, r = comm.world_size, comm.rank
    ok = True
    for algo in ("ring", "tree"):
        x = cuda.to_device(np.full(3001, r + 1, dtype=np.float32))
        comm.all_reduce(x, algo=algo)
        ok &= bool((x.copy_to_host() == n * (n + 1) / 2).all())
    out = cuda.to_device(np.zeros(40 * n, np.int32))
    comm.all_gather(cuda.to_device(np.full(40, r, np.int32)), out)
    ok &= bool((out.copy_to_host() == np.repeat(np.arange(n), 40)).all())
    kinds = {p: type(c).__name__ for (p, d), c in comm._device.links.conns.items() if d == "send"}
    node = r // 2
    ok &= all(kind == ("CudaIpcSend" if p // 2 == node else "StagedSend") for p, kind in kinds.items())
    print(f"rank {r}: device links {kinds} {'OK' if ok else 'WRONG'}")
sys.exit(0 if ok else 1)
