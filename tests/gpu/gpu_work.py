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


def _delay(stream_ptr: int, ns: int) -> None:
    """Queue a kernel that sleeps ``ns`` on the GPU (one thread, nanosleep) on a raw stream."""
    import cupy
    from numba import cuda

    from stage_c0_ipc import _delay_kernel     # stage C0's kernel (this folder; C0 itself runs without ringcomm)
    _delay_kernel()[1, 1, cuda.external_stream(stream_ptr)](ns, cuda.as_cuda_array(cupy.zeros(1, cupy.int32)))


def lag(comm, count: int, lag_rank: int) -> dict:
    """C1: one rank's caller stream busy for 500 ms before the call; a small FIFO reused hundreds of times.
    The host call must return before the GPU is done (on the lagging rank: its stream still busy then),
    and the result be bit-exact."""
    import time

    import cupy
    n, r = comm.world_size, comm.rank
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        comm.all_reduce(cupy.ones(count, cupy.float32))     # compiles the kernels, connects: not in host_s
        s.synchronize()
        x = cupy.arange(count, dtype=cupy.float32) % 1024 + r       # exact in float32, summed
        if r == lag_rank:
            _delay(s.ptr, 500_000_000)
        t0 = time.perf_counter()
        comm.all_reduce(x)
        host_s = time.perf_counter() - t0
        busy_at_return = not s.done
    s.synchronize()
    want = (cupy.arange(count, dtype=cupy.float32) % 1024) * n + n * (n - 1) / 2
    bad = int((x != want).sum())
    slices = len(next(reversed(comm._device.executor._plans.values()))[1])
    return {"rank": r, "host_s": host_s, "busy_at_return": busy_at_return, "wrong": bad, "slices": slices}


def loop_until_error(comm, seconds: float, die_after: int | None) -> dict:
    """C4: all_reduce in a loop; with ``die_after`` this rank exits abruptly after that many calls."""
    import os
    import time

    import cupy
    from ringcomm.errors import RingcommError
    x = cupy.ones(1 << 20, cupy.float32)
    t0, k = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        if die_after is not None and k == die_after:
            os._exit(1)
        try:
            comm.all_reduce(x)
        except RingcommError as e:
            t1 = time.monotonic()
            comm.close()
            closed = time.monotonic()
            stream = cupy.cuda.get_current_stream()
            while not stream.done and time.monotonic() - closed < 10.0:   # a poll with a deadline
                time.sleep(0.01)
            return {"error": f"{type(e).__name__}: {e}"[:300], "after_last_ok_s": t1 - t0,
                    "close_s": closed - t1, "stream_idle": stream.done, "calls": k}
        k += 1
    return {"error": None, "calls": k}
