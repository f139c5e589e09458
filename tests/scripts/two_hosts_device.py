"""Run on 2 nodes x 2 ranks under numba's CUDA simulator: every collective on device buffers, between hosts
(staged through the network transport's registered host slots by the proxy thread) and on one host
(cuda_ipc); checks results and link kinds."""
import sys

import numpy as np
from numba import cuda

import ringcomm


def check(comm) -> list[str]:
    n, r = comm.world_size, comm.rank
    dev, host = cuda.to_device, lambda a: a.copy_to_host()
    wrong = []
    for algo in ("ring", "tree"):
        x = dev(np.full(3001, r + 1, dtype=np.float32))
        comm.all_reduce(x, algo=algo)
        if not (host(x) == n * (n + 1) / 2).all():
            wrong.append(f"all_reduce {algo}")
    out = dev(np.zeros(40 * n, np.int32))
    comm.all_gather(dev(np.full(40, r, np.int32)), out)
    if not (host(out) == np.repeat(np.arange(n), 40)).all():
        wrong.append("all_gather")
    part = dev(np.zeros(500, np.float64))
    comm.reduce_scatter(dev(np.arange(500 * n, dtype=np.float64) + r), part)
    if not (host(part) == n * np.arange(500 * r, 500 * (r + 1)) + n * (n - 1) / 2).all():
        wrong.append("reduce_scatter")
    b = dev(np.arange(700, dtype=np.int64) * (r == 1))
    comm.broadcast(b, root=1)
    if not (host(b) == np.arange(700)).all():
        wrong.append("broadcast")
    y = dev(np.full(900, r, np.int32))
    comm.reduce(y, root=2)
    if r == 2 and not (host(y) == n * (n - 1) / 2).all():
        wrong.append("reduce")
    a2a = dev(np.zeros(30 * n, np.int32))
    comm.all_to_all(dev(np.repeat(np.arange(n, dtype=np.int32) + 10 * r, 30)), a2a)
    if not (host(a2a) == np.repeat(10 * np.arange(n) + r, 30)).all():
        wrong.append("all_to_all")
    g = dev(np.zeros(20 * n, np.float32)) if r == 3 else None
    comm.gather(dev(np.full(20, r, np.float32)), g, root=3)
    if r == 3 and not (host(g) == np.repeat(np.arange(n), 20)).all():
        wrong.append("gather")
    s = dev(np.zeros(25, np.int32))
    comm.scatter(dev(np.repeat(np.arange(n, dtype=np.int32), 25)) if r == 0 else None, s, root=0)
    if not (host(s) == r).all():
        wrong.append("scatter")
    peer = r ^ 2                                       # the same local rank on the other host
    p = dev(np.full(333, r, np.uint8))
    if r < 2:
        comm.send(p, peer)
    else:
        comm.recv(p, peer)
        if not (host(p) == peer).all():
            wrong.append("send/recv")
    comm.barrier()
    return wrong


with ringcomm.init() as comm:
    r = comm.rank
    wrong = check(comm)
    kinds = {p: type(c).__name__ for (p, d), c in comm._device.links.conns.items() if d == "send"}
    node = r // 2
    wrong += [f"link to {p}: {kind}" for p, kind in kinds.items()
              if kind != ("CudaIpcSend" if p // 2 == node else "StagedSend")]
    print(f"rank {r}: device links {kinds} {'OK' if not wrong else 'WRONG: ' + ', '.join(wrong)}")
sys.exit(0 if not wrong else 1)
