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

Memory is modelled as the executor uses it too. A step reads its input chunk
(when it does not receive, or when it reduces what it receives into the input)
before it writes its output chunk, slice by slice. In place (``in_place=True``;
spec.aliases says which output cell shares memory with which input chunk) a
write that changes a cell's content is remembered, and a later read of that
input is a READ_AFTER_WRITE failure naming both steps: the executor would read
the new value there, not the rank's input. Writing back the same value (a rank
copying its own block into place) changes nothing and is allowed, as the
executor's in-place copy skip relies on. Because such a read is refused, every
value a rank sends is the same in both forms, so checking "every rank in place"
and "every rank out of place" also covers ranks that mix them.

Value faults (counted twice, post-op misuse, read-after-write) are recorded in
``Result.faults`` and the run goes on, so the FIFO model always runs to its end
or to a real deadlock; faults that stop it (deadlock, unmatched messages) raise
ScheduleError with every fault found so far.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import peer_read
from .faults import (DEADLOCK, MALFORMED, POST_OP, READ_AFTER_WRITE, TWICE, UNMATCHED, Failure,
                     ScheduleError)
from .spec import IN_PLACE, aliases, input_name, layout_failures, output_cell, postcondition, spec
from .step import SPLIT, Schedule, Step
from .values import Result, Sym

__all__ = ["ScheduleError", "Failure", "Sym", "Result", "simulate", "check"]
UNBOUNDED = 1 << 30  # slots: a FIFO that never fills


def fifo(nslots: int, slices: int) -> str:
    return f"nslots={'unbounded' if nslots >= UNBOUNDED else nslots}, slices={slices}"


def _validate(schedules: list[Schedule]) -> int:
    n = len(schedules)
    if n == 0:
        raise ScheduleError([Failure(MALFORMED, None, None, None, "no schedules")])
    nchunks = schedules[0].nchunks
    for r, s in enumerate(schedules):
        if not isinstance(s, Schedule):
            raise ScheduleError([Failure(MALFORMED, r, None, None, f"rank {r}'s schedule is a "
                                         f"{type(s).__name__}, not a Schedule")])
        if s.rank != r or s.world_size != n:
            raise ScheduleError([Failure(MALFORMED, r, None, None, f"schedule {r} says rank {s.rank} of "
                                         f"{s.world_size}; expected rank {r} of {n}")])
        if s.nchunks != nchunks or nchunks < 1:
            raise ScheduleError([Failure(MALFORMED, r, None, None, f"rank {r} cuts a round into "
                                         f"{s.nchunks} chunks, rank 0 into {nchunks}")])
        if (s.in_layout == SPLIT) != (schedules[0].in_layout == SPLIT):
            # a chunk's length (so the slices both ends of a FIFO cut) follows from in_layout
            raise ScheduleError([Failure(MALFORMED, r, None, None, f"rank {r} cuts its input as "
                                         f"{s.in_layout}, rank 0 as {schedules[0].in_layout}: their "
                                         f"chunks, and so their slices, differ in length")])
        for i, st in enumerate(s.steps):
            bad = [p for p in st.src + st.dst if not 0 <= p < n or p == r]
            if bad or not 0 <= st.chunk < nchunks:
                raise ScheduleError([Failure(MALFORMED, r, i, st.chunk, f"rank {r} step {i} {st}: chunk "
                                             f"or peer out of range (n={n}, nchunks={nchunks})")])
            if len(set(st.src)) < len(st.src) or len(set(st.dst)) < len(st.dst):
                raise ScheduleError([Failure(MALFORMED, r, i, st.chunk, f"rank {r} step {i} {st}: names "
                                             f"a peer twice (a FIFO delivers one slice at a time)")])
            if len(st.src) > 1 and not st.reduces:
                raise ScheduleError([Failure(MALFORMED, r, i, st.chunk, f"rank {r} step {i} {st}: "
                                             f"receives from several peers without reducing")])
    peer_read.validate(schedules)  # steps that read registered buffers
    return n


def _check_pairing(schedules: list[Schedule]) -> None:
    """Per connection a->b, the chunks a sends must be the chunks b receives, in the
    same order: the FIFO delivers in send order, and a chunk's size (and whether it is
    empty and skipped by both ends) follows from its index."""
    n = len(schedules)
    sent = {(a, b): [] for a in range(n) for b in range(n)}
    taken = {(a, b): [] for a in range(n) for b in range(n)}
    for s in schedules:
        for i, st in enumerate(s.steps):
            for b in st.dst:
                sent[s.rank, b].append((st.chunk, i))
            for a in st.src:
                taken[a, s.rank].append((st.chunk, i))
    failures = []
    for (a, b), out in sent.items():
        got = taken[a, b]
        chunks, want = [c for c, _ in out], [c for c, _ in got]
        if chunks == want:
            continue
        what = "in a different order" if sorted(chunks) == sorted(want) else "different chunks"
        # where the two ends first part: the step on whichever side has the odd one out
        k = next(k for k in range(max(len(out), len(got))) if k >= min(len(out), len(got))
                 or out[k][0] != got[k][0])
        rank, (chunk, step) = (a, out[k]) if k < len(out) else (b, got[k])
        failures.append(Failure(UNMATCHED, rank, step, chunk, f"connection {a}->{b} of "
                                f"{schedules[0].collective}: rank {a} sends chunks {chunks} per round "
                                f"but rank {b} receives {want} ({what})"))
    if failures:
        raise ScheduleError(failures)


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


class _Sim:
    def __init__(self, schedules, nslots, slices, rounds, in_place=False):
        self.n, self.nslots, self.slices, self.rounds = len(schedules), nslots, slices, rounds
        self.ranks = [_Rank(s) for s in schedules]
        self.conns = {}
        self.messages = 0
        nchunks = schedules[0].nchunks
        self.outputs = [[[None] * nchunks for _ in range(self.n)] for _ in range(rounds)]
        self.knowledge = [[frozenset()] * self.n for _ in range(rounds)]
        self.finals = []
        self.faults: list[Failure] = []
        self._seen: set = set()          # (kind, rank, step): each fault reported once, not per slice
        self.writers: dict = {}          # (round, rank, output cell) -> step index
        self.kept: dict = {}             # (round, rank, output cell, slice) -> what the rank wrote there
        # In place: output cell -> the input chunk name in the same memory, per rank; and the
        # input slices overwritten with a new value: (round, rank, name, slice) -> (the writing
        # rank's step, in words; value)
        self.alias = [aliases(s) if in_place else {} for s in schedules]
        self.overwritten: dict = {}
        # Only schedules that write into peers' buffers keep a log of every access, for the race
        # check of schedule/peer_read.py (FIFO schedules cannot race: each rank writes its own).
        self.racy = any(x.writes for s in schedules for x in s.steps)
        for st in self.ranks:
            self._start_round(st)

    def conn(self, a: int, b: int) -> _Conn:
        return self.conns.setdefault((a, b), _Conn())

    def _fault(self, kind, st: _Rank, detail: str, form=None) -> None:
        key = (kind, st.sched.rank, st.index)
        if key not in self._seen:
            self._seen.add(key)
            step = st.sched.steps[st.index]
            self.faults.append(Failure(kind, st.sched.rank, st.index, step.chunk, detail, form))

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
            (a, b), _ = next(iter(left.items()))
            self._stop(Failure(UNMATCHED, a, None, None, f"messages left unreceived at the end "
                                                          f"(connection: slices): {left}"))

    def _stop(self, failure: Failure) -> None:
        """A fault the run cannot go past: raise it after every value fault met so far."""
        raise ScheduleError(self.faults + [failure])

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
                self._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} expected slice "
                                   f"{st.slice} of chunk {step.chunk} (round {st.round}) but got "
                                   f"{msg.tag} from {msg.origin}"))
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
        if step.remote:  # reads a peer's registered buffer, or syncs: schedule/peer_read.py
            value = peer_read.value(self, st, step)
        elif step.base == "out":  # carries on the value an earlier step kept in the output
            value = self._read_output(st, step)
        elif not step.recvs or step.reduces:  # reads the input, before anything is written
            value = self._read(st, step, input_name(s, step.chunk))
        else:
            value = st.got[0].value
        for msg in st.got:
            st.known |= msg.known
            if step.reduces:
                value = self._combine(st, value, msg.value)
            self.conn(msg.sender, me).used -= 1
        if step.final:  # a combined value, never divided yet (_combine refuses divided operands)
            value = Sym(value.terms, value.order, post=True)
            if st.slice == 0:
                self.finals.append((st.round, me, st.index, step, value))
        if step.copies:
            self._write(st, output_cell(s, step.chunk), value)
        if step.writes:  # into peers' outputs: schedule/peer_read.py
            peer_read.write(self, st, step, value)
        known = frozenset(st.known)
        for b in step.dst:
            msg = _Msg((st.round, step.chunk, st.slice), value, known, me, st.where())
            self.conn(me, b).queue.append(msg)
            self.messages += 1
        st.got, st.acquired = [], 0
        st.slice += 1
        if st.slice == self.slices:
            st.slice, st.index = 0, st.index + 1
            if st.index == len(s.steps):
                self._end_round(st)
                self._start_round(st)

    def _read(self, st: _Rank, step: Step, name: int) -> Sym:
        me = st.sched.rank
        if self.racy:
            peer_read.touch(self, st, peer_read.input_place(st.round, me, name), "read", "in")
        hit = self.overwritten.get((st.round, me, name, st.slice))
        if hit is not None:
            wrote, v = hit
            self._fault(READ_AFTER_WRITE, st, f"rank {me} step {st.index} {step} reads its input chunk "
                        f"{name} after {wrote} wrote {v} into the same "
                        f"memory: in place it would use that instead of x{me}[{name}]", IN_PLACE)
        return Sym.leaf(me, name)  # the out-of-place value; the in-place one is refused above

    def _read_output(self, st: _Rank, step: Step) -> Sym:
        me, cell = st.sched.rank, output_cell(st.sched, step.chunk)
        if self.racy:
            peer_read.touch(self, st, peer_read.output_place(self, st.round, me, cell), "read", "out")
        value = self.kept.get((st.round, me, cell, st.slice))
        if value is None:
            self._stop(Failure(MALFORMED, me, st.index, step.chunk, f"{st.where()} carries on its output "
                               f"chunk {step.chunk} (base=out), but no earlier step of rank {me} wrote it "
                               f"this round: it would start from whatever the buffer held"))
        return value

    def _write(self, st: _Rank, cell: int, value: Sym) -> None:
        me = st.sched.rank
        if self.racy:
            peer_read.touch(self, st, peer_read.output_place(self, st.round, me, cell), "write", "out")
        self.store(st, me, cell, value)

    def store(self, st: _Rank, owner: int, cell: int, value: Sym) -> None:
        """Rank ``owner``'s output cell gets ``value`` from st's current step (st is the owner, or a
        peer writing into its buffer); in place, the input chunk under it changes with it."""
        writer = st.sched.rank
        self.outputs[st.round][owner][cell] = value
        if writer == owner:   # what a later base=out step of the owner starts from, slice by slice
            self.kept[st.round, owner, cell, st.slice] = value
        else:
            self.kept.pop((st.round, owner, cell, st.slice), None)
        # the owner's step that wrote it (None: a peer's write_copy, a step of another schedule)
        self.writers[st.round, owner, cell] = st.index if writer == owner else None
        name = self.alias[owner].get(cell)
        if name is not None:
            key = (st.round, owner, name, st.slice)
            if value == Sym.leaf(owner, name):
                self.overwritten.pop(key, None)  # its own input written back: nothing changes
            else:
                by = f"step {st.index} {st.sched.steps[st.index]}"
                self.overwritten[key] = (by if writer == owner else f"rank {writer}'s {by}", value)

    def _combine(self, st: _Rank, a: Sym, b: Sym) -> Sym:
        dup = sorted(set(a.terms) & set(b.terms))
        if dup:
            self._fault(TWICE, st, f"{st.where()}: contribution(s) {dup} counted twice when combining "
                                   f"{a} with {b}")
        if a.post or b.post:
            self._fault(POST_OP, st, f"{st.where()}: reduces {a} with {b}, but one of them already had "
                                     f"the op's post-processing (AVG's division) applied by a final step")
        # duplicates stay in the terms, so the outputs show them too
        return Sym(tuple(sorted(a.terms + b.terms)), (a.order, b.order))

    def _deadlock(self) -> None:
        lines, first = [], None
        for st in self.ranks:
            if st.done:
                lines.append(f"rank {st.sched.rank}: finished")
                continue
            step, me = st.sched.steps[st.index], st.sched.rank
            first = first or st
            if step.remote:
                wait = peer_read.waiting(self, st, step)[1]
            elif len(st.got) < len(step.src):
                peer = step.src[len(st.got)]
                wait = f"waits for a slice from rank {peer} (FIFO {peer}->{me} is empty)"
                if self.ranks[peer].done:
                    self._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} waits for a "
                                       f"slice from rank {peer}, which finished its schedule without "
                                       f"sending it"))
            else:
                peer = step.dst[st.acquired]
                c = self.conn(me, peer)
                wait = (f"waits for a free slot on FIFO {me}->{peer} ({len(c.queue)} of {self.nslots} "
                        f"slots posted and not yet taken, {c.used - len(c.queue)} held or acquired)")
            lines.append(f"{st.where()}: {wait}")
        head = f"deadlock with {fifo(self.nslots, self.slices)}:\n  "
        self._stop(Failure(DEADLOCK, first.sched.rank, first.index, first.sched.steps[first.index].chunk,
                           head + "\n  ".join(lines)))


def simulate(schedules: list[Schedule], *, nslots: int = 2, slices: int = 1, rounds: int = 2,
             root: int | None = None, in_place: bool = False) -> Result:
    """Run every rank's schedule for ``rounds`` rounds over FIFOs of ``nslots`` slots,
    each step moving ``slices`` slices. ``in_place``: model each rank's output as sharing
    memory with its input (spec.aliases) and record reads of overwritten input as faults.
    ``root`` is accepted for symmetry with check()."""
    if nslots < 1 or slices < 1 or rounds < 1:
        raise ValueError(f"need nslots, slices, rounds >= 1, got {nslots}, {slices}, {rounds}")
    _validate(schedules)
    _check_pairing(schedules)
    sim = _Sim(schedules, nslots, slices, rounds, in_place)
    sim.run()
    return Result(sim.outputs[0], sim.messages, sim.outputs, sim.finals, sim.knowledge, sim.faults,
                  sim.writers)


def check(collective: str, schedules: list[Schedule], root: int | None = None, **kw) -> Result:
    """simulate() the schedules and check the result against ``collective``'s meaning (spec.SPECS)
    in every buffer form the API allows: out of place, and in place with the input and output
    sharing memory. Every final step (where AVG divides) must also see the complete reduction.
    Raises ScheduleError listing every Failure found."""
    sp = spec(collective)
    if sp.rooted and root is None:
        raise ValueError(f"check({collective!r}) needs the root")
    for r, s in enumerate(schedules):
        if isinstance(s, Schedule) and s.collective != collective:
            raise ScheduleError([Failure(MALFORMED, r, None, None, f"rank {s.rank}'s schedule is for "
                                         f"{s.collective}, not {collective}")])
    wrong_shape = layout_failures(collective, schedules)
    if wrong_shape:
        raise ScheduleError(wrong_shape)
    res = simulate(schedules, in_place=IN_PLACE in sp.forms, **kw)
    failures = list(res.faults)
    failures += postcondition(collective, res, schedules, root)
    if failures:
        raise ScheduleError(failures)
    return res
