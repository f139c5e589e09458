"""The shortest deadlock counterexample: which slices must move before ranks wait for each other forever.

The simulator's system is deterministic in the Kahn sense: a FIFO is filled only by its
sender and drained only by its receiver, so every run reaches the same final state, and a
set of ranks that waits on itself (each for a slice or a free slot that only another rank of
the set can provide) stays stuck. Stuck sets therefore sit at the same positions in every run,
and a shortest run that reaches one is the causal past of their positions: the events of
those ranks plus, transitively, the events that posted what they took and that freed the
slots they acquired. ``TracingSim`` records each event's causes and, at a deadlock, returns
that past for the wait-for cycle whose past is smallest.
"""
from __future__ import annotations

from collections import defaultdict

from . import peer_read
from .faults import DEADLOCK, UNMATCHED, Failure, ScheduleError
from .simulate import _Sim, fifo
from .spec import output_cell


class DeadlockError(ScheduleError):
    """A deadlock, with ``trace``: the shortest list of events that leads to it, then the waits.
    Its failures are the value faults met before it, then one DEADLOCK naming the first stuck
    rank of the cycle."""

    def __init__(self, failure: Failure, trace: list[str], cycle: list[int], before=()):
        super().__init__(list(before) + [failure])
        self.trace, self.cycle = trace, cycle

    def __str__(self) -> str:  # the trace alone, as deadlock() has always returned it
        return self.failures[-1].detail


class TracingSim(_Sim):
    def __init__(self, schedules, nslots, slices, rounds, in_place=False):
        self.events: list[tuple[str, set[int]]] = []  # (description, causes)
        self.last: dict[int, int] = {}                 # rank -> its latest event
        self.acquires = defaultdict(int)               # (a, b) -> slots acquired so far
        self.releases = defaultdict(list)              # (a, b) -> events that released a slot
        self.values: dict = {}                         # (round, rank, out chunk, slice) -> Sym
        super().__init__(schedules, nslots, slices, rounds, in_place)

    def _compute(self, st, step):
        me, eid = st.sched.rank, len(self.events)
        causes = {self.last[me]} if me in self.last else set()
        causes |= {m.event for m in st.got}
        for b in step.dst:
            causes |= self._slot_cause(me, b)
        for m in st.got:
            self.releases[m.sender, me].append(eid)
        where = f"rank {me} round {st.round} step {st.index} {step} slice {st.slice}"
        rd, sl, s = st.round, st.slice, st.sched
        super()._compute(st, step)
        for b in step.dst:
            self.conn(me, b).queue[-1].event = eid
        if step.copies:
            out = output_cell(s, step.chunk)
            self.values[rd, me, out, sl] = self.outputs[rd][me][out]
        if step.writes:   # into the peers' outputs (write_copy, write_out_copy)
            for q in step.remote:
                out = output_cell(self.ranks[q].sched, step.chunk)
                self.values[rd, q, out, sl] = self.outputs[rd][q][out]
        verb = []
        if step.src:
            verb.append(f"takes a slice from {list(step.src)}")
        if step.dst:
            verb.append(f"posts to {list(step.dst)}")
        self.events.append((f"{where}: {', '.join(verb) or 'local copy'}", causes))
        self.last[me] = eid

    def _slot_cause(self, a, b) -> set[int]:
        """The k-th slot acquired on a->b is free only after the receiver released k - nslots."""
        self.acquires[a, b] += 1
        k = self.acquires[a, b] - self.nslots
        return {self.releases[a, b][k - 1]} if k > 0 else set()

    def _deadlock(self) -> None:
        waits = {}
        for st in self.ranks:
            if st.done:
                continue
            step, me = st.sched.steps[st.index], st.sched.rank
            if step.remote:  # a read of a registered buffer, or a sync (schedule/peer_read.py)
                waits[me] = peer_read.waiting(self, st, step)
            elif len(st.got) < len(step.src):
                peer = step.src[len(st.got)]
                if self.ranks[peer].done:
                    self._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} waits for a "
                                       f"slice from rank {peer}, which finished its schedule without "
                                       f"sending it"))
                waits[me] = (peer, f"waits for a slice from rank {peer} (FIFO {peer}->{me} is empty)")
            else:
                peer = step.dst[st.acquired]
                c = self.conn(me, peer)
                waits[me] = (peer, f"waits for a free slot on FIFO {me}->{peer} ({len(c.queue)} of "
                                   f"{self.nslots} slots posted, not yet taken)")
        best = None
        for cycle in _cycles({r: p for r, (p, _) in waits.items()}):
            past = self._past(cycle)
            if best is None or len(past) < len(best[1]):
                best = (cycle, past)
        cycle, past = best
        trace = [f"{i + 1:3d}. {self.events[e][0]}" for i, e in enumerate(sorted(past))]
        trace += [f"  => {self.ranks[r].where()}: {waits[r][1]}" for r in cycle]
        head = (f"deadlock with {fifo(self.nslots, self.slices)}: ranks {cycle} wait for "
                f"each other; the shortest run into it has {len(past)} events:\n  ")
        first = self.ranks[cycle[0]]
        failure = Failure(DEADLOCK, cycle[0], first.index, first.sched.steps[first.index].chunk,
                          head + "\n  ".join(trace))
        raise DeadlockError(failure, trace, cycle, self.faults)

    def _past(self, cycle) -> set[int]:
        todo = [self.last[r] for r in cycle if r in self.last]
        for r in cycle:  # what a stuck rank holds (taken slices, acquired slots) is part of its state
            st = self.ranks[r]
            todo += [m.event for m in st.got]
            step = st.sched.steps[st.index]
            for b in step.dst[:st.acquired]:
                k = self.acquires[r, b] + 1 - self.nslots
                todo += [self.releases[r, b][k - 1]] if k > 0 else []
        past: set[int] = set()
        while todo:
            e = todo.pop()
            if e not in past:
                past.add(e)
                todo.extend(self.events[e][1])
        return past


def _cycles(nxt: dict[int, int]) -> list[list[int]]:
    """Cycles of a graph where every node has at most one successor."""
    seen, cycles = set(), []
    for start in nxt:
        path, r = [], start
        while r in nxt and r not in seen:
            seen.add(r)
            path.append(r)
            r = nxt[r]
        if r in path:
            cycles.append(path[path.index(r):])
    return cycles
