"""Registered buffers: ``comm.alloc`` memory that the host's other ranks map.

The host twin of CUDA IPC and of NCCL's ncclMemAlloc plus window registration. ``alloc`` is a
*collective* call: every rank calls it, in the same order, with the same shape and dtype (NCCL's
symmetric windows ask the same), so the k-th allocation of every rank is known to all: each rank
creates a /dev/shm segment (mode 0600), publishes its name in the store and maps every peer's,
plus, at its first alloc, a small control segment that the one-copy protocol runs on
(read_engine.py). Collectives whose buffers all lie in such segments run the "read" algorithms
(schedule/onecopy.py): each rank reads its peers' buffers directly, one copy instead of two.
Every wait here has the communicator's deadline, hears abort(), checks the peer's pid (a zombie
counts as dead, transport.base.pid_alive) and feeds the watchdog.

Lifetime: an allocation stays shared until ``comm.close()``. After that the array stays valid
memory of this process (the mapping lives as long as the array does), but it is private: the
peers have unmapped it. Segment names leave /dev/shm before alloc returns: alloc waits until
every peer has mapped them (so a rank that closes at once cannot pull a name from under a slower
peer), then unlinks them; if alloc fails, close, exit and SIGTERM unlink them (shm.unlink_named).

The engine (read_engine.py): on the native engine the calls run compiled (read_native.py: a
memmove through this process's mapping of each peer's allocation, peer_maps.py; a reducing step
in fetch_reduce's loop, which reduces the peers' operands where they are mapped); on the reference
engine, and for reduce, they are Python's steps: numpy over whole chunks, cut into cache-sized
pieces.
"""
from __future__ import annotations

import json
import mmap
import os
import time

import numpy as np

from ringcomm.kernels import host as kernels
from ringcomm.transport import futex
from ringcomm.transport.base import (PATROL_PERIOD, Aborted, Backoff, PeerGone, PeerTimeout, pid_alive, wait_key,
                                     waits_for_my_cpu)

from . import peer_maps, plain_read
from .buffers import address
from .catalogue import ALGOS
from .errors import CollectiveTimeout, PeerFailure, RingcommError, StoreError
from .ctl_layout import CLOSED, MAPPED, PID, ctl_words, sleep_flag
from .read_engine import ReadEngine
from .schedule.onecopy import ALGO

MAGIC = 0x52434D5247310002  # "RCMRG1", layout version 2 (ctl_layout.py)
# Below this (a call's bytes, as plain_read.wanted counts them), automatic choice keeps the FIFO
# algorithms even on registered buffers. A read call runs compiled (read_native.py: memmoves
# through the peers' mappings, and fetch_reduce's loop reducing the peers' operands where they are
# mapped), yet pays two rendezvous that the FIFO loop's small calls do not. Intel VM, 2026-12-04,
# 2 ranks, registered buffers, 30-call rows (200 below 16 KiB) alternating with MPICH, three runs,
# read against ring out of place (us): broadcast 1 KiB 1.67 / 1.70, 4 KiB 1.88 / 2.20, 16 KiB
# 1.77 / 3.49, 256 KiB 4.22 / 15.39, 1 MiB 13.4 / 61.4, 4 MiB 147 / 313; all_gather 1 KiB 1.82 /
# 2.00, 4 KiB 1.88 / 2.66, 64 KiB 3.14 / 6.30, 1 MiB 27.5 / 89.2, 4 MiB 268 / 439; all_reduce
# 4 KiB 4.80 / 3.56, 16 KiB 5.02 / 6.26, 256 KiB 10.1 / 28.5, 1 MiB 45.1 / 158, 4 MiB 355 / 657;
# reduce_scatter 16 KiB 4.87 / 4.04, 64 KiB 5.48 / 6.15, 1 MiB 25.4 / 85.2. (Before, the read
# calls on registered buffers were Python's steps, ~20-40 us before the first byte: 1 MiB took
# 27, 42, 76 and 48 us, and every collective kept the FIFOs below 1 MiB.) reduce, whose root
# reduces every peer's whole buffer alone while the ring spreads the work, wins only in a window:
# out of place (in place) 64 KiB 6.00 (5.35) / 5.57 (5.22), 256 KiB 10.3 (8.9) / 16.0 (14.7),
# 1 MiB 110 (43) / 96 (60), 4 MiB 531 (311) / 466 (314).
READ_MIN_BY_COLLECTIVE = {"broadcast": 4 << 10, "all_gather": 4 << 10, "all_reduce": 16 << 10,
                          "reduce_scatter": 64 << 10, "reduce": 256 << 10}
# The one crossover before (every collective), now the default for a collective not listed: from
# it, with a core per rank, every collective with a read algorithm takes it on registered buffers.
READ_MIN_BYTES = 1 << 20
# With more ranks than cores, this much per rank a core holds (rounded up, as plain_read.wanted):
# 4 ranks on 2 cores, same day, read against ring (us): broadcast 16 KiB 15.5 / 10.7, 64 KiB 14.0
# / 27.8, 256 KiB 18.6 / 88.4; all_gather 4 KiB 14.2 / 17.7 (level), 16 KiB 13.6 / 17.6, 64 KiB
# 17.8 / 30.3; all_reduce 16 KiB 32.8 / 27.3, 64 KiB 42.0 / 48.5, 256 KiB 72.5 / 180, 1 MiB 305 /
# 604; reduce_scatter 64 KiB 31.2 / 29.8 (in place 51.0 / 25.5), 256 KiB 43.4 / 60.7, 1 MiB 192 /
# 277; reduce 256 KiB 64.4 / 61.1, 1 MiB 581 (402) / 313 (262), 4 MiB 1105 (930) / 1017 (1031).
READ_MIN_STACKED_BYTES = {"broadcast": 32 << 10, "all_gather": 8 << 10, "all_reduce": 32 << 10,
                          "reduce_scatter": 128 << 10, "reduce": 2 << 20}


def read_min_bytes(collective: str, ranks: int) -> int:
    """The bytes from which automatic choice takes "read" on registered buffers
    (READ_MIN_BY_COLLECTIVE, or READ_MIN_STACKED_BYTES a rank per core with more ranks than cores)."""
    per_core = -(-ranks // plain_read.CORES)
    if per_core > 1 and collective in READ_MIN_STACKED_BYTES:
        return READ_MIN_STACKED_BYTES[collective] * per_core
    return READ_MIN_BY_COLLECTIVE.get(collective, READ_MIN_BYTES)


_serial = 0                  # segments this process has created


def settle(reg, collective: str, algo: str, auto: bool, x, y, nbytes: int) -> str:
    """The algorithm to run. Chosen automatically: "read" when buf and out are registered, the
    collective has a read algorithm (all_to_all, gather and scatter have none) and the call moves
    at least read_min_bytes(), or for plain buffers that every peer can read by CMA where that beats
    the FIFOs (plain_read.wanted); else never (a forced RINGCOMM_ALGO=read falls back to the ring
    there). Asked for by name: "read" on buffers that are not registered is a ValueError."""
    held = reg is not None and reg.holds(x, y)
    if auto:
        # cma_ok() is collective the first time: called on every rank for the same calls
        cma = reg is not None and plain_read.wanted(collective, nbytes, reg.n) and reg.cma_ok()
        if (held and ALGO in ALGOS[collective] and nbytes >= read_min_bytes(collective, reg.n)) or cma:
            return ALGO
        return "ring" if algo == ALGO else algo
    if algo == ALGO and not held and not (reg is not None and reg.n == 1):  # one rank: a local copy
        refuse(collective, algo)
    return algo


def why_read(reg, x, y, ran: str) -> str:
    """Why automatic choice took (or, asked for by RINGCOMM_ALGO, left) the one-copy read steps, for
    RINGCOMM_DEBUG=info."""
    if ran != ALGO:
        return f"the peers cannot read these buffers ({ALGO!r} needs comm.alloc buffers, or plain ones read by CMA)"
    if reg is not None and reg.holds(x, y):
        return "buf and out come from comm.alloc (the peers read them in place)"
    return ("plain buffers every peer reads by CMA, at this size (plain_read.wanted: RINGCOMM_CMA_MIN, "
            "or a core per rank and the measured crossover)")


def refuse(collective: str, algo: str) -> None:
    """The ValueError for an algorithm with read steps on buffers that are not registered."""
    raise ValueError(f"{collective} algo={algo!r} reads the peers' buffers directly: buf and out "
                     f"must come from comm.alloc(), on a communicator whose ranks all share this host")


def _shape(shape) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(f"alloc: shape must be an int or a tuple of ints, got {shape!r}") from None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"alloc: shape must be an int or a tuple of ints, got {shape!r}")
    if any(d < 0 for d in dims):
        raise ValueError(f"alloc: shape {shape!r} has a negative dimension")
    return tuple(int(d) for d in dims)


class _Map:
    """One shared segment, mapped: its bytes as uint8 and its address range."""

    def __init__(self, path: str, size: int, create: bool):
        from ringcomm.transport import shm  # x86-only, like the rest of shared memory
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if create:  # tracked before it exists, as in shm.py: a SIGTERM right after the open finds it
            shm.track(path)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError:
            if create:
                shm.untrack(path)
            raise
        try:
            if create:
                os.ftruncate(fd, size)
            # MAP_POPULATE: the page faults are paid here, not in the first collective.
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.bytes = np.frombuffer(self.map, np.uint8)
        self.words = self.bytes[:size - size % 8].view(np.int64)   # a control segment's words
        self.base = address(self.bytes)

    def close(self) -> None:
        self.bytes = self.words = None
        try:
            self.map.close()
        except BufferError:  # the user still holds the array: it stays valid, privately
            pass


class Registry:
    """A communicator's registered allocations, its peers' mappings of theirs, and the engine."""

    def __init__(self, rank: int, world_size: int, links, timeout: float):
        self.rank, self.n, self.links, self.timeout = rank, world_size, links, timeout
        self.ctx = links.ctx
        self.shared = world_size > 1 and all(links.transport_for(p) == "shm" for p in self._others())
        self.mine: list[_Map] = []      # allocation k -> this rank's segment
        self.peers: dict = {}           # (peer, k) -> _Map; (peer, "ctl") -> its control segment
        self.ctl = None                 # this rank's control segment
        self._ctls = None               # the peers' control words, once all are mapped (publish)
        self.named: list = []           # paths of this rank's segments still in /dev/shm
        self.engine = ReadEngine(self)
        self.closed = False
        self.cma = None                 # whether every pair can read plain buffers by CMA; None: not probed
        self.doing = None               # the call that may probe CMA: (collective, its number), for messages

    def _others(self):
        return [p for p in range(self.n) if p != self.rank]

    # ---- alloc ----------------------------------------------------------------------------------

    def alloc(self, shape, dtype) -> np.ndarray:
        shape, dtype = _shape(shape), kernels.as_dtype(dtype)
        if not kernels.supported(dtype):
            raise TypeError(f"alloc: dtype {dtype} is not one ringcomm reduces; supported: "
                            f"{', '.join(kernels.DTYPE_NAMES)}")
        count = int(np.prod(shape, dtype=np.int64))
        if not self.shared:  # one rank, or peers on other hosts: nothing to map, ordinary memory
            return np.zeros(shape, dtype)
        k = len(self.mine)
        self._ensure_ctl()
        seg = self._create(max(count * dtype.itemsize, 1))
        self.mine.append(seg)
        self.named.append(seg.path)
        me = {"seg": os.path.basename(seg.path), "ctl": os.path.basename(self.ctl.path),
              "nbytes": count * dtype.itemsize}
        self.ctx.store.set(self._key(k, self.rank), json.dumps(me).encode())
        deadline = time.monotonic() + self.timeout
        for p in self._others():
            theirs = json.loads(self._published(k, p, deadline))
            if theirs["nbytes"] != me["nbytes"]:
                raise ValueError(f"rank {self.rank} (this process): alloc #{k} has {me['nbytes']} bytes here but "
                                 f"{theirs['nbytes']} on rank {p}: every rank calls alloc with the same shape "
                                 f"and dtype, in the same order")
            self.map_ctl(p, theirs["ctl"])
            self.peers[p, k] = self._map(theirs["seg"], max(me["nbytes"], 1), p)
        peer_maps.enter(self.engine.maps, k, {p: (self.peers[p, k].base, self.peers[p, k].size)
                                              for p in self._others()})
        self._mapped_everywhere(k)
        return seg.bytes[:count * dtype.itemsize].view(dtype).reshape(shape)

    def _mapped_everywhere(self, k: int) -> None:
        """Announce that this rank has mapped its peers' allocation k, wait until every peer has
        mapped ours, then unlink our names: nothing is left to leak, and no rank can close (and
        unlink) before a slower peer has mapped its segment."""
        from ringcomm.transport import shm
        self.ctl.words[MAPPED] = k + 1

        def explain(e):
            what = f"rank {self.rank} (this process) {{}} waiting for rank {e.peer} to map alloc #{k} over shm"
            if isinstance(e, PeerTimeout):
                return CollectiveTimeout(what.format(f"timed out after {self.timeout:g} s"))
            return RingcommError(what.format("was aborted" if isinstance(e, Aborted) else f"failed ({e})"))

        for p in self._others():
            theirs = self.peers[p, "ctl"].words
            self.wait(p, lambda: theirs[MAPPED] >= k + 1, explain)
        for path in self.named:
            shm.unlink_tracked(path)
        self.named = []

    def _ensure_ctl(self) -> None:
        if self.ctl is None:
            self.ctl = self._create(8 * ctl_words(self.n))
            words = self.ctl.words
            words[0], words[PID] = MAGIC, os.getpid()
            self.named.append(self.ctl.path)

    def exchanged(self) -> bool:
        """Whether this rank's control segment and every peer's are mapped (CMA's probe or an
        allocation maps them): the compiled read calls run on them."""
        return self.ctl is not None and len(self._peer_ctls()) == self.n - 1

    def map_ctl(self, p: int, name: str) -> None:
        if (p, "ctl") not in self.peers:
            self.peers[p, "ctl"] = self._map(name, 8 * ctl_words(self.n), p)

    def cma_ok(self) -> bool:
        """Whether plain buffers can take the read steps by CMA (plain_read.py). The first call is
        collective: the control segments are exchanged and every pair probed; every rank makes it
        at the same collective call (settle's condition is the same on every rank)."""
        if self.cma is None:
            if not self.shared:
                self.cma = False
            else:  # probed even where RINGCOMM_CMA=0: that rank's "no" must reach the others
                self._ensure_ctl()
                try:
                    self.cma = plain_read.setup(self, self.ctl.words, MAGIC)
                except StoreError as e:  # the store's host died: say who, in which call
                    raise PeerFailure(f"rank {self.rank} (this process) failed probing CMA{self._purpose()} "
                                      f"over shm: {e}{self.links.known_dead()}") from None
                from ringcomm.transport import shm
                for path in self.named:  # every peer mapped the control segment before its verdict
                    shm.unlink_tracked(path)
                self.named = []
        return self.cma

    def published(self, key: str, p: int, deadline: float, what: str) -> bytes:
        """A store key rank p publishes, with the communicator's deadline and errors."""
        me, why = f"rank {self.rank} (this process)", f"rank {p} to {what}{self._purpose()} over shm"
        try:
            return wait_key(self.ctx, key, deadline, p, "shm")
        except PeerTimeout:
            raise CollectiveTimeout(f"{me} timed out after {self.timeout:g} s waiting for {why}") from None
        except Aborted as e:
            raise RingcommError(f"{me} was aborted while waiting for {why}: {e}") from None
        except (PeerGone, StoreError) as e:
            raise PeerFailure(f"{me} failed waiting for {why}: {e}") from None

    def _purpose(self) -> str:
        return f", for {self.doing[0]} #{self.doing[1]}" if self.doing else self.links._purpose()

    def _create(self, size: int) -> _Map:
        global _serial
        _serial += 1  # per process: several communicators' names never collide
        job = os.environ.get("RINGCOMM_JOB_ID", "x")
        return _Map(f"/dev/shm/rc-{job}-{os.getpid()}-m{_serial}", size, create=True)

    def _key(self, k: int, rank: int) -> str:
        return f"{self.ctx.prefix}/alloc/{k}/{rank}"

    def _published(self, k: int, p: int, deadline: float) -> bytes:
        try:
            return wait_key(self.ctx, self._key(k, p), deadline, p, "shm")
        except PeerTimeout:
            raise CollectiveTimeout(f"rank {self.rank} (this process) timed out after {self.timeout:g} s waiting "
                                    f"for rank {p} to call alloc #{k} over shm (alloc is collective: every rank "
                                    f"calls it, in the same order)") from None
        except Aborted as e:
            raise RingcommError(f"rank {self.rank} (this process) was aborted in alloc #{k}: {e}") from None

    def _map(self, name: str, size: int, p: int) -> _Map:
        try:
            return _Map("/dev/shm/" + name, size, create=False)
        except FileNotFoundError:
            raise RingcommError(f"rank {self.rank} (this process): rank {p}'s registered segment {name} "
                                f"vanished before this rank mapped it (rank {p} closed or died)") from None

    # ---- which buffers -------------------------------------------------------------------------

    def locate(self, arr) -> tuple[int, int] | None:
        """(allocation index, byte offset) of a flat numpy view inside this rank's allocations."""
        if not isinstance(arr, np.ndarray):
            return None
        a = address(arr)
        for k, seg in enumerate(self.mine):
            if seg.base <= a and a + arr.nbytes <= seg.base + seg.size:
                return k, a - seg.base
        return None

    def holds(self, x, y) -> bool:
        return bool(self.mine) and self.locate(x) is not None and self.locate(y) is not None

    # ---- the engine (read_engine.py) and the waits both use --------------------------------------

    def run(self, ex, sched, call) -> None:
        """Run a "read" schedule on registered buffers (the executor's hook)."""
        self.engine.run(ex, sched, call)

    def wait(self, peer: int, ready, explain, ex=None, word: int | None = None) -> None:
        """Spin, yield, sleep (transport Backoff) until ready(); abort, liveness, watchdog, deadline
        as in transport/shm.py; explain(error) is what is raised (the executor's messages in a call).
        ``ex``: the executor, told where this rank waits (for the watchdog's table). ``word``: the
        index of the peer's control word that ready() reads; the sleep is then a futex on it, which
        the peer's store ends (publish())."""
        if ready():
            return
        t0 = time.monotonic()
        if ex is not None:
            ex._waiting = (peer, "sync", 0, t0)
        ctl = self.peers[peer, "ctl"].words
        backoff = Backoff(self.ctx.spins, None if word is None else self._sleeper(ctl, word, ready, peer))
        deadline, patrol = t0 + self.timeout, t0 + PATROL_PERIOD
        while not ready():
            backoff()
            if backoff.n & 63:
                continue
            if backoff.n == 64 and backoff.spins > 64 and waits_for_my_cpu(int(ctl[PID])):
                backoff.n = backoff.spins   # the peer waits for this CPU: stop polling, yield it now
            try:
                if self.ctx.abort is not None and self.ctx.abort.is_set():
                    raise Aborted("aborted", peer=peer, transport="shm")
                now = time.monotonic()
                if now >= patrol:
                    if ctl[CLOSED]:
                        raise PeerGone(f"rank {peer} closed its communicator", peer=peer, transport="shm")
                    if not pid_alive(int(ctl[PID])):
                        raise PeerGone(f"rank {peer} (pid {int(ctl[PID])}) died", peer=peer, transport="shm")
                    if self.ctx.watchdog is not None:
                        self.ctx.watchdog()
                    patrol = now + PATROL_PERIOD
                if now > deadline:
                    raise PeerTimeout("timed out", peer=peer, transport="shm")
            except (Aborted, PeerGone, PeerTimeout) as e:
                raise explain(e) from None
        if ex is not None:
            ex._waiting = None

    def _sleeper(self, ctl, word: int, ready, peer: int):
        addr, mine, flag = address(ctl) + 8 * word, self.ctl.words, sleep_flag(self.n, peer)

        def block(seconds: float) -> None:
            mine[flag] = 1   # the peer's publish() wakes this rank only while it is set
            try:
                seen = int(ctl[word])  # a store after this read fails the kernel's compare: no lost wake
                if not ready():
                    futex.wait(addr, seen, seconds)
            finally:
                mine[flag] = 0
        return block

    def publish(self, word: int, value: int) -> None:
        """Store ``value`` in this rank's control word ``word`` and wake the peers asleep on this
        rank's words (their flag for it, sleep_flag(n, this rank), is set): no syscall when none
        sleeps. As in transport/shm.py, x86 may let the flag's read pass this store, and a peer
        that set its flag just then sleeps until its futex times out (Backoff.MAX_SLEEP): later,
        never lost."""
        self.ctl.words[word] = value
        flag = sleep_flag(self.n, self.rank)
        for theirs in self._peer_ctls():
            if theirs[flag]:
                futex.wake(self.ctl.base + 8 * word)
                return

    def _peer_ctls(self) -> list:
        """The peers' control words, in rank order (for publish())."""
        got = self._ctls
        if got is None or len(got) < self.n - 1:   # not all mapped yet: look again
            got = self._ctls = [self.peers[p, "ctl"].words for p in self._others() if (p, "ctl") in self.peers]
        return got

    def leave(self) -> None:
        """Tell the peers this rank takes no more part (a failure or abort): their waits on it end."""
        if self.ctl is not None and self.ctl.bytes is not None:
            self.ctl.words[CLOSED] = 1

    def close(self) -> None:
        """Stop sharing: peers' mappings are dropped, this rank's names unlinked (its arrays stay valid)."""
        if self.closed:
            return
        self.closed = True
        from ringcomm.transport import shm
        self.leave()
        for path in self.named:
            shm.unlink_tracked(path)
        self.named = []
        self._ctls = None   # publish()'s views of the peers' words: dropped, so their maps can close
        self.engine.maps[0] = 0   # a compiled call would find no allocation mapped (none is called after close)
        for seg in self.peers.values():
            seg.close()
        self.peers.clear()
        # This rank's own segments: each mapping holds a file descriptor until it is closed. An
        # allocation whose array the user still holds stays mapped (and valid) until it is freed.
        for seg in ([self.ctl] if self.ctl is not None else []) + self.mine:
            seg.close()
