"""``with comm.group(): ...``: calls that start together and all complete when the block exits.

Inside the block a call is checked as usual (TypeError / ValueError at once) and recorded; nothing
moves. At the exit the members run together, slice by slice (NCCL's ncclGroupStart / End): each
member is its own slice plan, and one loop takes from every member, in turn, the slices whose
connections are ready -- data waiting for a receive, a free slot for a send -- so no member blocks
another. That is why any matching set works whatever its order and message sizes: every rank
sending to rank + 1 before receiving from rank - 1, or an all-to-all as n - 1 sends and n - 1
receives, where calls one after another would wait for each other once a FIFO is full.

Each (peer, direction) connection is one FIFO, so the members that share one take turns, in an
order every rank derives alike whatever the interleaving in the block: first the group's
collectives, in issue order (every rank issues its collectives in the same order), then its
point-to-point calls, in issue order (so several messages between the same pair match in issue
order). A member touches a connection only once every member before it has finished with it.
Collectives never wait for point-to-point traffic, and the point-to-point calls then run together,
so no turn waits for ever.

Device buffers join the same loop: a device member's slices are queued on the device path's
stream by its own executor (ringcomm/device.py), over cuda_ipc or staged connections, whose
ready() is host state only (cuda_ipc's host counters; the proxy's slots in hand for staged links).
The GPU cannot deadlock on that order: every flag our stream is told to wait for was queued for
writing on the peer's stream before the peer's host moved the counter this rank saw, so each wait
points to work queued earlier in time, and time has no cycles. A group of host and device calls
runs as one; the device members' streams start after their callers' streams and the callers'
streams wait for the whole group (the device path's stream rule, once per group).

Collectives on registered buffers (comm.alloc, algorithm "read") use no FIFO: they run first, one
after the other in issue order, each as it would alone (ringcomm/read_engine.py); every rank's group
holds the same collectives in the same order, so every rank runs the same ones first.

A wait has the communicator's timeout measured from the group's last progress; the error names
the stalled members. Any failure fails the whole group (and, as everywhere, the communicator).
"""
from __future__ import annotations

import time

import numpy as np

from ringcomm.kernels import host as kernels
from ringcomm.transport.base import PATROL_PERIOD, Aborted, Backoff, PeerGone, PeerTimeout


class Group:
    """What ``comm.group()`` returns. Groups nest: an inner block's calls join the outer group."""

    def __init__(self, comm):
        self.comm = comm
        self.members: list = []   # (schedule, Call), in issue order
        self.pre: list = []       # functions to run before the members (RINGCOMM_DEBUG=check's checks)
        self.to_self: list = []   # ("send" | "recv", array): this rank's messages to itself, in issue order
        self._outer = None

    def __enter__(self):
        progress = self.comm._progress
        self._outer = progress.capture()
        if self._outer is not None:  # nested: record into the outermost group
            self.members, self.pre, self.to_self = self._outer.members, self._outer.pre, self._outer.to_self
        progress.set_capture(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.comm._progress.set_capture(self._outer)
        if exc_type is not None or self._outer is not None:
            return False  # an error inside the block discards the group: nothing has moved
        if self.to_self:
            pairs = pair_to_self(self.to_self, self.comm.rank)  # a ValueError before anything moves
            self.pre.append(lambda: copy_to_self(pairs))
        if self.members or self.pre:
            self.comm._progress.run("group", self._run)
        return False

    def execute(self, run_now, sched, call) -> None:
        self.members.append((sched, call))

    def later(self, fn) -> None:
        self.pre.append(fn)

    def _run(self) -> None:
        for fn in self.pre:
            fn()
        comm = self.comm
        comm._execute_now(self.members, None, engine=_Together(comm))


def pair_to_self(to_self: list, rank: int) -> list:
    """A group's sends to this rank itself and receives from it, paired in issue order (as NCCL
    pairs them): (sent array, receiving array), checked alike in size and dtype."""
    sends = [a for kind, a in to_self if kind == "send"]
    recvs = [a for kind, a in to_self if kind == "recv"]
    if len(sends) != len(recvs):
        raise ValueError(f"comm.group() on rank {rank}: {len(sends)} send(s) to this rank itself and "
                         f"{len(recvs)} receive(s) from it; each needs its partner in the same group")
    for i, (x, y) in enumerate(zip(sends, recvs)):
        if x.dtype != y.dtype or x.size != y.size:
            raise ValueError(f"comm.group() on rank {rank}: send {i} to this rank itself has {x.size} {x.dtype}, "
                             f"the receive it pairs with {y.size} {y.dtype}")
    return list(zip(sends, recvs))


def copy_to_self(pairs: list) -> None:
    for x, y in pairs:
        np.copyto(y.reshape(-1), x.reshape(-1))


class _Together:
    """The engine comm._execute_now runs a group with: the "schedule" is the list of members.
    Host members run on the communicator's executor, device members on its device path's."""

    def __init__(self, comm):
        self.comm = comm

    def run(self, members, _call) -> None:
        host = self.comm._executor
        device = [call for _, call in members if not isinstance(call.inp, np.ndarray)]
        if not device:
            run_group([(host, s, c) for s, c in members])
            return
        path = self.comm._device_path(device[0])
        label = "a group of " + ", ".join(f"{c.name} #{c.seq}" for _, c in members)
        path.run_calls(device, label, lambda dev: run_group(
            [(host if isinstance(c.inp, np.ndarray) else dev, s, c) for s, c in members]))


class _Member:
    """One call of a group: its slice plan and how far it has got."""

    __slots__ = ("executor", "call", "plan", "pos", "nsteps", "inp", "out", "fn", "in_place", "left", "p2p")

    def __init__(self, executor, sched, call):
        self.executor, self.call, self.pos, self.nsteps = executor, call, 0, len(sched.steps)
        self.p2p = sched.algo == "p2p"  # send / recv: their turn on a connection comes after collectives
        self.plan = executor._cached_plan(sched, call, False)
        self.inp, self.out = call.inp, call.out
        # None: a device member (call.dev queues its slices' kernels on the device path's stream)
        self.fn = kernels.elementwise(call.op, call.inp.dtype) if call.dev is None else None
        self.in_place = call.inp is call.out
        self.left: dict = {}  # connection -> slices of this member still to use it
        for entry in self.plan:
            for _, conn in entry[6] + entry[7]:
                self.left[conn] = self.left.get(conn, 0) + 1


def run_group(members) -> None:
    """Run ``members`` [(executor, schedule, Call)] of one rank together; see the module docstring.
    The executor is the host one or the device path's (whose links are device connections)."""
    for executor, sched, call in members:
        if sched.registered and call.m > 0:
            executor.run(sched, call)
    members = [(e, s, c) for e, s, c in members if c.m > 0 and not s.registered]
    if not members:
        return
    # The host executor before the device path's, whatever the issue order: see _connect.
    executors = sorted(dict.fromkeys(e for e, _, _ in members),
                       key=lambda e: any(c.dev is not None for x, _, c in members if x is e))
    for executor in executors:
        _connect(executor, [(s, c) for e, s, c in members if e is executor])
    pending = [_Member(e, s, c) for e, s, c in members]
    turn: dict = {}  # connection -> the members that use it, in turn; the first has it now
    for m in sorted(pending, key=lambda m: m.p2p):  # stable: issue order within each kind
        for conn in m.left:
            turn.setdefault(conn, []).append(m)
    watchdog, shown = executors[0].watchdog, [executors[0]]
    saved = watchdog.position if watchdog is not None else None
    if watchdog is not None:  # "where is this rank": the executor of the member the group waits on
        watchdog.position = lambda: shown[0].position()
    try:
        with np.errstate(all="ignore"):
            _loop(executors[0], pending, turn, shown)
    finally:
        if watchdog is not None:
            watchdog.position = saved


def _connect(executor, members) -> None:
    """Connect every connection ``executor``'s members use: sends before receives (see Transport).
    Every rank connects its host links before its device links: they are separate transports, each
    made at its first connection, and a send may wait for the peer's transport to exist -- so the
    peer must never be blocked in the other kind's connects, waiting for us, before it makes it."""
    srcs, dsts = set(), set()
    for sched, _ in members:
        s, d = sched.peers()
        srcs |= s
        dsts |= d
    native = getattr(executor, "native", None)  # a compiled engine holding the shm counters
    if native is not None:
        native.release()  # the reference engine's slices below take the connections over
    executor.links.call = members[0][1]  # named in connect errors
    executor.links.prepare(srcs, dsts)


def _loop(executor, pending, turn, shown) -> None:
    ctx = executor.links.ctx
    backoff, stalled_since, next_patrol = Backoff(ctx.spins), None, 0.0
    while pending:
        moved = False
        for m in pending:
            moved |= _advance(m, turn)
        if moved:
            pending = [m for m in pending if m.pos < len(m.plan)]
            backoff, stalled_since = Backoff(ctx.spins), None
            continue
        backoff()
        if backoff.n & 63:
            continue
        now = time.monotonic()
        if stalled_since is None:
            stalled_since, next_patrol = now, now + PATROL_PERIOD
            _note_wait(pending, turn, now, shown)
        if ctx.abort is not None and ctx.abort.is_set():
            raise _fail(executor, pending, turn, Aborted, "aborted")
        if now - stalled_since > executor.timeout:
            raise _fail(executor, pending, turn, PeerTimeout, "timed out")
        if now >= next_patrol:
            _patrol(pending, turn)
            if ctx.watchdog is not None:
                ctx.watchdog()
            next_patrol = now + PATROL_PERIOD


def _advance(m: _Member, turn) -> bool:
    """Run m's next slices while their connections are m's turn and ready; True if any ran."""
    plan, moved, executor = m.plan, False, m.executor
    executor._call, executor._nsteps = m.call, m.nsteps
    while m.pos < len(plan):
        entry = plan[m.pos]
        for _, conn in entry[6]:
            if turn[conn][0] is not m or not conn.ready():
                return moved
        for _, conn in entry[7]:
            if turn[conn][0] is not m or not conn.ready():
                return moved
        # Every connection is ready, so the slice's waits return at once.
        if m.fn is None:
            executor._device_slice(entry, m.call)
        else:
            executor._slice(entry, m.call, m.inp, m.out, m.fn, m.in_place)
        m.pos += 1
        moved = True
        for _, conn in entry[6] + entry[7]:
            m.left[conn] -= 1
            if not m.left[conn]:
                turn[conn].pop(0)  # the next member in issue order may use it now
    return moved


def _blocked(pending, turn):
    """(member, peer, direction, connection) for every member waiting on its peer (not on an
    earlier member of the group)."""
    for m in pending:
        entry = m.plan[m.pos]
        for direction, ends in (("recv", entry[6]), ("send", entry[7])):
            for peer, conn in ends:
                if turn[conn][0] is m and not conn.ready():
                    yield m, peer, direction, conn
                    break


def _note_wait(pending, turn, t0, shown) -> None:
    """Tell the watchdog what the group waits for (the first stalled member, on its executor)."""
    for m, peer, direction, _ in _blocked(pending, turn):
        executor = shown[0] = m.executor
        executor._call, executor._step = m.call, m.plan[m.pos][0]
        executor._waiting = (peer, direction, m.plan[m.pos][8], t0)
        return


def _patrol(pending, turn) -> None:
    """Look for dead peers (a transport's check()), as a blocking wait does at each patrol."""
    for m, peer, direction, conn in _blocked(pending, turn):
        try:
            conn.check()
        except PeerGone as e:
            raise m.executor._explain(e, _doing(pending, m, peer, direction)) from None


def _fail(executor, pending, turn, kind, what):
    for m, peer, direction, conn in _blocked(pending, turn):
        e = kind(f"{what} in a group", peer=peer, transport=conn.transport)
        return m.executor._explain(e, _doing(pending, m, peer, direction))
    # Nothing waits on a peer, so members wait on each other: a bug, said plainly.
    names = ", ".join(f"{m.call.name} #{m.call.seq}" for m in pending)
    return RuntimeError(f"rank {executor.rank}: group members {names} wait on each other")


def _doing(pending, m, peer, direction) -> str:
    names = ", ".join(f"{x.call.name} #{x.call.seq}" for x in pending)
    nslice = m.plan[m.pos][8]
    where = f"to send slice {nslice} of {m.call.name} #{m.call.seq} to" if direction == "send" else \
        f"for slice {nslice} of {m.call.name} #{m.call.seq} from"
    return f"in a group ({len(pending)} calls unfinished: {names}) waiting {where}"
