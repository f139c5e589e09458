"""verify(): everything that can be proved about a collective's schedules without running them.

1. The postcondition: every rank ends with exactly the contributions the collective promises
   (simulate.check with FIFOs too large to matter, several rounds, several slices a step).
2. The reduction order of every output element: which chunk of which round the executor puts
   it in (the same cut as step.chunk_span, which the executor uses for a given count, item size and FIFO), and the
   order that chunk's contributions were combined in; whether all ranks hold the same order
   (MPI's rule that all ranks get identical results), exactly or up to swapping the two
   operands of one operation (a + b == b + a bit for bit in IEEE arithmetic, so results
   still agree); and a determinism certificate: whether an element's order can change with
   the message size or the FIFO's slot size (it can iff two chunks are reduced in different
   orders, since those move which chunk an element falls in), with a concrete witness.
3. Deadlock with finite slots: for each FIFO shape the executor can use (nslots, and the
   slices a full chunk takes, nslots // 2, or 1 for a small message), with the shortest
   counterexample (schedule/trace.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .simulate import ScheduleError, Sym, _check_pairing, _expected, _validate, check
from .step import OWN, SPLIT, Schedule, chunk_span
from .trace import DeadlockError, TracingSim

REDUCING = ("all_reduce", "reduce_scatter", "reduce")
BIG = 1 << 30                                 # slots: a FIFO that never fills
# (nslots, slices a step moves) the executor can meet: full chunks (nslots // 2 slices) and a
# small message (1 slice). Not nslots = 1: a step holds its incoming slot until it has an
# outgoing one, so with one slot every ring deadlocks; init() refuses RINGCOMM_NSLOTS < 2.
FIFOS = ((2, 1), (4, 2), (8, 4), (8, 1))


@dataclass
class Report:
    collective: str
    algo: str
    world_size: int
    count: int
    root: int | None
    postcondition: str | None = None           # None: holds; else what is wrong
    orders: list = field(default_factory=list)  # [(start, stop, order)] of the checked rank's output
    rank_identical: bool = True                # every rank combined every element in the same order
    identical_up_to_commutation: bool = True   # ... or differ only by swapping operands of one op
    rank_note: str = ""
    size_independent: bool = True             # the determinism certificate
    witness: str = ""
    deadlocks: dict = field(default_factory=dict)  # (nslots, slices) -> None or the counterexample

    @property
    def deadlock_free(self) -> bool:
        return not any(self.deadlocks.values())

    @property
    def ok(self) -> bool:
        """Correct and deadlock-free at every FIFO shape tried (orders are reported, not judged)."""
        return self.postcondition is None and self.deadlock_free

    def summary(self) -> str:
        head = (f"{self.collective}/{self.algo} on {self.world_size} ranks, count {self.count}"
                + (f", root {self.root}" if self.root is not None else ""))
        lines = [head, f"  postcondition: {'holds' if self.postcondition is None else self.postcondition}"]
        if self.collective in REDUCING and self.postcondition is None:
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
                     fifos=FIFOS) -> Report:
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    rep = Report(collective, algo, len(scheds), count, root)
    try:
        _validate(scheds)
        _check_pairing(scheds)
        check(collective, scheds, root=root, nslots=BIG, slices=3, rounds=3)
    except ScheduleError as e:
        rep.postcondition = str(e)
    for shape in fifos:
        rep.deadlocks[shape] = deadlock(scheds, *shape) if rep.postcondition is None else None
    if rep.postcondition is None and collective in REDUCING:
        _orders(rep, scheds, root, itemsize, buffsize, nslots)
    return rep


def deadlock(scheds: list[Schedule], nslots: int, slices: int) -> str | None:
    """None, or the shortest run into a deadlock with this FIFO shape, as text."""
    sim = TracingSim(scheds, nslots, slices, 2)
    try:
        sim.run()
    except DeadlockError as e:
        return str(e)
    return None


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
        for c, _ in _expected(collective, n, nchunks, r, root):
            vals = {sim.values[0, r, c, s] for s in range(2)}
            if len(vals) != 1:  # every slice of a chunk must be combined alike
                raise ScheduleError(f"rank {r} chunk {c}: slices combined differently: {vals}")
            cells[r, c] = vals.pop()
    return cells


def _orders(rep, scheds, root, itemsize, buffsize, nslots):
    cells = _cells(rep.collective, scheds, root)
    n, s0 = len(scheds), scheds[0]
    me = root if rep.collective == "reduce" else 0
    mine = {c: v for (r, c), v in cells.items() if r == me}
    rep.orders = _ranges(mine, s0, rep.count, itemsize, buffsize, nslots)
    if rep.collective == "all_reduce":
        for c in range(s0.nchunks):
            exact = {canonical(cells[r, c].order) for r in range(n)}
            loose = {commuted(cells[r, c].order) for r in range(n)}
            if len(exact) > 1 and rep.rank_identical:
                rep.rank_identical = False
                rep.rank_note = f"chunk {c}: " + "; ".join(
                    f"rank {r}: {canonical(cells[r, c].order)}" for r in range(min(n, 3)))
            rep.identical_up_to_commutation &= len(loose) == 1
    distinct = {}
    for (r, c), v in sorted(cells.items()):
        distinct.setdefault(r, {}).setdefault(canonical(v.order), c)
    rep.size_independent = all(len(d) == 1 for d in distinct.values())
    if not rep.size_independent:
        rep.witness = _witness(mine, s0, itemsize, buffsize, nslots)


def element_chunks(s: Schedule, count: int, itemsize: int, buffsize: int, nslots: int):
    """[(start, stop, chunk)] of the output range, as the executor cuts it (init.py's slot size)."""
    slot_bytes = max(64, buffsize // nslots // 64 * 64)
    chunk_elems = max(1, slot_bytes // itemsize) * max(1, nslots // 2)
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


def _ranges(mine: dict, s: Schedule, count, itemsize, buffsize, nslots):
    out = []
    for a, b, c in element_chunks(s, count, itemsize, buffsize, nslots):
        order = _show(mine[c]) if c in mine else "-"
        if out and out[-1][1] == a and out[-1][2] == order:
            out[-1] = (out[-1][0], b, order)
        else:
            out.append((a, b, order))
    return out


def _show(v: Sym) -> str:
    return canonical(v.order) + (" then post-op" if v.post else "")


def _witness(mine, s, itemsize, buffsize, nslots) -> str:
    """An element whose order differs between two message sizes: element e of a small count."""
    for e in range(1, 64):
        seen = {}
        for count in range(e + 1, e + 2 + 4 * s.nchunks):
            for a, b, c in element_chunks(s, count, itemsize, buffsize, nslots):
                if a <= e < b and c in mine:
                    seen.setdefault(canonical(mine[c].order), (count, c))
        if len(seen) > 1:
            (o1, (n1, c1)), (o2, (n2, c2)) = list(seen.items())[:2]
            return (f"element {e} is in chunk {c1} with count {n1}, combined as {o1}, but in chunk "
                    f"{c2} with count {n2}, combined as {o2}")
    return "two chunks are combined in different orders"
