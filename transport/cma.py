"""Cross-memory attach (CMA): copy straight between this process and a peer's private memory.

Linux's process_vm_readv / process_vm_writev move bytes between two processes' address spaces in
one copy, no shared segment, no staging slot: the host path MPICH (via UCX) takes for large
messages. The kernel allows it where ptrace would be allowed: same user, and Yama's
ptrace_scope (/proc/sys/kernel/yama/ptrace_scope) at 0, or a container that does not forbid it
(seccomp, missing CAP_SYS_PTRACE across user namespaces). So it is probed per peer before use
(probe()), and every caller keeps the two-copy path for the peers that refuse it.

Calls go through ctypes, which releases the GIL for their duration. A transfer may be partial
(the kernel stops at a page it cannot reach, or after a signal): read() and write() continue from
where it stopped and raise CmaError with the errno once no byte moves.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading

MAX_PIECE = 1 << 30   # bytes per call: a failure then says where, and a call stays well under 2 GiB


class CmaError(OSError):
    """A CMA transfer failed. ``errno``: EPERM (not allowed: Yama, container), ESRCH (the peer is
    gone), EFAULT (an address outside the peer's or this process's mappings), ENOSYS (no CMA)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):  # not Linux, or a libc without the wrappers
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                       ctypes.c_ulong, ctypes.c_ulong]
    return fns


_FNS = _load()
_iovecs = threading.local()   # per thread: .made = (local iovec, remote iovec, and a pointer to each)
_WHY = {errno.EPERM: "not permitted (Yama ptrace_scope, or a container forbids it)",
        errno.ESRCH: "no such process (the peer is gone)",
        errno.EFAULT: "bad address (outside the peer's mappings)",
        errno.ENOSYS: "process_vm_readv is not available on this kernel"}


def available() -> bool:
    """Whether this system has the calls at all (a probe still decides per peer)."""
    return _FNS is not None


def yama_scope() -> int | None:
    """Yama's ptrace_scope (0: same-user access allowed), or None where Yama is absent."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def read(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` in process ``pid`` to address ``local`` here."""
    _transfer(0, pid, local, remote, nbytes)


def write(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``local`` here to address ``remote`` in process ``pid``."""
    _transfer(1, pid, local, remote, nbytes)


def _transfer(which: int, pid: int, local: int, remote: int, nbytes: int) -> None:
    if _FNS is None:
        raise CmaError(errno.ENOSYS, _WHY[errno.ENOSYS])
    fn, done = _FNS[which], 0
    try:
        lv, rv, plv, prv = _iovecs.made
    except AttributeError:   # this thread's first transfer: two iovecs, kept (~1 us a call less)
        lv, rv = _Iovec(), _Iovec()
        plv, prv = ctypes.byref(lv), ctypes.byref(rv)
        _iovecs.made = lv, rv, plv, prv
    while done < nbytes:
        n = min(nbytes - done, MAX_PIECE)
        lv.iov_base, lv.iov_len = local + done, n
        rv.iov_base, rv.iov_len = remote + done, n
        got = fn(pid, plv, 1, prv, 1, 0)
        if got > 0:
            done += got      # partial: go on from there; the next call reports what stopped it
            continue
        err = ctypes.get_errno() if got < 0 else errno.EFAULT
        if err == errno.EINTR:
            continue
        verb = "read from" if which == 0 else "write to"
        raise CmaError(err, f"process_vm_{'readv' if which == 0 else 'writev'}: cannot {verb} pid {pid} "
                            f"at {remote + done:#x} ({done} of {nbytes} bytes done): {_WHY.get(err, os.strerror(err))}")


def probe(pid: int, remote: int, expect: bytes) -> str | None:
    """Try to read ``len(expect)`` bytes at ``remote`` in ``pid``; None if they arrive and match,
    else why not (a sentence for RINGCOMM_DEBUG=info and for the fallback decision)."""
    buf = ctypes.create_string_buffer(len(expect))
    try:
        read(pid, remote, ctypes.addressof(buf), len(expect))
    except CmaError as e:
        scope = yama_scope()
        return f"{e.strerror}" + (f" [yama ptrace_scope={scope}]" if scope else "")
    if buf.raw != expect:
        return f"read pid {pid} at {remote:#x} but found other bytes there (not the peer's probe word)"
    return None
