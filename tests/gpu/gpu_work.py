"""Functions the GPU tests run on every rank (imported by name in the spawned ranks)."""
from __future__ import annotations

import numpy as np


def use_gpu(comm, one_per_rank: bool) -> int:
    """Make this rank's GPU current: GPU 0 for all (ranks sharing it), or GPU ``rank``."""
    import cupy
    dev = comm.rank if one_per_rank else 0
    cupy.cuda.Device(dev).use()
    return dev


def stream_order(comm) -> str | None:
    """The collective runs after work queued on the caller's stream, and the caller's later work after it."""
    import cupy
    n = comm.world_size
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.zeros(1 << 22, cupy.float32)
        for _ in range(30):                 # queued on s; none of it has to be done when all_reduce is called
            x += 1
        comm.all_reduce(x)
        x *= 2                              # queued on s after the collective
    s.synchronize()
    got = cupy.asnumpy(x)
    want = np.float32(30 * n * 2)
    bad = got != want
    return None if not bad.any() else f"rank {comm.rank}: {int(bad.sum())} wrong, e.g. {got[bad][:3]}"


def torch_default_stream(comm) -> str | None:
    """A torch tensor on torch's default stream, bfloat16 included."""
    import torch
    n, r = comm.world_size, comm.rank
    t = torch.full((1 << 20,), float(r + 1), dtype=torch.bfloat16, device="cuda")
    t.mul_(2)
    comm.all_reduce(t)
    want = float(sum(2 * (k + 1) for k in range(n)))
    got = t.float().cpu().numpy()              # torch orders this after its current stream
    return None if (got == want).all() else f"rank {r}: got {got[:4]} want {want}"


def wrong_device(comm) -> str | None:
    """After a call on GPU 0, a buffer on GPU 1 is refused with a clear message."""
    import cupy
    with cupy.cuda.Device(0):
        comm.all_reduce(cupy.ones(8, cupy.float32))
    with cupy.cuda.Device(1):
        y = cupy.ones(8, cupy.float32)
    try:
        comm.all_reduce(y)
    except ValueError as e:
        return None if "one communicator, one GPU" in str(e) else f"unclear message: {e}"
    return "a buffer on another GPU was accepted"
