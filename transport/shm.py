"""Shared-memory transport for peers on the same host.

The sender of each link creates one POSIX shared-memory segment (a file in
/dev/shm, mode 0600) and publishes its name through the store; the receiver maps
it. The sender creates because it must never wait for its peer to connect (see
Transport.connect_send). The segment is a header plus ``nslots`` slots:

    offset   0  magic
    offset  64  posted    (written only by the sender: slices handed over)
    offset 128  released  (written only by the receiver: slices given back)
    offset 192  sender pid, offset 256 receiver pid   (liveness checks)
    offset 320  closed flags (sender, receiver)        (a clean close, not a crash)
    offset 384  receiver sleeps on posted, offset 448 sender sleeps on released (futex.py)
    offset 512  the byte count of each slot
    offset HDR  slot 0, slot 1, ...

Each counter has a cache line of its own, so the two sides never write the same
line. Slot i holds slice number k when k % nslots == i; the sender may fill it
once posted - released < nslots. Once the sender has mapped the segment the
sender unlinks its name, so a crash afterwards leaks nothing.
"""
from __future__ import annotations

import errno
import mmap
import os
import platform
import time

import numpy as np

from . import futex
from .base import (PATROL_PERIOD, Aborted, Backoff, CpuWatch, LinkContext, PeerGone, PeerTimeout,
                   RecvConnection, SendConnection, Transport, pid_alive, wait_key)

MAGIC = 0x52434D5348310001  # "RCMSH1", layout version 1
HDR = 4096
POSTED, RELEASED, SENDER_PID, RECEIVER_PID, CLOSED = 8, 16, 24, 32, 40  # int64 indices
RECV_SLEEPS, SEND_SLEEPS = 48, 56  # set by a side while it sleeps on POSTED / RELEASED
SIZES = 64

# Ordering: a slot's bytes must be visible to the peer before the counter that
# publishes it moves. x86-64 (TSO) keeps stores in program order, so "copy the
# data, then store the counter" is enough there. Weaker machines need a fence
# that numpy cannot express, so refuse them rather than corrupt data silently.
if platform.machine() not in ("x86_64", "AMD64", "i686", "i386"):  # pragma: no cover
    raise ImportError(f"ringcomm's shm transport relies on x86 store ordering (TSO); "
                      f"{platform.machine()} needs memory fences it does not have yet: "
                      f"use RINGCOMM_TRANSPORT=tcp")


# Segments this process created whose names are still in /dev/shm: unlinked on
# close, when the peer maps them, at exit, and on SIGTERM (see ringcomm.init).
_NAMED: set[str] = set()
# A forked child did not create them: at its exit it must not unlink the names a peer of the
# parent may still have to open.
os.register_at_fork(after_in_child=_NAMED.clear)


def unlink_named() -> None:
    """Remove every name this process still holds in /dev/shm (safe in a signal handler)."""
    for path in list(_NAMED):
        try:
            os.unlink(path)
        except OSError:
            pass
        _NAMED.discard(path)


def track(path: str) -> None:
    """Count a segment this process created (outside this module: ringcomm/registered.py) among
    the names unlink_named removes."""
    _NAMED.add(path)


def untrack(path: str) -> None:
    """Forget a name track() recorded whose file was never made."""
    _NAMED.discard(path)


def unlink_tracked(path: str) -> None:
    """Unlink a tracked name now (peers that mapped the segment keep it)."""
    if path in _NAMED:
        _NAMED.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_stale(job: str) -> list[str]:
    """Remove segments of ``job`` whose creator (the pid in the name) is dead: what a
    SIGKILLed rank of an earlier run left behind."""
    removed = []
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != "rc" or parts[1] != job or not parts[2].isdigit():
            continue
        if not _pid_alive(int(parts[2])):
            try:
                os.unlink("/dev/shm/" + name)
                removed.append(name)
            except OSError:
                pass
    return removed


_pid_alive = pid_alive  # the name cuda_ipc.py and the tests import


# Both ends map every page of a segment when they attach (MAP_POPULATE): otherwise each process
# takes a page fault per 4 KiB page the first time a slot carries that much, ~16 faults per
# 64 KiB slice on each side, and a benchmark's first rows time them (2-rank broadcast, 64 KiB:
# 19-24 us for the first row against 8 us after).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _reserve(fd: int, size: int, name: str) -> None:
    """Give the segment its pages now (posix_fallocate), as NCCL does for its shm segments: a full
    /dev/shm (a container's 64 MiB default) is then an error at connection time that says what to
    do, not a SIGBUS in the middle of a collective when a slot is first written."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a file system without fallocate: pages come at first touch, as before
        if e.errno == errno.ENOSPC:
            raise OSError(e.errno, f"/dev/shm has no room for the {size / 2**20:.1f} MiB FIFO segment {name}: "
                                   f"enlarge it (docker run --shm-size=1g) or lower RINGCOMM_BUFFSIZE") from None
        raise


class _Segment:
    """A mapped segment: the int64 header words and the slots as uint8 arrays. ``reserve``: give the
    slots their pages now and map them all (see _reserve, _POPULATE); cuda_ipc, whose host slots
    stay untouched unless it falls back to staging, leaves them to come at first touch."""

    def __init__(self, name: str, nslots: int, slot_bytes: int, create: bool, reserve: bool = True):
        self.name = name
        self.path = "/dev/shm/" + name
        size = HDR + nslots * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if create:  # named before it exists: a SIGTERM right after the open still finds it
            _NAMED.add(self.path)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError:
            _NAMED.discard(self.path)
            raise
        try:
            if create:
                os.ftruncate(fd, size)
                if reserve:
                    _reserve(fd, size, name)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if reserve else 0))
        except BaseException:
            if create:  # no half-made segment stays behind in /dev/shm
                self.unlink()
            raise
        finally:
            os.close(fd)
        buf = np.frombuffer(self.map, dtype=np.uint8)
        self.base = buf.ctypes.data  # for compiled code, which reads the words and slots by address
        self.words = buf[:HDR].view(np.int64)
        self.slots = [buf[HDR + i * slot_bytes: HDR + (i + 1) * slot_bytes] for i in range(nslots)]
        if create:
            self.words[0] = MAGIC
        elif self.words[0] != MAGIC:
            raise PeerGone(f"shared-memory segment {name} has a foreign layout", peer=-1, transport="shm")

    def unlink(self) -> None:
        if self.path not in _NAMED:
            return
        _NAMED.discard(self.path)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.words = self.slots = None
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view; the mapping dies with the process
            pass


class _Link:
    """What both ends share: waiting with back-off, liveness, abort."""

    transport = "shm"

    def __init__(self, ctx: LinkContext, peer: int, seg: _Segment, peer_pid_word: int, peer_closed_word: int):
        self.ctx, self.peer, self.seg = ctx, peer, seg
        self.nslots, self.slot_bytes = ctx.nslots, ctx.slot_bytes
        self._peer_pid_word, self._peer_closed_word = peer_pid_word, peer_closed_word
        self._cpu = CpuWatch()

    def _wait(self, ready, deadline: float, what: str, counter: int, flag: int) -> None:
        """Wait until ready() holds; spin, yield, then sleep (see Backoff) on the futex of header
        word ``counter`` (the peer's counter that ready() reads), with header word ``flag`` set
        meanwhile so that the peer's post wakes this side (futex.py)."""
        words, addr = self.seg.words, self.seg.base + 8 * counter

        def block(seconds: float) -> None:
            words[flag] = 1
            try:
                # A post before this read shows in ready(); one after it makes the kernel's own
                # compare fail, so the futex returns at once: only the poster's side can miss.
                seen = int(words[counter])
                if not ready():
                    futex.wait(addr, seen, seconds)
            finally:
                words[flag] = 0

        backoff = Backoff(self.ctx.spins, block)
        abort, watchdog = self.ctx.abort, self.ctx.watchdog
        next_patrol = time.monotonic() + PATROL_PERIOD
        while not ready():
            backoff()
            if backoff.n & 63:
                continue
            if abort is not None and abort.is_set():
                raise Aborted(f"aborted while waiting for {what} rank {self.peer}", peer=self.peer,
                              transport=self.transport)
            now = time.monotonic()
            if now >= next_patrol:
                self._check_peer(what)
                if watchdog is not None:
                    watchdog()
                next_patrol = now + PATROL_PERIOD
            if now > deadline:
                raise PeerTimeout(f"waiting for {what} rank {self.peer} over {self.transport}",
                                  peer=self.peer, transport=self.transport)

    def _words(self) -> np.ndarray:
        words = self.seg.words
        if words is None:
            raise Aborted(f"the {self.transport} link to rank {self.peer} was closed by this process",
                          peer=self.peer, transport=self.transport)
        return words

    def addresses(self) -> tuple[int, int]:
        """(header words, slot 0) as addresses: slot i starts at slot 0 + i * slot_bytes. For a
        compiled loop that follows this protocol itself (ringcomm's native engine); it must keep
        the ``count`` of this end (posted or released) and write it back before calling wait or
        acquire again. Writing ``count`` also ends the hold of a slot that wait() or acquire()
        returned to the loop: the loop released or posted it itself."""
        self._words()  # a closed link has no addresses: compiled code must not write there
        return self.seg.base, self.seg.base + HDR

    def peer_pid(self) -> int:
        """The peer's pid as it wrote it into the segment (0 until it has attached)."""
        return int(self._words()[self._peer_pid_word])

    def peer_waits_for_my_cpu(self) -> bool:
        """Whether the peer is runnable on the CPU this thread runs on (base.waits_for_my_cpu):
        asked by a compiled loop after each round of polling, so the peer's stat file stays open."""
        return self._cpu.waits_for_my_cpu(self.peer_pid())

    def _check_peer(self, what: str) -> None:
        words = self._words()
        if words[self._peer_closed_word]:
            raise PeerGone(f"rank {self.peer} closed its end of the link while this rank waited for {what} it",
                           peer=self.peer, transport=self.transport)
        pid = int(words[self._peer_pid_word])
        if not _pid_alive(pid):
            raise PeerGone(f"rank {self.peer} (pid {pid}) died while this rank waited for {what} it",
                           peer=self.peer, transport=self.transport)


class ShmSend(_Link, SendConnection):
    def __init__(self, ctx, peer, seg):
        super().__init__(ctx, peer, seg, RECEIVER_PID, CLOSED + 1)
        seg.words[SENDER_PID] = os.getpid()
        self.posted = 0  # our own copy: only we write POSTED
        self.unlinked = False
        self.held = False  # a slot acquired and not yet posted

    @property
    def count(self) -> int:
        return self.posted

    @count.setter
    def count(self, value: int) -> None:
        self.posted = value
        self.held = False  # a compiled loop posted the slot that acquire() gave it

    def settle(self) -> bool:
        """Unlink the segment's name once the receiver has mapped it; whether that is done (after
        close() it is: close unlinks it)."""
        words = self.seg.words
        if words is None:
            return True
        if not self.unlinked and words[RECEIVER_PID]:
            self.seg.unlink()  # both ends are mapped: the name is no longer needed
            self.unlinked = True
        return self.unlinked

    def acquire(self, deadline: float) -> np.ndarray:
        words = self._words()
        if self.held:
            raise RuntimeError("acquire() called again before post()")
        if not self.unlinked:
            self.settle()
        limit = self.posted - self.nslots
        if words[RELEASED] <= limit:
            self._wait(lambda: words[RELEASED] > limit, deadline, "a free slot from", RELEASED, SEND_SLEEPS)
        self.held = True
        return self.seg.slots[self.posted % self.nslots]

    def ready(self) -> bool:
        words = self.seg.words  # closed by this process: acquire() raises at once
        return words is None or words[RELEASED] > self.posted - self.nslots

    def check(self) -> None:
        self._check_peer("a free slot from")

    def post(self, nbytes: int) -> None:
        words = self._words()
        if not self.held:
            raise RuntimeError("post() without a slot from acquire()")
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"post({nbytes}): a slot holds 0..{self.slot_bytes} bytes")
        self.held = False
        words[SIZES + self.posted % self.nslots] = nbytes
        self.posted += 1
        words[POSTED] = self.posted  # after the data and the size: see the TSO note above
        self.wake_peer()

    def wake_peer(self) -> None:
        """Wake the receiver if it sleeps for a slice (after post(); a compiled loop that posted calls it)."""
        words = self.seg.words
        if words is not None and words[RECV_SLEEPS]:   # None: closed here meanwhile (abort)
            futex.wake(self.seg.base + 8 * POSTED)

    def close(self) -> None:
        if self.seg.words is not None:
            self.seg.words[CLOSED] = 1
            self.seg.unlink()
            self.seg.close()
        self._cpu.close()


class ShmRecv(_Link, RecvConnection):
    def __init__(self, ctx, peer, seg):
        super().__init__(ctx, peer, seg, SENDER_PID, CLOSED)
        seg.words[RECEIVER_PID] = os.getpid()
        self.released = 0
        self.held = False  # a slot returned by wait() and not yet released

    @property
    def count(self) -> int:
        return self.released

    @count.setter
    def count(self, value: int) -> None:
        self.released = value
        self.held = False  # a compiled loop released the slot that wait() gave it

    def wait(self, deadline: float) -> np.ndarray:
        words = self._words()
        if self.held:
            raise RuntimeError("wait() called again before release()")
        want = self.released
        if words[POSTED] <= want:
            self._wait(lambda: words[POSTED] > want, deadline, "the next slice from", POSTED, RECV_SLEEPS)
        i = want % self.nslots
        self.held = True
        return self.seg.slots[i][: int(words[SIZES + i])]

    def ready(self) -> bool:
        words = self.seg.words  # closed by this process: wait() raises at once
        return words is None or words[POSTED] > self.released

    def check(self) -> None:
        self._check_peer("the next slice from")

    def release(self) -> None:
        words = self._words()
        if not self.held:
            raise RuntimeError("release() without a slot from wait()")
        self.held = False
        self.released += 1
        words[RELEASED] = self.released
        self.wake_peer()

    def wake_peer(self) -> None:
        """Wake the sender if it sleeps for a free slot (after release(); a compiled loop that released calls it)."""
        words = self.seg.words
        if words is not None and words[SEND_SLEEPS]:   # None: closed here meanwhile (abort)
            futex.wake(self.seg.base + 8 * RELEASED)

    def close(self) -> None:
        if self.seg.words is not None:
            self.seg.words[CLOSED + 1] = 1
            self.seg.close()
        self._cpu.close()


class ShmTransport(Transport):
    name = "shm"
    _serial = 0

    def __init__(self, ctx: LinkContext):
        super().__init__(ctx)
        self.job = os.environ.get("RINGCOMM_JOB_ID", "x")
        self.links: list[_Link] = []
        self.closed = False
        remove_stale(self.job)

    def _check_open(self, peer: int) -> None:
        if self.closed:
            raise Aborted(f"the {self.name} transport was closed by this process", peer=peer, transport=self.name)

    def _key(self, src: int, dst: int) -> str:
        return f"{self.ctx.prefix}/shm/{src}->{dst}"

    def connect_send(self, peer: int, deadline: float) -> SendConnection:
        self._check_open(peer)
        ShmTransport._serial += 1
        name = f"rc-{self.job}-{os.getpid()}-{ShmTransport._serial}"
        seg = _Segment(name, self.ctx.nslots, self.ctx.slot_bytes, create=True)
        conn = ShmSend(self.ctx, peer, seg)
        self.links.append(conn)
        self.ctx.store.set(self._key(self.ctx.rank, peer), name.encode())
        return conn

    def connect_recv(self, peer: int, deadline: float) -> RecvConnection:
        self._check_open(peer)
        name = wait_key(self.ctx, self._key(peer, self.ctx.rank), deadline, peer, "shm").decode()
        try:
            seg = _Segment(name, self.ctx.nslots, self.ctx.slot_bytes, create=False)
        except FileNotFoundError:
            raise PeerGone(f"rank {peer}'s segment {name} vanished before this rank mapped it",
                           peer=peer, transport="shm") from None
        conn = ShmRecv(self.ctx, peer, seg)
        self.links.append(conn)
        return conn

    def close(self) -> None:
        self.closed = True
        for link in self.links:
            link.close()
        self.links.clear()
