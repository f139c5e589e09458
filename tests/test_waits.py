"""The wait policy: spin, yield, then a futex sleep that the peer's post ends (transport/futex.py)."""
import os
import threading
import time

import numpy as np
import pytest

from ringcomm.transport import futex
from ringcomm.transport.base import Backoff


def test_backoff_stages_spin_then_yield_then_sleep():
    b = Backoff(spins=3)
    assert [b.stage(n) for n in (1, 3, 4, 3 + Backoff.YIELDS, 4 + Backoff.YIELDS)] == \
        ["spin", "spin", "yield", "yield", "sleep"]
    # oversubscribed (spins=0): never a busy poll, and only a short run of yields before sleeping
    shared = Backoff(spins=0)
    assert [shared.stage(n) for n in (1, Backoff.YIELDS_SHARED, Backoff.YIELDS_SHARED + 1)] == \
        ["yield", "yield", "sleep"]


def test_backoff_sleeps_through_block_with_growing_pauses():
    pauses = []
    b = Backoff(spins=0, block=pauses.append)
    for _ in range(Backoff.YIELDS_SHARED + 8):
        b()
    assert pauses[0] == 2e-5 and pauses == sorted(pauses) and pauses[-1] == Backoff.MAX_SLEEP


@pytest.mark.skipif(not futex.available(), reason="futex(2) is Linux-only; elsewhere wait() is a plain sleep")
def test_futex_sleeper_is_woken_by_the_post_not_by_its_timeout():
    word = np.zeros(1, np.int64)
    addr, returned, tid = word.ctypes.data, [], []
    started = threading.Event()

    def sleeper():
        tid.append(threading.get_native_id())
        started.set()
        t0 = time.monotonic()
        while word[0] == 0:          # a wake is a hint: re-check, as the transport does
            futex.wait(addr, 0, 30.0)
        returned.append(time.monotonic() - t0)

    t = threading.Thread(target=sleeper)
    t.start()
    started.wait(10)
    _until_asleep(tid[0])  # the store below must find it inside futex(2), not before it
    word[0] = 1
    futex.wake(addr)
    t.join(20)
    assert returned and returned[0] < 10, "the sleeper slept to its 30 s timeout: wake() did not reach it"


def test_futex_wait_returns_at_once_when_the_word_already_moved():
    word = np.full(1, 5, np.int64)
    t0 = time.monotonic()
    futex.wait(word.ctypes.data, 4, 30.0)   # saw 4, the word holds 5: no sleep
    assert time.monotonic() - t0 < 5


def _until_asleep(tid: int, limit: float = 20.0, proc: str = "") -> None:
    """Poll /proc until thread ``tid`` (or the process whose stat file is ``proc``) is in an
    interruptible sleep (state S)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with open(proc or f"/proc/self/task/{tid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "S":
                return
    raise AssertionError(f"thread {tid} never went to sleep in futex(2)")


@pytest.mark.parametrize("kept_open", [False, True], ids=["opened-each-time", "CpuWatch"])
def test_a_runnable_peer_on_this_cpu_is_seen_waiting_for_it(kept_open):
    import subprocess
    import sys

    from ringcomm.transport.base import CpuWatch, waits_for_my_cpu
    watch = CpuWatch()
    check = watch.waits_for_my_cpu if kept_open else waits_for_my_cpu
    cpu = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile 1: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})       # this thread and the busy peer now share one CPU
        end, seen = time.monotonic() + 20, False
        while not seen and time.monotonic() < end:  # until the peer has pinned itself and spins
            seen = check(busy.pid)
        assert seen, "a busy peer pinned to this CPU was never seen waiting for it"
        _until_asleep(idle.pid, proc=f"/proc/{idle.pid}/stat")
        assert not check(idle.pid)  # asleep in read(): giving it the core helps nothing
    finally:
        os.sched_setaffinity(0, mask)
        for p in (busy, idle):
            p.kill()
            p.wait(10)
    assert not check(idle.pid)  # reaped: the kept file answers ESRCH, which means "no"
    if kept_open:
        fd = watch.fd
        watch.close()
        with pytest.raises(OSError):
            os.fstat(fd)  # close() gave the fd back
