"""What the ranks of tests/test_device_proxy.py run (by name, in spawned processes): device calls whose peers
are "on another host" (RINGCOMM_TRANSPORT=tcp), staged by the proxy thread, on the fake runtime."""
from __future__ import annotations

import io
import sys
import threading
import time

import numpy as np

import fake_cuda
from ringcomm.errors import RingcommError

def install_slow(comm, delay: float):
    fake_cuda.install(delay=delay)


COUNT = 3000            # float32: with 1 KiB device slots, a few dozen slices per call


def _want(n: int) -> np.ndarray:
    return np.arange(COUNT, dtype=np.float32) * n + n * (n - 1) / 2


def ahead_of_a_slow_gpu(comm) -> dict:
    """One all_reduce on a GPU whose every kernel takes a while: did the call return before our stream had
    finished, did the caller's thread ever query a stream, and is the result right once the GPU is done."""
    from numba import cuda
    rt = fake_cuda.current()
    x = cuda.to_device(np.arange(COUNT, dtype=np.float32) + comm.rank)
    comm.barrier()
    rt.calls.clear()
    captured, saved = io.StringIO(), sys.stderr           # RINGCOMM_DEBUG=info's lines, at connect
    sys.stderr = captured
    try:
        t0 = time.monotonic()
        comm.all_reduce(x)
        returned = time.monotonic() - t0
    finally:
        sys.stderr = saved
    me = threading.current_thread().name
    queried = sorted({c for c, _, thread in list(rt.calls) if thread == me and c == "cudaStreamQuery"})
    proxy = sorted({c for c, _, thread in list(rt.calls) if thread.startswith("ringcomm-proxy")})
    behind = not rt.stream_idle(comm._device.stream)
    t1 = time.monotonic()
    rt.synchronize(0)
    gpu_after = time.monotonic() - t1
    return {"log": captured.getvalue(), "returned_s": returned, "gpu_behind": behind, "caller_queried": queried, "proxy_calls": proxy,
            "gpu_after_s": gpu_after, "right": bool(np.array_equal(x.copy_to_host(), _want(comm.world_size)))}


def call_then_close(comm) -> dict:
    """All_reduce on a slow GPU and close at once, with slices still queued for the proxy: the close posts
    them (so the peer's call completes), stays within its grace, frees nothing the GPU still uses, and the
    result is right."""
    from numba import cuda
    rt = fake_cuda.current()
    x = cuda.to_device(np.arange(COUNT, dtype=np.float32) + comm.rank)
    comm.all_reduce(x)
    queued = sum(len(c.queue) for c in comm._device.links.conns.values() if hasattr(c, "queue"))
    t0 = time.monotonic()
    comm.close()
    close_s = time.monotonic() - t0
    rt.synchronize(0)
    return {"queued_at_close": queued, "close_s": close_s, "violations": rt.violations,
            "right": bool(np.array_equal(x.copy_to_host(), _want(comm.world_size))),
            "proxy_alive": comm._device.proxy.alive()}


def abort_while_the_proxy_waits(comm, after: float) -> dict:
    """Our GPU stops: the proxy waits for events that never complete and the peer for our data. abort() from
    another thread must end the call at once, naming the abort."""
    from numba import cuda
    x = cuda.to_device(np.ones(COUNT, np.float32))
    comm.all_reduce(x)                                   # connected, warm
    fake_cuda.current().synchronize(0)
    fake_cuda.current().freeze()
    timer = threading.Timer(after, comm.abort)           # the stimulus, not a synchronisation
    timer.start()
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        return {"error": None}
    except RingcommError as e:
        return {"error": f"{type(e).__name__}: {e}", "after": time.monotonic() - t0,
                "proxy_waiting": sum(len(c.queue) for c in comm._device.links.conns.values() if hasattr(c, "queue"))}
    finally:
        timer.cancel()


def stuck_gpu_timeout(comm) -> dict:
    """Our GPU stops for good: the proxy's wait for its events has the communicator's deadline, and the
    caller's call fails naming this rank's GPU, the peer and the transport."""
    from numba import cuda
    x = cuda.to_device(np.ones(COUNT, np.float32))
    fake_cuda.current().freeze()
    return _three_calls_or_error(comm, x)


def wait_for_error(comm) -> dict:
    from numba import cuda
    return _three_calls_or_error(comm, cuda.to_device(np.ones(COUNT, np.float32)))


def _three_calls_or_error(comm, x) -> dict:
    """Three all_reduces of x: {"error": None}, or the error that ended them and how long it took."""
    t0 = time.monotonic()
    try:
        for _ in range(3):
            comm.all_reduce(x)
        return {"error": None}
    except RingcommError as e:
        return {"error": f"{type(e).__name__}: {e}", "after": time.monotonic() - t0}
