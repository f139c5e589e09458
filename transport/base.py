"""The Connection interface every transport implements, and the errors it raises.

A connection is one peer, one direction: a FIFO of ``nslots`` staging slots of
``slot_bytes`` each (NCCL's SIMPLE protocol: the sender owns the head counter,
the receiver the tail counter).

Sender::                         Receiver::

    slot = conn.acquire(deadline)     data = conn.wait(deadline)   # uint8 view, nbytes long
    slot[:n] = payload                use(data)                    # e.g. reduce straight out of it
    conn.post(n)                      conn.release()

The executor holds one slot at a time on each side. tcp and ibverbs also let a caller hold
several (acquire / wait again before post / release; post / release then hand back the oldest,
in order): the device path's proxy thread keeps slots in hand ahead of the GPU that fills or
drains them (transport/cuda_staged.py). Transports know nothing of
collectives; the executor above them turns their errors into messages that
name the collective and the slice.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class TransportError(RuntimeError):
    """A connection failed; ``peer`` and ``transport`` say which one."""

    def __init__(self, message: str, *, peer: int, transport: str):
        super().__init__(message)
        self.peer = peer
        self.transport = transport


class PeerTimeout(TransportError):
    """The deadline passed while waiting for the peer."""


class PeerGone(TransportError):
    """The peer closed the link, died, or sent something that breaks the protocol."""


class Aborted(TransportError):
    """A local abort woke the wait."""


class Store(Protocol):
    """What transports need of the rendezvous store (see ringcomm.store)."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float | None = None) -> bytes: ...


@dataclass(frozen=True)
class LinkContext:
    """Everything a transport needs to know about the job, handed down by the core.

    ``prefix`` is unique per communicator, so several communicators (or a test
    re-creating one) never read each other's keys or segments.
    """

    rank: int
    world_size: int
    store: Any
    prefix: str
    token: str = ""
    nslots: int = 8
    slot_bytes: int = 512 * 1024
    abort: Any = None  # a threading.Event; when set, every wait raises Aborted
    # Called from inside waits that last, at most every PATROL_PERIOD seconds: the
    # core uses it to answer "where are you?" when another rank times out.
    watchdog: Any = None
    # Busy polls before a wait starts yielding the core. 0 when this host runs more ranks than
    # it has cores: then the rank we wait for may need our core, and spinning only delays it.
    spins: int = 200
    # peer_gone(rank) -> "" or why that rank is known dead (its pid gone, its socket refusing),
    # the core's answer once every rank's roster entry is known: a wait for a store key that a
    # dead peer will never publish ends at the next patrol instead of at the deadline.
    peer_gone: Any = None

    def check_alive(self, peer: int, transport: str, then: str) -> None:
        """PeerGone, "rank {peer} {why}{then}", where peer_gone knows ``peer`` died; else nothing:
        the check every wait that lasts makes at its patrols."""
        why = self.peer_gone(peer) if self.peer_gone is not None else ""
        if why:
            raise PeerGone(f"rank {peer} {why}{then}", peer=peer, transport=transport)


def process_gone(pid: int) -> bool:
    """True when no process ``pid`` runs on this host: absent, or a zombie (/proc/PID/stat state
    Z or X). A SIGKILLed rank stays a zombie until its parent reaps it (a test harness, or a
    launcher that is slow to wait()), and kill(pid, 0) succeeds on a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the name in () may hold spaces
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False  # no /proc here: nothing proven
    return state in ("Z", "X")


def _getcpu():
    try:
        import ctypes
        fn = ctypes.CDLL(None).sched_getcpu
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_sched_getcpu = _getcpu()


def current_cpu() -> int:
    """The CPU this thread runs on now (sched_getcpu), or -1 where it cannot be told."""
    return _sched_getcpu() if _sched_getcpu is not None else -1


def waits_for_my_cpu(pid: int) -> bool:
    """True when process ``pid`` is runnable ("R") and was last placed on the CPU this thread runs
    on: it waits for this very core, so spinning here only delays it. (A peer on another core, or
    asleep, is not helped by giving up this core.) False where /proc or sched_getcpu is missing.
    A wait that asks often keeps a CpuWatch instead: this opens the file each time (17 us here)."""
    watch = CpuWatch()
    try:
        return watch.waits_for_my_cpu(pid)
    finally:
        watch.close()


class CpuWatch:
    """Where one process last ran, with its /proc/PID/stat kept open: a pread of it costs ~3-5 us
    against ~17 us to open, read and close it (measured on this 2-core VM). Its owner closes it
    with its link (or its communicator), so a closed communicator holds no fd."""

    def __init__(self) -> None:
        self.pid, self.fd = 0, -1

    def where(self, pid: int) -> tuple[bytes, int]:
        """(state, CPU) of process ``pid`` from /proc/PID/stat: proc(5)'s field 3 ("R": runnable)
        and field 39 (the CPU it last ran on; -1 if the line has none). OSError once it is gone."""
        if pid != self.pid:
            self.close()
            self.fd, self.pid = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC), pid
        fields = os.pread(self.fd, 1024, 0).rsplit(b")", 1)[-1].split()   # the name in () may hold spaces
        return (fields[0], int(fields[36])) if len(fields) > 36 else (b"", -1)

    def waits_for_my_cpu(self, pid: int) -> bool:
        """Whether ``pid`` is runnable and last placed on the CPU this thread runs on (see
        waits_for_my_cpu above)."""
        if _sched_getcpu is None or pid <= 0:
            return False
        try:
            state, cpu = self.where(pid)
        except OSError:  # gone (ESRCH once the process has exited): nothing waits for this CPU
            return False
        return state == b"R" and cpu == _sched_getcpu()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.pid, self.fd = 0, -1


PATROL_PERIOD = 0.5  # seconds between a slow wait's checks of peer liveness and the watchdog


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: kill(pid, 0) answers, and it is no zombie (see
    process_gone). 0 or less means "not attached yet": nothing to say, so True."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists; /proc still tells a zombie
    return not process_gone(pid)


def wait_key(ctx: LinkContext, key: str, deadline: float, peer: int, transport: str) -> bytes:
    """A store key the peer publishes, waited for in short pieces so that an abort or the
    watchdog is heard while connecting too (the store's own wait hears neither)."""
    while True:
        if ctx.abort is not None and ctx.abort.is_set():
            raise Aborted(f"aborted while waiting for rank {peer} to publish {key!r}", peer=peer,
                          transport=transport)
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout(f"waiting for rank {peer} to publish {key!r} in the store", peer=peer,
                              transport=transport)
        try:
            return ctx.store.get(key, timeout=min(left, PATROL_PERIOD))
        except TimeoutError:  # the store's StoreTimeout is one
            pass
        if ctx.watchdog is not None:
            ctx.watchdog()
        ctx.check_alive(peer, transport, f" before it published {key!r} in the store")


class SendConnection:
    transport = "?"
    peer: int
    slot_bytes: int

    def acquire(self, deadline: float) -> np.ndarray:
        """Block until a slot is free; return it as a writable uint8 array of slot_bytes."""
        raise NotImplementedError

    def post(self, nbytes: int) -> None:
        """Hand the acquired slot, holding ``nbytes`` of payload, to the receiver."""
        raise NotImplementedError

    def ready(self) -> bool:
        """True when acquire() would return (or raise) at once. The probe lets comm.group() run
        several calls without blocking on one; a transport without one says True, and a group
        then blocks on its acquire() as a single call would."""
        return True

    def check(self) -> None:
        """Raise PeerGone if the peer is known to have died or closed the link: what a blocking
        wait looks for at each patrol, for callers that poll ready() instead."""

    def close(self) -> None:
        pass


class RecvConnection:
    transport = "?"
    peer: int
    slot_bytes: int

    def wait(self, deadline: float) -> np.ndarray:
        """Block until the next slot is filled; return its payload as a uint8 array."""
        raise NotImplementedError

    def release(self) -> None:
        """Give the slot returned by the last wait() back to the sender."""
        raise NotImplementedError

    def ready(self) -> bool:
        """True when wait() would return (or raise) at once (see SendConnection.ready)."""
        return True

    def check(self) -> None:
        """See SendConnection.check."""

    def close(self) -> None:
        pass


class Transport:
    """Makes connections to peers. One instance per communicator."""

    name = "?"

    def __init__(self, ctx: LinkContext):
        self.ctx = ctx

    # Connecting never deadlocks because every rank connects all its sends
    # before any of its receives, and connect_send never waits for the peer's
    # connect_recv (it may wait for the peer's Transport to exist, which each
    # rank creates before it connects anything).

    def connect_send(self, peer: int, deadline: float) -> SendConnection:
        raise NotImplementedError

    def connect_recv(self, peer: int, deadline: float) -> RecvConnection:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Backoff:
    """Spin, then yield the core, then sleep with growing pauses.

    Several ranks on two cores must not spin each other to death: a spinning
    rank holds a core the rank it waits for may need. Spinning first keeps the
    common, fast hand-off (under a microsecond through shared memory) cheap; a
    blocking wake-up across cores costs ~100 us here, so sleeping comes last.
    ``block(seconds)``, where given, is the sleep: the shm transport passes a futex
    wait on the counter it waits for, which the peer's post ends early.
    """

    SPINS = 200  # the default; LinkContext.spins sets it per communicator
    YIELDS = 2000
    # With more ranks than cores (spins == 0) a long run of yields hands the core to every busy
    # process in turn (each takes a scheduler slice): measured with 4 ranks on 2 cores and two
    # nice-10 hogs, 8-byte all_reduce 1.6-3.7 ms with 2000 yields, 0.4-0.8 ms with 10-50. The
    # sleep that follows is a futex the peer's post ends (shm), so sleeping early costs little.
    YIELDS_SHARED = 50
    MAX_SLEEP = 1e-3

    __slots__ = ("n", "pause", "spins", "yields", "block")

    def __init__(self, spins: int = SPINS, block=None) -> None:
        self.n = 0
        self.pause = 2e-5
        self.spins = spins
        self.yields = spins + (self.YIELDS if spins else self.YIELDS_SHARED)
        self.block = block or time.sleep

    @classmethod
    def compiled_yields(cls, spinning: bool) -> int:
        """The sched_yield()s a wait makes in compiled code before Python's wait takes it
        (engine_native, read_native): none where ranks spin, YIELDS_SHARED where they share cores."""
        return 0 if spinning else cls.YIELDS_SHARED

    def stage(self, n: int) -> str:
        """What the n-th call (from 1) does: "spin", "yield" or "sleep"."""
        if n <= self.spins:
            return "spin"
        return "yield" if n <= self.yields else "sleep"

    def __call__(self) -> None:
        self.n += 1
        if self.n <= self.spins:
            return
        if self.n <= self.yields:
            os.sched_yield()
            return
        self.block(self.pause)
        self.pause = min(self.pause * 2, self.MAX_SLEEP)
