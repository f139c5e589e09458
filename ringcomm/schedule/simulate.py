"""Run all ranks' schedules of one collective symbolically, and check them.

No data moves: rank r's input chunk c is the contribution ``(r, c)`` (under the
OWN layout every chunk index reads the same memory, the rank's own block, named
``(r, r)``). A reduction keeps its contributions as a sorted tuple plus the
order they were combined in, so a contribution counted twice is caught where it
happens rather than hidden inside a sum.

The transport is modelled exactly as the executor runs it: per round, each rank
runs its steps in order; a step moves its chunk as ``slices`` consecutive
slices; for each slice it (1) takes one slice from each src connection in
order, (2) acquires one free slot on each dst connection in order, waiting while
that FIFO is full and still holding what it received, (3) computes, (4) releases
the received slices and posts the sends. A connection (one per ordered pair of
ranks) holds at most ``nslots`` slices; a slot is busy from the sender's acquire
until the receiver's release. Every wait is on a condition that only the waiter
can undo (only the receiver drains a FIFO, only the sender fills it), so whether
the ranks finish does not depend on how they are interleaved: advancing each
rank as far as it goes, in turns, until none moves is exact.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import peer_read
from .step import OWN, Schedule, Step


class ScheduleError(ValueError):
    """A schedule is wrong: it deadlocks, loses or duplicates data, or computes the wrong result."""


@dataclass(frozen=True)
class Sym:
    """A symbolic chunk value: the sorted contributions, how they were combined,
    and whether the op's post-processing (AVG's division) has been applied."""

    terms: tuple[tuple[int, int], ...]
    order: object  # a leaf (rank, chunk), or a tuple of the combined operands' orders
    post: bool = False

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for r, _ in self.terms)

    def __str__(self) -> str:
        def show(o):
            if isinstance(o[0], int):
                return f"x{o[0]}[{o[1]}]"
            return "(" + " + ".join(show(x) for x in o) + ")"
        return show(self.order) + ("/post" if self.post else "")


def _combine(a: Sym, b: Sym, where: str) -> Sym:
    dup = sorted(set(a.terms) & set(b.terms))
    if dup:
        raise ScheduleError(f"{where}: contribution(s) {dup} counted twice when combining {a} with {b}")
    if a.post or b.post:
        raise ScheduleError(f"{where}: reduces {a} with {b}, but one of them already had the op's "
                            f"post-processing (AVG's division) applied by a final step")
    return Sym(tuple(sorted(a.terms + b.terms)), (a.order, b.order))


@dataclass
class Result:
    """What a simulation produced. Outputs are [rank][chunk]; under the OWN output layout a
    rank has one output cell, shown at index rank % nchunks."""

    outputs: list[list[Sym | None]]  # round 0
    messages: int                    # slices posted, all rounds together
    round_outputs: list[list[list[Sym | None]]] = field(default_factory=list)  # [round][rank][chunk]
    # every final step's value, once per step: (round, rank, step index, step, value)
    finals: list[tuple[int, int, int, Step, Sym]] = field(default_factory=list)
    # [round][rank]: the ranks known (directly or through others) to have entered that round
    knowledge: list[list[frozenset[int]]] = field(default_factory=list)


@dataclass
class _Msg:
    tag: tuple[int, int, int]  # (round, chunk, slice): both ends must agree on it
    value: Sym
    known: frozenset          # (rank, round) pairs the sender knew had started, for barriers
    sender: int
    origin: str               # the sending step, for error messages


@dataclass
class _Conn:
    queue: deque = field(default_factory=deque)  # posted, not yet taken by the receiver
    used: int = 0                                # posted + held by the receiver + acquired by the sender


@dataclass
class _Rank:
    sched: Schedule
    round: int = 0
    index: int = 0          # step index within the round
    slice: int = 0
    got: list = field(default_factory=list)  # slices taken for the current slice, one per src so far
    acquired: int = 0       # dst slots acquired for the current slice
    known: set = field(default_factory=set)
    done: bool = False

    def where(self) -> str:
        step = self.sched.steps[self.index]
        return f"rank {self.sched.rank} round {self.round} step {self.index} {step} slice {self.slice}"


def _validate(schedules: list[Schedule]) -> int:
    n = len(schedules)
    if n == 0:
        raise ScheduleError("no schedules")
    nchunks = schedules[0].nchunks
    for r, s in enumerate(schedules):
        if s.rank != r or s.world_size != n:
            raise ScheduleError(f"schedule {r} says rank {s.rank} of {s.world_size}; "
                                f"expected rank {r} of {n}")
        if s.nchunks != nchunks:
            raise ScheduleError(f"rank {r} cuts a round into {s.nchunks} chunks, rank 0 into {nchunks}")
        for i, st in enumerate(s.steps):
            bad = [p for p in st.src + st.dst if not 0 <= p < n or p == r]
            if bad or not 0 <= st.chunk < nchunks:
                raise ScheduleError(f"rank {r} step {i} {st}: chunk or peer out of range "
                                    f"(n={n}, nchunks={nchunks})")
            if len(st.src) > 1 and not st.reduces:
                raise ScheduleError(f"rank {r} step {i} {st}: receives from several peers without reducing")
    peer_read.validate(schedules, ScheduleError)  # steps that read registered buffers
    return n


def _check_pairing(schedules: list[Schedule]) -> None:
    """Per connection a->b, the chunks a sends must be the chunks b receives, in the
    same order: the FIFO delivers in send order, and a chunk's size (and whether it is
    empty and skipped by both ends) follows from its index."""
    n = len(schedules)
    sent = {(a, b): [] for a in range(n) for b in range(n)}
    taken = {(a, b): [] for a in range(n) for b in range(n)}
    for s in schedules:
        for st in s.steps:
            for b in st.dst:
                sent[s.rank, b].append(st.chunk)
            for a in st.src:
                taken[a, s.rank].append(st.chunk)
    for (a, b), chunks in sent.items():
        if chunks != taken[a, b]:
            what = "in a different order" if sorted(chunks) == sorted(taken[a, b]) else "different chunks"
            raise ScheduleError(f"connection {a}->{b} of {schedules[0].collective}: rank {a} sends chunks "
                                f"{chunks} per round but rank {b} receives {taken[a, b]} ({what})")


class _Sim:
    def __init__(self, schedules, nslots, slices, rounds):
        self.n, self.nslots, self.slices, self.rounds = len(schedules), nslots, slices, rounds
        self.ranks = [_Rank(s) for s in schedules]
        self.conns = {}
        self.messages = 0
        nchunks = schedules[0].nchunks
        self.outputs = [[[None] * nchunks for _ in range(self.n)] for _ in range(rounds)]
        self.knowledge = [[frozenset()] * self.n for _ in range(rounds)]
        self.finals = []
        for st in self.ranks:
            self._start_round(st)

    def conn(self, a: int, b: int) -> _Conn:
        return self.conns.setdefault((a, b), _Conn())

    def _start_round(self, st: _Rank) -> None:
        while st.round < self.rounds:
            st.known.add((st.sched.rank, st.round))
            if st.sched.steps:
                return
            self._end_round(st)
        st.done = True

    def _end_round(self, st: _Rank) -> None:
        self.knowledge[st.round][st.sched.rank] = frozenset(q for q, rd in st.known if rd == st.round)
        st.round += 1
        st.index = 0

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for st in self.ranks:
                while not st.done and self._advance(st):
                    moved = True
        if not all(st.done for st in self.ranks):
            self._deadlock()
        left = {k: len(c.queue) for k, c in self.conns.items() if c.queue}
        if left:
            raise ScheduleError(f"messages left unreceived at the end (connection: slices): {left}")

    def _advance(self, st: _Rank) -> bool:
        """Finish one slice of st's current step, or return False where it must wait. What it
        took or acquired before waiting stays taken, as in the executor; that enables no other
        rank (only posting and releasing do, in _compute), so run() need not count it as a move."""
        step, me = st.sched.steps[st.index], st.sched.rank
        if step.remote and not peer_read.advance(self, st, step):  # reads a registered buffer, or syncs
            return False
        while len(st.got) < len(step.src):
            c = self.conn(step.src[len(st.got)], me)
            if not c.queue:
                return False
            msg = c.queue.popleft()
            if msg.tag != (st.round, step.chunk, st.slice):
                raise ScheduleError(f"{st.where()} expected slice {st.slice} of chunk {step.chunk} "
                                    f"(round {st.round}) but got {msg.tag} from {msg.origin}")
            st.got.append(msg)
        while st.acquired < len(step.dst):
            c = self.conn(me, step.dst[st.acquired])
            if c.used >= self.nslots:
                return False
            c.used += 1
            st.acquired += 1
        self._compute(st, step)
        return True

    def _compute(self, st: _Rank, step: Step) -> None:
        s, me = st.sched, st.sched.rank
        where = st.where()
        own = (me, me) if s.in_layout == OWN else (me, step.chunk)
        value = Sym((own,), own) if not step.recvs or step.reduces else st.got[0].value
        if step.remote:
            value = peer_read.value(self, st, step, where)
        for msg in st.got:
            st.known |= msg.known
            if step.reduces:
                value = _combine(value, msg.value, where)
            self.conn(msg.sender, me).used -= 1
        if step.final:
            value = Sym(value.terms, value.order, post=True)
            if st.slice == 0:
                self.finals.append((st.round, me, st.index, step, value))
        if step.copies:
            out = me % s.nchunks if s.out_layout == OWN else step.chunk
            self.outputs[st.round][me][out] = value
        known = frozenset(st.known)
        for b in step.dst:
            self.conn(me, b).queue.append(_Msg((st.round, step.chunk, st.slice), value, known, me, where))
            self.messages += 1
        st.got, st.acquired = [], 0
        st.slice += 1
        if st.slice == self.slices:
            st.slice, st.index = 0, st.index + 1
            if st.index == len(s.steps):
                self._end_round(st)
                self._start_round(st)

    def _deadlock(self) -> None:
        lines = []
        for st in self.ranks:
            if st.done:
                lines.append(f"rank {st.sched.rank}: finished")
                continue
            step, me = st.sched.steps[st.index], st.sched.rank
            if step.remote:
                wait = peer_read.waiting(self, st, step)[1]
            elif len(st.got) < len(step.src):
                peer = step.src[len(st.got)]
                wait = f"waits for a slice from rank {peer} (FIFO {peer}->{me} is empty)"
                if self.ranks[peer].done:
                    raise ScheduleError(f"{st.where()} waits for a slice from rank {peer}, "
                                        f"which finished its schedule without sending it")
            else:
                peer = step.dst[st.acquired]
                c = self.conn(me, peer)
                wait = (f"waits for a free slot on FIFO {me}->{peer} ({len(c.queue)} of {self.nslots} "
                        f"slots posted and not yet taken, {c.used - len(c.queue)} held or acquired)")
            lines.append(f"{st.where()}: {wait}")
        head = f"deadlock with nslots={self.nslots}, slices={self.slices}:\n  "
        raise ScheduleError(head + "\n  ".join(lines))


def simulate(schedules: list[Schedule], *, nslots: int = 2, slices: int = 1, rounds: int = 2,
             root: int | None = None) -> Result:
    """Run every rank's schedule for ``rounds`` rounds over FIFOs of ``nslots`` slots,
    each step moving ``slices`` slices. ``root`` is accepted for symmetry with check()."""
    if nslots < 1 or slices < 1 or rounds < 1:
        raise ValueError(f"need nslots, slices, rounds >= 1, got {nslots}, {slices}, {rounds}")
    _validate(schedules)
    _check_pairing(schedules)
    sim = _Sim(schedules, nslots, slices, rounds)
    sim.run()
    return Result(sim.outputs[0], sim.messages, sim.outputs, sim.finals, sim.knowledge)


_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
_COLLECTIVES = _REDUCTIONS + ("all_gather", "broadcast", "barrier")


def _expected(collective: str, n: int, nchunks: int, rank: int, root: int | None):
    """(output chunk index, contributions it must hold) for one rank."""
    def full(c):
        return tuple((q, c) for q in range(n))
    if collective == "all_reduce":
        return [(c, full(c)) for c in range(nchunks)]
    if collective == "reduce_scatter":  # OWN output: the one cell sits at index rank % nchunks
        return [(rank % nchunks, full(rank))]
    if collective == "all_gather":      # OWN input: rank c's block is named (c, c)
        return [(c, ((c, c),)) for c in range(nchunks)]
    if collective == "broadcast":
        return [(c, ((root, c),)) for c in range(nchunks)]
    if collective == "reduce":
        return [(c, full(c)) for c in range(nchunks)] if rank == root else []
    return []


def _check_round(collective, res, rd, n, nchunks, root):
    if collective == "barrier":
        for r, known in enumerate(res.knowledge[rd]):
            if known != frozenset(range(n)):
                missing = sorted(set(range(n)) - known)
                raise ScheduleError(f"barrier round {rd}: rank {r} finished without hearing "
                                    f"(even indirectly) from rank(s) {missing}")
        return
    for r in range(n):
        for c, terms in _expected(collective, n, nchunks, r, root):
            v = res.round_outputs[rd][r][c]
            if v is None or v.terms != terms:
                raise ScheduleError(f"{collective} round {rd}: rank {r} output chunk {c} is {v}, "
                                    f"expected contributions {list(terms)}")
            if collective in _REDUCTIONS and n > 1 and not v.post:
                raise ScheduleError(f"{collective} round {rd}: rank {r} output chunk {c} = {v} never "
                                    f"went through a final (reduce + copy) step, so AVG would not divide")


def check(collective: str, schedules: list[Schedule], root: int | None = None, **kw) -> Result:
    """simulate() the schedules and check the result against ``collective``'s meaning;
    every final step (where AVG divides) must also see the complete reduction."""
    if collective not in _COLLECTIVES:
        raise ValueError(f"check() knows {_COLLECTIVES}, not {collective!r}")
    if collective in ("broadcast", "reduce") and root is None:
        raise ValueError(f"check({collective!r}) needs the root")
    for s in schedules:
        if s.collective != collective:
            raise ScheduleError(f"rank {s.rank}'s schedule is for {s.collective}, not {collective}")
    res = simulate(schedules, **kw)
    n, nchunks = len(schedules), schedules[0].nchunks
    for rd, r, i, step, v in res.finals:
        if v.ranks != frozenset(range(n)):
            raise ScheduleError(f"round {rd} rank {r} step {i} {step} is final (AVG divides there) but "
                                f"holds only {v}: missing rank(s) {sorted(set(range(n)) - v.ranks)}")
    for rd in range(len(res.round_outputs)):
        _check_round(collective, res, rd, n, nchunks, root)
    return res
