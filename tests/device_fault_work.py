"""What the ranks of tests/test_device_faults.py run (by name, in spawned processes), on the fake runtime."""
from __future__ import annotations

import io
import sys
import threading
import time

import numpy as np

import fake_cuda
from ringcomm.errors import RingcommError


def install(comm, **config):
    fake_cuda.install(**config)


def _reduce_and_gather(comm, count: int) -> str | None:
    """An all_reduce and an all_gather of simulator arrays, checked after the fake GPU finished them."""
    from numba import cuda
    n, r = comm.world_size, comm.rank
    x = cuda.to_device(np.arange(count, dtype=np.float32) + r)
    comm.all_reduce(x)
    whole = cuda.to_device(np.zeros(count * n, np.int32))
    comm.all_gather(cuda.to_device(np.full(count, r, np.int32)), whole)
    fake_cuda.current().synchronize(0)          # the caller's stream: the results are ready after it
    want = np.arange(count, dtype=np.float32) * n + n * (n - 1) / 2
    if not np.array_equal(x.copy_to_host(), want):
        return f"rank {r}: all_reduce wrong: {x.copy_to_host()[:4]} want {want[:4]}"
    if not np.array_equal(whole.copy_to_host(), np.repeat(np.arange(n, dtype=np.int32), count)):
        return f"rank {r}: all_gather wrong"
    return None


def collectives_and_paths(comm, count: int) -> dict:
    """Run, with RINGCOMM_DEBUG=info's lines captured; say which path each receiving link took."""
    captured, saved = io.StringIO(), sys.stderr
    sys.stderr = captured
    try:
        error = _reduce_and_gather(comm, count)
    finally:
        sys.stderr = saved
    modes = {peer: conn.mode for (peer, d), conn in comm._device.links.conns.items() if d == "recv"}
    return {"error": error, "modes": modes, "log": captured.getvalue()}


def close_and_report(comm) -> dict:
    """Close (timed); what the fake GPU saw: violations, whether the caller's stream drained."""
    from ringcomm.transport.cuda_rt import CudaError
    rt = fake_cuda.current()
    t0 = time.monotonic()
    comm.close()
    close_s = time.monotonic() - t0
    try:
        idle = rt.stream_idle(0)
    except CudaError:                                   # a sticky error answers every call
        idle = None
    return {"close_s": close_s, "violations": rt.violations, "caller_idle": idle}


def freeze_gpu(comm):
    fake_cuda.current().freeze()


def call_until_error(comm, seconds: float) -> dict:
    """all_reduce in a loop until one raises; the error and how long after the first call it came."""
    from numba import cuda
    x = cuda.to_device(np.ones(300, np.float32))
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            comm.all_reduce(x)
        except RingcommError as e:
            return {"type": type(e).__name__, "error": str(e), "after": time.monotonic() - t0}
    return {"type": None, "error": "no error", "after": seconds}


def inject(comm, call: str, error: str, sticky: bool = False):
    fake_cuda.current().fail(call, error, sticky)


def one_call(comm) -> dict:
    """One all_reduce: its error (type and text) or None, then whether a later call is refused."""
    from numba import cuda
    x = cuda.to_device(np.ones(300, np.float32))
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        fake_cuda.current().synchronize(0)
        return {"type": None}
    except RingcommError as e:
        out = {"type": type(e).__name__, "error": str(e), "after": time.monotonic() - t0}
    try:
        comm.all_reduce(x)
        out["later"] = "accepted"
    except RingcommError as e:
        out["later"] = type(e).__name__
    return out


def device_checks(comm) -> list[str]:
    """One communicator, one GPU, whatever the thread: run on a world of one."""
    from numba import cuda
    rt, errors = fake_cuda.current(), []
    x = cuda.to_device(np.ones(64, np.float32))
    comm.all_reduce(x)                                  # the path binds to cuda:0, current now
    result = {}

    def other_thread():
        rt.set_device(1)                                # another GPU current in this thread
        rt.calls.clear()
        comm.all_reduce(x)
        result["during"] = {dev for call, dev, _ in rt.calls if call != "cudaSetDevice"}
        result["after"] = rt.get_device()
    t = threading.Thread(target=other_thread)
    t.start()
    t.join(30)
    if result.get("during") != {0}:
        errors.append(f"calls from another thread ran with devices {result.get('during')} current, not {{0}}")
    if result.get("after") != 1:
        errors.append(f"the thread's own device was not restored: {result.get('after')}")
    y = cuda.to_device(np.ones(64, np.float32))
    rt.pointer_device[y._ary.__array_interface__["data"][0]] = 1
    errors += _refused(lambda: comm.all_reduce(y), "one communicator, one GPU")
    rt.capturing.add(0)
    errors += _refused(lambda: comm.all_reduce(x), "captured into a CUDA graph")
    rt.capturing.clear()
    comm.all_reduce(x)                                  # refusals do not break the communicator
    rt.synchronize(0)
    return errors


def _refused(fn, words: str) -> list[str]:
    try:
        fn()
    except ValueError as e:
        return [] if words in str(e) else [f"unclear refusal: {e}"]
    return [f"not refused ({words})"]


def abort_while_connecting(comm, after: float) -> dict:
    """A device call whose peer never comes, aborted from another thread after ``after`` seconds."""
    from numba import cuda
    x = cuda.to_device(np.ones(300, np.float32))
    timer = threading.Timer(after, comm.abort)      # the stimulus, not a synchronisation
    timer.start()
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        return {"error": None}
    except RingcommError as e:
        return {"error": str(e), "after": time.monotonic() - t0}
    finally:
        timer.cancel()


def lone_call(comm) -> str:
    """A device call the other rank does not make: its timeout message (with the watchdog's table)."""
    from numba import cuda
    x = cuda.to_device(np.ones(300, np.float32))
    try:
        comm.all_reduce(x)
    except RingcommError as e:
        return str(e)
    return "no error"


def die_after(comm, calls: int):
    """``calls`` all_reduces, then the process ends abruptly (no close: as a SIGKILL would)."""
    import os

    from numba import cuda
    x = cuda.to_device(np.ones(300, np.float32))
    for _ in range(calls):
        comm.all_reduce(x)
    os._exit(1)


def freeze_call_die(comm):
    """This rank's GPU stops, its host makes one more call (the host never waits for the GPU), then the
    process ends: the peer's stream waits for flags nobody will ever write."""
    import os

    from numba import cuda
    fake_cuda.current().freeze()
    comm.all_reduce(cuda.to_device(np.ones(300, np.float32)))
    os._exit(1)


def call_then_wait_for_the_gpu(comm) -> dict:
    """One call whose GPU work waits on the dying peer; then the caller's stream is synchronised (it must
    not hang), and the next call must fail naming the peer."""
    from numba import cuda
    rt = fake_cuda.current()
    x = cuda.to_device(np.ones(300, np.float32))
    comm.all_reduce(x)
    t0 = time.monotonic()
    rt.synchronize(0, timeout=30)                   # asserts if the caller's stream never drains
    drained = time.monotonic() - t0
    try:
        comm.all_reduce(x)
        return {"drained_s": drained, "next": None}
    except RingcommError as e:
        return {"drained_s": drained, "next": f"{type(e).__name__}: {e}"}


def async_first_call_and_groups(comm) -> list[str]:
    """The first device call is async, from a thread with cuda:1 current, on a buffer on cuda:1: the path binds
    to cuda:1 although the call runs on the progress thread, whose current device is cuda:0, and every CUDA
    call runs with cuda:1 current. Then a group of a host and a device call, from a thread with cuda:0 current,
    runs its device part on cuda:1 too."""
    from numba import cuda
    rt, errors = fake_cuda.current(), []
    rt.set_device(1)
    y = cuda.to_device(np.ones(64, np.float32))
    rt.pointer_device[y._ary.__array_interface__["data"][0]] = 1
    rt.calls.clear()
    comm.all_reduce(y, async_op=True).wait()
    # cudaPointerGetAttributes (which GPU holds the buffer: how the path binds) works whatever is current
    skip = ("cudaSetDevice", "cudaPointerGetAttributes")
    ran = {dev for call, dev, thread in rt.calls if call not in skip and thread != "fake-gpu"}
    if comm._device.device != 1 or ran != {1}:
        errors.append(f"bound to cuda:{comm._device.device}, CUDA calls with devices {ran} current: "
                      f"{[c for c in rt.calls if c[1] != 1 and c[0] not in skip and c[2] != 'fake-gpu']}")
    h = np.ones(4, np.float32)
    rt.set_device(0)
    rt.calls.clear()
    with comm.group():                                  # a group of a host and a device call, from a thread
        comm.all_reduce(h)                              # with cuda:0 current: the device part runs on cuda:1
        comm.all_reduce(y)
    ran = {dev for call, dev, thread in rt.calls if call not in skip and thread != "fake-gpu"}
    if ran != {1}:
        errors.append(f"the group's CUDA calls ran with devices {ran} current")
    rt.synchronize(0)
    if not (y.copy_to_host() == 1).all() or not (h == 1).all():
        errors.append(f"wrong result after the group: {y.copy_to_host()[:4]} {h}")
    return errors


def queue_a_call(comm) -> str | None:
    """One device call whose host side completes (the host never waits for the GPU): its error, if any."""
    from numba import cuda
    try:
        comm.all_reduce(cuda.to_device(np.ones(300, np.float32)))
        return None
    except RingcommError as e:
        return f"{type(e).__name__}: {e}"


def give_up_and_stay(comm, stay: float) -> None:
    """This rank fails as a live process can: it aborts and closes its communicator (its stream stuck,
    the flags it would write never written), then lives on without a word to its peers."""
    comm.abort()
    try:
        comm.close()
    except RingcommError:
        pass
    threading.Event().wait(stay)


def callers_stream_released(comm, within: float) -> dict:
    """How long until the caller's stream (the legacy default stream) is idle, polled up to ``within``;
    then the next call's error."""
    rt = fake_cuda.current()
    t0 = time.monotonic()
    while not rt.stream_idle(0) and time.monotonic() - t0 < within:
        threading.Event().wait(0.05)          # a poll with a deadline
    out = {"idle": rt.stream_idle(0), "after": time.monotonic() - t0}
    out["next"] = queue_a_call(comm)
    return out
