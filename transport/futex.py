"""Sleeping on a shared-memory word until its owner moves it: Linux futex(2) through ctypes.

The shm transport's waits spin, then yield, then sleep (base.Backoff). A plain sleep wakes
when its time is up, however early the peer posted: with more ranks than cores a rank that
slept 1 ms keeps its peers waiting up to 1 ms per hand-off. A futex sleep on the counter word
ends as soon as the peer's post calls wake(), or at the same time limit as before.

Protocol (both sides of one counter; the flag word is written only by the sleeper):

    sleeper:  flag = 1; wait(counter, the value it saw, timeout); flag = 0
    poster:   counter += 1; if flag: wake(counter)

futex(2) compares the word with the value seen inside the kernel, after a full barrier, so a
post that lands before the sleeper sleeps makes wait() return at once. The poster's load of the
flag may pass its store of the counter (x86 lets a load pass an earlier store), so a wake can be
missed; the sleep then ends at its timeout, which is no worse than the plain sleep it replaces.
The compiled engine fences there (native_sync.fence), Python does not.

Everywhere futex is missing (not Linux, seccomp), wait() falls back to time.sleep.
"""
from __future__ import annotations

import ctypes
import os
import platform
import time

SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "i686": 240, "i386": 240, "aarch64": 98}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1   # shared (not FUTEX_PRIVATE_FLAG): the word lives in a segment two processes map


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load():
    if SYS_FUTEX is None or not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    return fn


_syscall = _load()


def available() -> bool:
    return _syscall is not None


def wait(addr: int, seen: int, timeout: float) -> None:
    """Sleep until the 32-bit word at ``addr`` (the low half of a little-endian int64 counter) no
    longer holds ``seen``'s low 32 bits, a wake() on it, a signal, or ``timeout`` seconds. The
    caller re-checks its condition: every return is only a hint (ctypes releases the GIL here)."""
    global _syscall
    if _syscall is None:
        time.sleep(timeout)
        return
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    low = ctypes.c_int32(seen & 0xFFFFFFFF).value
    if _syscall(SYS_FUTEX, addr, FUTEX_WAIT, low, ctypes.addressof(ts), None, 0) < 0:
        err = ctypes.get_errno()
        if err == 38:   # ENOSYS (a sandbox without futex): plain sleeps from now on
            _syscall = None
            time.sleep(timeout)
        # EAGAIN (the word moved already), ETIMEDOUT, EINTR: return, the caller re-checks


def wake(addr: int) -> None:
    """Wake every sleeper on the word at ``addr`` (one per counter in practice)."""
    if _syscall is not None:
        _syscall(SYS_FUTEX, addr, FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
