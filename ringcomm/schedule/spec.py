"""What each collective promises, as one table entry: the contributions every rank's output
must hold, and the buffer forms the API lets a caller use (out of place, in place).

Names: rank r's input chunk c is the contribution ``(r, c)``; under the OWN input layout it is
``(r, r)`` (every chunk index reads the same memory, the rank's own block). Under the OWN output
layout a rank has one output cell, kept at index ``r % nchunks``.

In place, a rank's input and output are one memory, and which input chunk an output cell
overwrites follows from the two layouts alone (``aliases``): the same chunk where both layouts
cut the same buffer (all_reduce's and reduce's ``out is buf``, broadcast); block ``r`` of the
BLOCK side where the other side is OWN (all_gather's ``buf`` is ``out``'s block r,
reduce_scatter's ``out`` is ``buf``'s block r; gather and scatter at the root likewise).

Adding a collective is one SPECS entry: its expected outputs, whether it reduces, whether it
has a root, and its forms (``forms=(OUT_OF_PLACE,)`` for one whose API has no in-place form);
the simulator and the verifier read nothing else (in-place aliasing comes from the layouts).
all_to_all, gather and scatter were added that way. all_to_all names the block rank s sends rank
d chunk ``s * n + d`` (the TO / FROM layouts of step.py), so rank r's input block for d is the
contribution ``(r, r * n + d)`` and rank d's output cell ``s * n + d`` must hold ``(s, s * n + d)``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

from .faults import CLOBBER, MALFORMED, MISPLACED, MISSING, POST_OP, TWICE, Failure
from .step import BLOCK, FROM, OWN, SPLIT, TO, Schedule
from .values import Result, Sym

OUT_OF_PLACE, IN_PLACE = "out of place", "in place"


@dataclass(frozen=True)
class Spec:
    # expected(n, nchunks, rank, root) -> [(output cell, contributions it must hold, sorted)]
    expected: Callable[[int, int, int, int | None], list]
    reduces: bool = False           # outputs are reductions: each needs a final (post-op) step
    rooted: bool = False
    forms: tuple[str, ...] = (OUT_OF_PLACE, IN_PLACE)
    # (input layout, output layout): how the API's buffers are cut into chunks (step.py). The
    # expected contributions and the in-place aliases mean something only under these, so a
    # schedule that declares others is refused (layout_failures), not checked against them.
    layouts: tuple[str, str] = (SPLIT, SPLIT)


def _full(n: int, c: int) -> tuple:
    return tuple((q, c) for q in range(n))


SPECS: dict[str, Spec] = {
    "all_reduce": Spec(lambda n, k, r, root: [(c, _full(n, c)) for c in range(k)], reduces=True),
    "reduce_scatter": Spec(lambda n, k, r, root: [(r % k, _full(n, r))], reduces=True, layouts=(BLOCK, OWN)),
    "reduce": Spec(lambda n, k, r, root: [(c, _full(n, c)) for c in range(k)] if r == root else [],
                   reduces=True, rooted=True),
    "all_gather": Spec(lambda n, k, r, root: [(c, ((c, c),)) for c in range(k)], layouts=(OWN, BLOCK)),
    # broadcast has only one buffer: the root's input is its output
    "broadcast": Spec(lambda n, k, r, root: [(c, ((root, c),)) for c in range(k)], rooted=True,
                      forms=(IN_PLACE,)),
    # no data: every rank must hear (even indirectly) from every other (simulate.check)
    "barrier": Spec(lambda n, k, r, root: [], forms=()),
    # chunk s * n + d: rank s's input block for d, as it was; out may not overlap buf
    "all_to_all": Spec(lambda n, k, r, root: [(s * n + r, ((s, s * n + r),)) for s in range(n)],
                       forms=(OUT_OF_PLACE,), layouts=(TO, FROM)),
    # in place on the root: gather's buf is out's block root, scatter's out is buf's block root
    "gather": Spec(lambda n, k, r, root: [(c, ((c, c),)) for c in range(k)] if r == root else [],
                   rooted=True, layouts=(OWN, BLOCK)),
    "scatter": Spec(lambda n, k, r, root: [(r % k, ((root, r),))], rooted=True, layouts=(BLOCK, OWN)),
}


def spec(collective: str) -> Spec:
    s = SPECS.get(collective)
    if s is None:
        raise ValueError(f"check() knows {tuple(SPECS)}, not {collective!r}")
    return s


def nchunks_needed(collective: str, n: int) -> int | None:
    """The chunk count a schedule of ``collective`` on ``n`` ranks must have; None: any (>= 1).
    A SPLIT buffer may be cut into any number of chunks; a BLOCK or OWN one has a block per rank
    (block r is rank r's), and all_to_all a block per (source, destination)."""
    ins, outs = spec(collective).layouts
    if ins == SPLIT and outs == SPLIT:
        return None
    return n * n if ins == TO else n


def layout_failures(collective: str, schedules) -> list[Failure]:
    """MALFORMED failures for schedules whose layouts or chunk count are not ``collective``'s.
    Relabelled layouts would make the expected contributions and the in-place aliases describe
    other memory than the API's buffers, so the check could certify a schedule that computes
    the wrong thing or reads past a buffer's end."""
    want, n = spec(collective).layouts, len(schedules)
    k = nchunks_needed(collective, n)
    out = []
    for r, s in enumerate(schedules):
        if not isinstance(s, Schedule):
            continue  # simulate's validation names it
        if (s.in_layout, s.out_layout) != want:
            out.append(Failure(MALFORMED, r, None, None, f"rank {r}'s {collective} schedule cuts its buffers "
                               f"as {s.in_layout} -> {s.out_layout}; {collective}'s API buffers are "
                               f"{want[0]} -> {want[1]} (schedule/step.py says what each means)"))
        elif k is not None and s.nchunks != k:
            out.append(Failure(MALFORMED, r, None, None, f"rank {r}'s {collective} schedule has {s.nchunks} "
                               f"chunks; under {want[0]} -> {want[1]} on {n} ranks it needs {k} "
                               f"(a block per {'(source, destination)' if k == n * n else 'rank'})"))
    return out


def input_name(s: Schedule, chunk: int) -> int:
    """The chunk index in the name of the input a step of chunk ``chunk`` reads. Under TO the
    memory is block ``chunk % n``, this rank's block for that destination: chunk r * n + d."""
    if s.in_layout == OWN:
        return s.rank
    if s.in_layout == TO:
        return s.rank * s.world_size + chunk % s.world_size
    return chunk


def output_cell(s: Schedule, chunk: int) -> int:
    """The output cell a copying step of chunk ``chunk`` writes. Under FROM the memory is block
    ``chunk // n``, where the block from that source lands: cell s * n + r."""
    if s.out_layout == OWN:
        return s.rank % s.nchunks
    if s.out_layout == FROM:
        return chunk // s.world_size * s.world_size + s.rank
    return chunk


def aliases(s: Schedule) -> dict[int, int]:
    """In place: {output cell: the input chunk name stored in the same memory}."""
    i, o, r, k = s.in_layout, s.out_layout, s.rank, s.nchunks
    if i == o and i in (SPLIT, BLOCK):
        return {c: c for c in range(k)}
    if (i, o) == (OWN, BLOCK):
        return {r: r} if r < k else {}
    if o == OWN and i in (BLOCK, OWN):
        return {r % k: r}
    return {}


def postcondition(collective, res: Result, schedules, root) -> list[Failure]:
    """The failures of the first round that has any: final steps, then every rank's outputs in
    every form; a fault that shows in more than one form is reported once, with form None."""
    sp, n = spec(collective), len(schedules)
    for rd in range(len(res.round_outputs)):
        if collective == "barrier":
            found = _barrier(res, rd, n)
        else:
            found = _finals(res, rd, n) if sp.reduces else []
            for form in sp.forms:
                found += _outputs(collective, res, rd, schedules, root, form)
        unique: dict = {}
        for f in found:
            key = (f.kind, f.rank, f.chunk)
            unique[key] = replace(unique[key], form=None) if key in unique else f
        if unique:
            return list(unique.values())
    return []


def _barrier(res, rd, n) -> list[Failure]:
    out = []
    for r, known in enumerate(res.knowledge[rd]):
        if known != frozenset(range(n)):
            missing = sorted(set(range(n)) - known)
            out.append(Failure(MISSING, r, None, None, f"barrier round {rd}: rank {r} finished without "
                                                       f"hearing (even indirectly) from rank(s) {missing}"))
    return out


def _finals(res, rd, n) -> list[Failure]:
    out = []
    for frd, r, i, step, v in res.finals:
        if frd == rd and v.ranks != frozenset(range(n)):
            out.append(Failure(MISSING, r, i, step.chunk, f"round {rd} rank {r} step {i} {step} is final "
                               f"(AVG divides there) but holds only {v}: missing rank(s) "
                               f"{sorted(set(range(n)) - v.ranks)}"))
    return out


def _outputs(collective, res, rd, schedules, root, form) -> list[Failure]:
    """Every rank's outputs in one form. In place an output cell never written still holds the
    input that shares its memory, and a write to a cell the collective leaves alone is a fault."""
    sp, n = spec(collective), len(schedules)
    out = []
    for r, s in enumerate(schedules):
        cells = res.round_outputs[rd][r]
        alias = aliases(s) if form == IN_PLACE else {}
        expected = dict(sp.expected(n, s.nchunks, r, root))
        for c, name in alias.items():
            v = cells[c]
            if c not in expected and v is not None and v != Sym.leaf(r, name):
                step = res.writers.get((rd, r, c))
                who = f"rank {r} step {step}" if step is not None else "a peer's write_copy"
                out.append(Failure(CLOBBER, r, step, c, f"{collective} round {rd}: {who} "
                                   f"writes {v} over rank {r}'s input x{r}[{name}], which {collective} "
                                   f"leaves alone on rank {r}", form))
        for c, terms in expected.items():
            v = cells[c]
            if v is None and c in alias:
                v = Sym.leaf(r, alias[c])
            out += _cell(collective, rd, r, c, v, terms, sp.reduces and n > 1, res.writers.get((rd, r, c)),
                         form if len(sp.forms) > 1 else None)
    return out


def _cell(collective, rd, r, c, v, terms, needs_post, step, form) -> list[Failure]:
    """What is wrong with one output cell: the most telling kind first."""
    head = f"{collective} round {rd}: rank {r} output chunk {c}"
    if v is None:
        return [Failure(MISSING, r, None, c, f"{head} is None (never written), expected contributions "
                                             f"{list(terms)}", form)]
    if v.terms != terms:
        have, want = Counter(v.terms), Counter(terms)
        twice = sorted(t for t, k in have.items() if k > 1)
        wrong = sorted(set(have) - set(want))
        missing = sorted(set(want) - set(have))
        kind = TWICE if twice else MISPLACED if wrong else MISSING
        why = (f"{twice} more than once" if twice else f"{wrong} that belong elsewhere" if wrong
               else f"none of {missing}")
        return [Failure(kind, r, step, c, f"{head} is {v}, expected contributions {list(terms)}: it "
                                          f"holds {why}", form)]
    if needs_post and not v.post:
        return [Failure(POST_OP, r, step, c, f"{head} = {v} never went through a final (reduce + copy) "
                                             f"step, so AVG would not divide", form)]
    return []
