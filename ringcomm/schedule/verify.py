"""verify(): everything that can be proved about a collective's schedules without running them.

1. The postcondition: every rank ends with exactly the contributions the collective promises,
   in every buffer form the API allows (out of place, and in place with input and output in one
   memory: a step that reads input already overwritten as output is refused), checked by
   simulate.check with FIFOs too large to matter, several rounds, several slices a step. What is
   wrong comes as ``Report.failures``: faults.Failure records with a kind (faults.KINDS), the
   rank, step and chunk, and a sentence. A schedule that deadlocks even with unbounded FIFOs
   fails here with the shortest trace.
2. The reduction order of every output element: which chunk of which round the executor puts
   it in (the same cut as step.chunk_span, which the executor uses for a given count, item size
   and FIFO), and the order that chunk's contributions were combined in; whether all ranks hold
   the same order (MPI's rule that all ranks get identical results), exactly or up to swapping
   the two operands of one operation (a + b == b + a bit for bit in IEEE arithmetic, so results
   still agree), naming the ranks that disagree; and a determinism certificate: whether an
   element's order can change with the message size or the FIFO's slot size (it can iff two
   chunks are reduced in different orders, since those move which chunk an element falls in),
   with a concrete witness.
3. Deadlock with finite slots, for each FIFO shape (nslots, slices a step moves) of
   fifo_shapes(nslots), with the shortest counterexample (schedule/trace.py). Every shape is
   checked whenever the schedules are well formed and matched, whatever the postcondition says;
   a shape that could not be checked says "not checked: why", never "no deadlock".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .faults import DEADLOCK, Failure, ScheduleError
from .simulate import UNBOUNDED, Sym, _check_pairing, _validate, check
from .spec import SPECS, layout_failures, spec
from .step import OWN, SPLIT, Schedule, chunk_span
from .trace import DeadlockError, TracingSim

NATIVE_SLICE = 256 * 1024   # RINGCOMM_SLICE's default (ringcomm.assemble.DEFAULT_SLICE; a test holds them equal)

REDUCING = tuple(c for c, sp in SPECS.items() if sp.reduces)  # orders are reported for these
BIG = UNBOUNDED                               # slots: a FIFO that never fills
NOT_CHECKED = "not checked"


def fifo_shapes(nslots: int = 8) -> tuple[tuple[int, int], ...]:
    """The (nslots, slices a step moves) the executor meets with RINGCOMM_NSLOTS=nslots: a step
    moves between 1 slice (a small message) and nslots // 2 (a full chunk; executor.py), so all
    of those; and 2 slots with 1 slice, the smallest setting init() accepts. ``nslots=1``, which
    init() refuses, can still be asked of verify (what would happen): with 1 slot every ring
    deadlocks, since a step holds its incoming slot until it has an outgoing one.

    Each shape has every step move the same number of slices. A round whose chunks move fewer
    (SPLIT chunks differ by one element, the last round is shorter, an empty chunk moves none)
    is covered by the shape of its largest: dropping matched slices from a run that finishes
    leaves a run that finishes, since every wait left is for a slice posted, or a slot freed,
    no later than before."""
    if not isinstance(nslots, int) or isinstance(nslots, bool) or nslots < 1:
        raise ValueError(f"nslots must be an int >= 1 (RINGCOMM_NSLOTS), got {nslots!r}")
    shapes = [(2, 1)] + [(nslots, s) for s in range(1, max(1, nslots // 2) + 1)]
    return tuple(dict.fromkeys(shapes))


FIFOS = fifo_shapes(8)  # the default: (2, 1), (8, 1), (8, 2), (8, 3), (8, 4)


@dataclass
class Report:
    collective: str
    algo: str
    world_size: int
    count: int
    root: int | None
    # faults.Failure, the first found first: the postcondition's (fifo None), then one DEADLOCK
    # for each FIFO shape that deadlocks only at that size (fifo = the shape)
    failures: list = field(default_factory=list)
    orders: list = field(default_factory=list)    # [(start, stop, order)] of the checked rank's output
    rank_identical: bool = True                  # every rank combined every element in the same order
    identical_up_to_commutation: bool = True     # ... or differ only by swapping operands of one op
    rank_note: str = ""                          # where ranks differ: which ranks hold which order
    size_independent: bool = True                # the determinism certificate
    witness: str = ""
    # (nslots, slices) -> None (checked: no deadlock), the shortest trace, or "not checked: why"
    deadlocks: dict = field(default_factory=dict)

    @property
    def postcondition(self) -> str | None:
        """None where the postcondition holds, else what is wrong, one failure a line."""
        found = [f for f in self.failures if f.fifo is None]
        return "\n".join(str(f) for f in found) if found else None

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.failures}

    @property
    def deadlock_free(self) -> bool | None:
        """True: no deadlock at any shape, every shape checked. False: a deadlock somewhere
        (or even with unbounded FIFOs). None: nothing found, but some shape was not checked."""
        found = [d for d in self.deadlocks.values() if d and not d.startswith(NOT_CHECKED)]
        if DEADLOCK in self.kinds or found:
            return False
        if not self.deadlocks or any(d for d in self.deadlocks.values()):
            return None
        return True

    @property
    def ok(self) -> bool:
        """Correct in every form and deadlock-free at every FIFO shape (orders are reported, not judged)."""
        return not self.failures and self.deadlock_free is True

    def summary(self) -> str:
        head = (f"{self.collective}/{self.algo} on {self.world_size} ranks, count {self.count}"
                + (f", root {self.root}" if self.root is not None else ""))
        found = [f for f in self.failures if f.fifo is None]
        lines = [head, "  postcondition: " + (f"FAILS ({len(found)} failure(s))" if found else "holds")]
        lines += [f"    {str(f).splitlines()[0]}" for f in found[:6]]
        if self.collective in REDUCING and not found:
            shown = self.orders[:4]
            lines += [f"  elements [{a}, {b}): {o}" for a, b, o in shown]
            if len(self.orders) > len(shown):
                lines.append(f"  ... {len(self.orders)} ranges with their own order in all")
            same = ("identical on every rank" if self.rank_identical else
                    "identical up to operand swaps (bitwise equal results)"
                    if self.identical_up_to_commutation else "DIFFERENT between ranks")
            lines.append(f"  reduction order: {same}{': ' + self.rank_note if self.rank_note else ''}")
            lines.append("  determinism: " + ("the same for every message size and slicing"
                                              if self.size_independent else f"depends on size: {self.witness}"))
        for (nslots, slices), dl in self.deadlocks.items():
            lines.append(f"  {nslots} slots, {slices} slice(s) a step: "
                         + ("no deadlock" if dl is None else dl.splitlines()[0]))
        return "\n".join(lines)


def verify_schedules(collective: str, scheds: list[Schedule], count: int, *, root=None, algo="?",
                     itemsize: int = 4, buffsize: int = 4 << 20, nslots: int = 8,
                     slice_bytes: int | None = NATIVE_SLICE, fifos=None) -> Report:
    """Verify one rank's Schedule per rank (index = rank). ``nslots`` is RINGCOMM_NSLOTS: it sets
    the executor's cut of ``count`` elements (for the orders, with ``slice_bytes``, RINGCOMM_SLICE:
    None for RINGCOMM_ENGINE=python) and the FIFO shapes checked (fifo_shapes(nslots), unless
    ``fifos`` lists other (nslots, slices) pairs)."""
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    shapes = fifo_shapes(nslots) if fifos is None else tuple(fifos)
    if spec(collective).rooted and root is None:
        root = 0
    rep = Report(collective, algo, len(scheds), count, root)
    try:
        _validate(scheds)
        wrong_shape = layout_failures(collective, scheds)
        if wrong_shape:
            raise ScheduleError(wrong_shape)
        _check_pairing(scheds)
    except ScheduleError as e:  # nothing can run: every shape is unknown
        rep.failures = e.failures
        rep.deadlocks = {shape: f"{NOT_CHECKED}: the schedules are not a runnable set "
                                f"({e.failures[0].kind})" for shape in shapes}
        return rep
    try:
        check(collective, scheds, root=root, nslots=BIG, slices=3, rounds=3)
    except ScheduleError as e:
        rep.failures = [_with_trace(f, scheds) for f in e.failures]
    everywhere = DEADLOCK in rep.kinds  # stuck even unbounded: already reported, once
    for shape in shapes:
        rep.deadlocks[shape], f = _deadlock(scheds, *shape)
        if f is not None and not everywhere:
            rep.failures.append(dataclasses.replace(f, fifo=shape))
    if not rep.postcondition and collective in REDUCING:
        _orders(rep, scheds, root, itemsize, buffsize, nslots, slice_bytes)
    return rep


def _with_trace(f: Failure, scheds) -> Failure:
    """A deadlock even with unbounded FIFOs: at every size. Give it the shortest trace."""
    if f.kind != DEADLOCK:
        return f
    trace = deadlock(scheds, BIG, 1) or f.detail
    return Failure(DEADLOCK, f.rank, f.step, f.chunk,
                   "deadlocks at every FIFO size, even unbounded: " + trace, f.form)


def deadlock(scheds: list[Schedule], nslots: int, slices: int) -> str | None:
    """None, or the shortest run into a deadlock with this FIFO shape, as text; "not checked:
    why" where the run stops on something else first (a message no one receives)."""
    return _deadlock(scheds, nslots, slices)[0]


def _deadlock(scheds, nslots, slices) -> tuple[str | None, Failure | None]:
    sim = TracingSim(scheds, nslots, slices, 2)
    try:
        sim.run()
    except DeadlockError as e:
        return str(e), e.failures[-1]
    except ScheduleError as e:
        return f"{NOT_CHECKED}: the run stopped first on {e.failures[-1]}", None
    return None, None


def canonical(order) -> str:
    """The order with chunk indices dropped (x3 is rank 3's contribution)."""
    if isinstance(order[0], int):
        return f"x{order[0]}"
    return "(" + " + ".join(canonical(o) for o in order) + ")"


def commuted(order) -> str:
    """The order up to swapping the two operands of each operation."""
    if isinstance(order[0], int):
        return f"x{order[0]}"
    a, b = sorted(commuted(o) for o in order)
    return f"({a} + {b})"


def _cells(collective, scheds, root):
    """{(rank, output chunk): Sym} of every cell the postcondition names, from one simulation."""
    sim = TracingSim(scheds, BIG, 2, 1)
    sim.run()
    n, nchunks = len(scheds), scheds[0].nchunks
    cells = {}
    for r in range(n):
        for c, _ in spec(collective).expected(n, nchunks, r, root):
            vals = {sim.values[0, r, c, s] for s in range(2)}
            if len(vals) != 1:  # every slice of a chunk must be combined alike
                raise ScheduleError(f"rank {r} chunk {c}: slices combined differently: {vals}")
            cells[r, c] = vals.pop()
    return cells


def _orders(rep, scheds, root, itemsize, buffsize, nslots, slice_bytes):
    cells = _cells(rep.collective, scheds, root)
    n, s0 = len(scheds), scheds[0]
    me = root if rep.collective == "reduce" else 0
    mine = {c: v for (r, c), v in cells.items() if r == me}
    rep.orders = _ranges(mine, s0, rep.count, itemsize, buffsize, nslots, slice_bytes)
    if rep.collective == "all_reduce":
        for c in range(s0.nchunks):
            exact = {canonical(cells[r, c].order) for r in range(n)}
            loose = {commuted(cells[r, c].order) for r in range(n)}
            if len(exact) > 1 and rep.rank_identical:
                rep.rank_identical = False
                rep.rank_note = f"chunk {c}: " + _disagreement({r: canonical(cells[r, c].order)
                                                                 for r in range(n)})
            rep.identical_up_to_commutation &= len(loose) == 1
    distinct = {}
    for (r, c), v in sorted(cells.items()):
        distinct.setdefault(r, {}).setdefault(canonical(v.order), c)
    rep.size_independent = all(len(d) == 1 for d in distinct.values())
    if not rep.size_independent:
        rep.witness = _witness(mine, s0, itemsize, buffsize, nslots, slice_bytes)


def element_chunks(s: Schedule, count: int, itemsize: int, buffsize: int, nslots: int,
                   slice_bytes: int | None = NATIVE_SLICE):
    """[(start, stop, chunk)] of the output range, as the executor cuts it: slices of
    ``slice_bytes`` (RINGCOMM_SLICE; the native engine's setting) or, with ``slice_bytes=None``
    (RINGCOMM_ENGINE=python), whole slots of the FIFO's size (assemble.py's slot size)."""
    slot_bytes = max(64, buffsize // nslots // 64 * 64)
    cut = min(slice_bytes or slot_bytes, slot_bytes)
    chunk_elems = max(1, cut // itemsize) * max(1, nslots // 2)
    round_elems = chunk_elems * (s.nchunks if s.in_layout == SPLIT else 1)
    spans = []
    for a in range(0, count, round_elems):
        b = min(a + round_elems, count)
        for c in range(s.nchunks):
            off, length = chunk_span(s.out_layout, s.nchunks, c, a, b, count)
            if length and s.out_layout == SPLIT:
                spans.append((off, off + length, c))
        if s.out_layout == OWN:
            spans.append((a, b, s.rank % s.nchunks))
    return sorted(spans)


def _ranges(mine: dict, s: Schedule, count, itemsize, buffsize, nslots, slice_bytes):
    out = []
    for a, b, c in element_chunks(s, count, itemsize, buffsize, nslots, slice_bytes):
        order = _show(mine[c]) if c in mine else "-"
        if out and out[-1][1] == a and out[-1][2] == order:
            out[-1] = (out[-1][0], b, order)
        else:
            out.append((a, b, order))
    return out


def _show(v: Sym) -> str:
    return canonical(v.order) + (" then post-op" if v.post else "")


def _witness(mine, s, itemsize, buffsize, nslots, slice_bytes) -> str:
    """An element whose order differs between two message sizes: element e of a small count."""
    for e in range(1, 64):
        seen = {}
        for count in range(e + 1, e + 2 + 4 * s.nchunks):
            for a, b, c in element_chunks(s, count, itemsize, buffsize, nslots, slice_bytes):
                if a <= e < b and c in mine:
                    seen.setdefault(canonical(mine[c].order), (count, c))
        if len(seen) > 1:
            (o1, (n1, c1)), (o2, (n2, c2)) = list(seen.items())[:2]
            return (f"element {e} is in chunk {c1} with count {n1}, combined as {o1}, but in chunk "
                    f"{c2} with count {n2}, combined as {o2}")
    return "two chunks are combined in different orders"


def _disagreement(orders: dict[int, str], shown: int = 4) -> str:
    """Which ranks hold which order, every rank named: "ranks 0-2, 4: A; rank 3: B"."""
    groups: dict[str, list[int]] = {}
    for r, o in sorted(orders.items()):
        groups.setdefault(o, []).append(r)
    parts = [f"{_ranks(rs)}: {o}" for o, rs in groups.items()]
    if len(parts) > shown + 1:
        rest = sorted(r for rs in list(groups.values())[shown:] for r in rs)
        parts = parts[:shown] + [f"{_ranks(rest)}: {len(parts) - shown} other orders"]
    return "; ".join(parts)


def _ranks(rs: list[int]) -> str:
    runs, start = [], rs[0]
    for a, b in zip(rs, rs[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(runs)
