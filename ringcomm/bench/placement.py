"""Where the machine put the benchmark's cores: the round trip of one cache line between two CPUs.

On a virtual machine the hypervisor moves the vCPUs under the guest. On this project's 2-vCPU
VM a cache line went from CPU 0 to CPU 1 and back in ~85-115 ns for seconds at a time, then in
~320-360 ns, then back (the two vCPUs on neighbouring hardware, then far apart). Libraries feel it
differently: MPICH's 2-rank 4 MiB all_gather took ~150 us in the near placement and ~1000 us in
the far one (20 launches, every slow one next to a far reading), while ringcomm's streamed copies
were as fast or faster far apart (1 MiB broadcast 52-54 us against 60-66). So ringcomm-bench
measures the round trip before and after each library's sweep and prints it beside the figures:
a ratio between two sweeps that ran in different placements compares the placements too.

The measurement: two threads, each pinned to one CPU, pass a counter back and forth through one
int64 with acquire loads and release stores (ringcomm.native_sync), compiled with numba so that
nothing but the line's travel is timed. Each wait is bounded, so a CPU that never runs the other
thread gives None instead of a hang.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

ROUNDS = 20000          # round trips per measurement: ~2-7 ms
SPIN_LIMIT = 1 << 27    # polls per hand-off before giving up (seconds, not a hang)
_ping = None


def _kernel():
    global _ping
    if _ping is None:
        import numba

        from ringcomm import native_sync
        load_acquire, store_release = native_sync.intrinsics()[:2]

        @numba.njit(nogil=True)   # not cached on disk: it inlines native_sync, whose edits the cache would miss
        def ping(addr, rounds, me, limit):
            """Thread ``me`` (0 or 1) waits for its turn's value, then hands the line on; False if
            the other thread did not answer within ``limit`` polls."""
            for i in range(rounds):
                want = 2 * i + me
                polls = 0
                while load_acquire(addr) != want:
                    polls += 1
                    if polls > limit:
                        return False
                store_release(addr, want + 1)
            return True
        _ping = ping
    return _ping


def cpu_pair() -> tuple[int, int] | None:
    """The first two CPUs this process may use, or None where there are fewer."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def round_trip_ns(rounds: int = ROUNDS, repeat: int = 3) -> float | None:
    """The best of ``repeat`` measurements of one cache line's round trip between the first two
    usable CPUs, in ns; None where there are not two CPUs, numba is missing, or a thread did not
    answer."""
    pair = cpu_pair()
    if pair is None:
        return None
    try:
        ping = _kernel()
    except ImportError:
        return None
    word = np.zeros(8, np.int64)      # one cache line of its own
    addr = word.ctypes.data
    ping(addr, 0, 0, 1)               # compiled before anything is timed
    best = None
    for _ in range(repeat):
        word[0] = 0
        gate, took, ok = threading.Barrier(2), [0.0], [True, True]

        def side(me):
            os.sched_setaffinity(0, {pair[me]})   # this thread only (Linux: pid 0 is the caller)
            gate.wait()
            t0 = time.perf_counter()
            ok[me] = ping(addr, rounds, me, SPIN_LIMIT)
            if me == 0:
                took[0] = time.perf_counter() - t0

        threads = [threading.Thread(target=side, args=(me,), daemon=True) for me in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(ok):
            return None
        ns = took[0] / rounds * 1e9
        best = ns if best is None else min(best, ns)
    return best
