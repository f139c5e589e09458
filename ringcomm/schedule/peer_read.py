"""What the simulator needs to run steps that read a peer's registered buffer (step.READS).

Kept apart from simulate.py, which calls in here at three points (validate, advance + value,
deadlock) for steps with ``remote`` peers; everything else of a read step (the final post-op,
the write into the output, its in-place bookkeeping) is simulate.py's own code.

The model, as ringcomm/read_engine.py runs it:

- A rank's input is readable once the rank has entered the round, and until it leaves it.
- ``sync`` with peers P: the j-th sync of rank r with p waits until p has reached its j-th sync
  with r (a barrier per pair; counts are kept for the whole run, rounds included).
- ``read_out_copy`` of rank q's output chunk c reads it as it was when q reached the sync that
  the reader has passed last with q: it must have been written by then, and not rewritten since
  (a write after that sync races with the read).
- In place (simulate's ``in_place``: spec.aliases says which output cell lies over which input
  chunk), a rank must not overwrite an input chunk that a peer reads in the same phase, nor
  before it (the peer would read the result, not the input): READ_AFTER_WRITE. Writing back a
  chunk's own input value (all_gather's own block) changes nothing and is allowed.
- Static rules (validate): the peers exist; read_reduce_copy combines this rank's own input with
  at least one peer's; every read of a peer (or write into it) is followed, later in the
  schedule, by a sync with that peer, so no rank leaves the call while another still reads its
  buffers or writes into them.
- ``write_copy`` puts this rank's input chunk straight into each target's output chunk, once the
  target has entered the round (``write_out_copy`` the same, from this rank's output chunk, which
  an earlier step of this rank must have written). The target does not see it happen, so nothing else may touch
  that chunk's memory (the target writing or reading it, in place its input under it, a third
  rank reading or writing it) unless syncs order the two. The check is a vector clock per rank,
  as a race detector keeps: a rank's epoch grows at each sync it arrives at, passing a sync with
  p merges p's clock as p arrived, and two accesses to one chunk are ordered when the later one's
  rank had seen the earlier one's epoch. Only schedules with a write step keep the access log
  (simulate's ``racy``); for reads alone the rules above are exact.
"""
from __future__ import annotations

from collections import defaultdict

from .faults import MALFORMED, RACE, READ_AFTER_WRITE, UNMATCHED, Failure, ScheduleError
from .spec import IN_PLACE, input_name, output_cell
from .values import Sym


class _State:
    """Per simulation: arrivals[r][p] = syncs of r with p reached so far; pending: the sync
    (round, step, slice) each rank has arrived at and not yet passed; seen[(q, p, j)]: q's
    outputs (round, [values]) when it reached its j-th sync with p; input_reads[(round, owner,
    reader, pair phase)]: the owner's input chunks the reader read in that phase. For the race
    check: clocks[r] (rank -> the latest epoch of it that r has seen; r's own is its current one),
    clock_at[(r, p, j)] (r's clock when it reached its j-th sync with p), log[place]: every
    access to a chunk's memory as (rank, epoch, what, region, where); and written_by[(round,
    owner, cell)]: (the peer whose write step last stored that output cell, the value it stored)."""

    def __init__(self):
        self.arrivals = defaultdict(lambda: defaultdict(int))
        self.pending = {}
        self.seen = {}
        self.input_reads = defaultdict(set)
        self.clocks = {}
        self.clock_at = {}
        self.log = defaultdict(list)
        self.written_by = {}


def _state(sim) -> _State:
    st = sim.__dict__.get("_peer_read")
    if st is None:
        st = sim.__dict__["_peer_read"] = _State()
    return st


def validate(schedules) -> None:
    """Raise ScheduleError (MALFORMED) for a read step that breaks a static rule."""
    n = len(schedules)
    for s in schedules:
        r = s.rank
        for i, st in enumerate(s.steps):
            if not st.remote:
                continue
            where = f"rank {r} step {i} {st}"
            combined = st.kind == "read_reduce_copy"
            bad = [p for p in st.remote if not 0 <= p < n or (p == r and not combined)]
            problem = None
            if bad or len(set(st.remote)) != len(st.remote):
                problem = f"peer out of range, repeated, or this rank itself (n={n})"
            elif combined and (r not in st.remote or len(st.remote) < 2):
                problem = (f"read_reduce_copy combines this rank's own input with its peers' inputs, "
                           f"in the order given: name rank {r} and at least one peer")
            elif st.kind != "sync":
                later = {p for x in s.steps[i + 1:] if x.kind == "sync" for p in x.remote}
                unsynced = sorted(p for p in st.remote if p != r and p not in later)
                if unsynced:
                    verb = "writes into" if st.writes else "reads"
                    problem = (f"no sync with rank(s) {unsynced} follows, so they could leave the call "
                               f"(and reuse their buffers) while this rank still {verb} them")
            if problem:
                raise ScheduleError([Failure(MALFORMED, r, i, st.chunk, f"{where}: {problem}")])


def advance(sim, st, step) -> bool:
    """Whether st can do ``step`` now; a read that would race is recorded as a fault."""
    me, ps = st.sched.rank, _state(sim)
    if step.kind == "sync":
        here = (st.round, st.index, st.slice)
        if ps.pending.get(me) != here:  # arrive once: count it and keep what our outputs hold now
            ps.pending[me] = here
            mine = _clock(ps, me)
            for p in step.remote:
                _check_overwrites(sim, st, p)
                ps.arrivals[me][p] += 1
                ps.seen[me, p, ps.arrivals[me][p]] = (st.round, list(sim.outputs[st.round][me]))
                ps.clock_at[me, p, ps.arrivals[me][p]] = dict(mine)
            mine[me] += 1  # what this rank does from here on, its peers at this sync have not seen
        if any(ps.arrivals[p][me] < ps.arrivals[me][p] for p in step.remote):
            return False
        del ps.pending[me]
        mine = _clock(ps, me)
        for p in step.remote:
            st.known |= sim.ranks[p].known
            for q, epoch in ps.clock_at[p, me, ps.arrivals[me][p]].items():
                mine[q] = max(mine.get(q, 0), epoch)
        return True
    for q in step.remote:
        if q == me:
            continue
        other = sim.ranks[q]
        if other.round < st.round and not other.done:
            return False  # q has not entered this round yet
        if other.round > st.round or other.done:
            verb = "writes into" if step.writes else "reads"
            sim._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} {verb} rank {q}'s buffer "
                                                                 f"after rank {q} left round {st.round}"))
        st.known.add((q, st.round))
        if step.reads == "in":
            name = input_name(other.sched, step.chunk)
            cell = _cell_over(sim, q, name)
            if cell is not None and _changes(sim.outputs[st.round][q][cell], q, name):
                sim._fault(READ_AFTER_WRITE, st, f"{st.where()} reads rank {q}'s input chunk {name}, which "
                                                 f"rank {q} has already overwritten with its output", IN_PLACE)
            ps.input_reads[st.round, q, me, ps.arrivals[me][q]].add(name)
            if sim.racy:
                touch(sim, st, input_place(st.round, q, name), "read", "in")
    return True


def _clock(ps: _State, r: int) -> dict:
    """Rank r's vector clock; its own epoch starts at 1, so no peer has seen it before a sync."""
    c = ps.clocks.get(r)
    if c is None:
        c = ps.clocks[r] = {r: 1}
    return c


def input_place(rd: int, q: int, name) -> tuple:
    """The memory of rank q's input chunk ``name`` in round rd, as the race check names it."""
    return rd, q, "in", name


def output_place(sim, rd: int, q: int, cell: int) -> tuple:
    """The memory of rank q's output cell: in place, the input chunk it lies over."""
    name = sim.alias[q].get(cell)
    return (rd, q, "in", name) if name is not None else (rd, q, "out", cell)


def touch(sim, st, place: tuple, what: str, region: str) -> None:
    """Log st's access to ``place`` ("read", "write" by its owner, "remote write" by write_copy)
    of the owner's ``region`` ("in" or "out": in place both may be one memory) and report a RACE
    with any earlier access by another rank that involves a remote write and that st's rank has
    not seen (no chain of syncs from it to here)."""
    ps, me = _state(sim), st.sched.rank
    mine = _clock(ps, me)
    log = ps.log[place]
    for a, epoch, did, their_region, where in log:
        if a == me or "remote write" not in (did, what) or mine.get(a, 0) >= epoch:
            continue
        _, q, _, chunk = place
        form = IN_PLACE if their_region != region else None
        sim._fault(RACE, st, f"{st.where()} ({what}) and {where} ({did}) both touch rank {q}'s chunk "
                             f"{chunk} with no sync ordering them: which comes first depends on timing", form)
        break
    log.append((me, mine[me], what, region, st.where()))


def write(sim, st, step, value) -> None:
    """write_copy, write_out_copy: ``value`` (this rank's input or output chunk) into each target's
    output chunk."""
    for q in step.remote:
        cell = output_cell(sim.ranks[q].sched, step.chunk)
        touch(sim, st, output_place(sim, st.round, q, cell), "remote write", "out")
        sim.store(st, q, cell, value)
        _state(sim).written_by[st.round, q, cell] = (st.sched.rank, value)


def _cell_over(sim, q, name):
    """In place, the output cell of rank q that lies over its input chunk ``name`` (else None)."""
    return next((cell for cell, n in sim.alias[q].items() if n == name), None)


def _changes(value, q, name) -> bool:
    """Whether storing ``value`` over rank q's input chunk ``name`` changes it."""
    return value is not None and value != Sym.leaf(q, name)


def _check_overwrites(sim, st, p) -> None:
    """At st's arrival at a sync with p, which ends a phase of the pair: no output cell st wrote in
    that phase may lie over an input chunk that p read in it, unless p itself wrote the cell (a
    write step of p's, after its read in p's own order: advance() refuses a read of a chunk
    already overwritten; all_reduce's write_out_copy over the peer chunk it reduced)."""
    ps, me = _state(sim), st.sched.rank
    phase = ps.arrivals[me][p]
    rd, before = ps.seen.get((me, p, phase), (None, None))
    now = sim.outputs[st.round][me]
    for name in ps.input_reads.get((st.round, me, p, phase), ()):
        cell = _cell_over(sim, me, name)
        if cell is None:
            continue
        old = before[cell] if rd == st.round else None
        by = ps.written_by.get((st.round, me, cell))
        if by is not None and by[0] == p and now[cell] is by[1]:   # p's write, and nothing since
            continue
        if now[cell] is not old and _changes(now[cell], me, name):
            sim._fault(READ_AFTER_WRITE, st, f"{st.where()}: rank {me} overwrote its input chunk {name} in "
                                             f"the phase in which rank {p} reads it: no sync between the read "
                                             f"and the write", IN_PLACE)


def value(sim, st, step):
    """The Sym a read step computes (None for a sync)."""
    if step.kind == "sync":
        return None
    s, me = st.sched, st.sched.rank
    if step.kind == "write_out_copy":  # this rank's output chunk as it holds it now (write())
        cell = output_cell(s, step.chunk)
        if sim.racy:
            touch(sim, st, output_place(sim, st.round, me, cell), "read", "out")
        if sim.outputs[st.round][me][cell] is None:
            sim._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} writes its output chunk "
                                                                 f"{cell} into its peers before any step wrote it"))
        return sim.outputs[st.round][me][cell]
    if step.writes:  # this rank's own input chunk, to be written into the targets (write())
        return sim._read(st, step, input_name(s, step.chunk))
    if step.reads == "in":
        vals = [sim._read(st, step, input_name(s, step.chunk)) if q == me else
                Sym.leaf(q, input_name(sim.ranks[q].sched, step.chunk)) for q in step.remote]
        acc = vals[0]
        for v in vals[1:]:
            acc = sim._combine(st, acc, v)
        return acc
    q, ps = step.remote[0], _state(sim)
    j = ps.arrivals[me][q]
    rd, outs = ps.seen.get((q, me, j), (None, None))
    cell = output_cell(sim.ranks[q].sched, step.chunk)
    if sim.racy:
        touch(sim, st, output_place(sim, st.round, q, cell), "read", "out")
    if j == 0 or rd != st.round or outs[cell] is None:
        sim._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} reads rank {q}'s output chunk "
                                                             f"{cell} before rank {q} wrote it (no sync between "
                                                             f"rank {q}'s write and this read)"))
    if sim.outputs[st.round][q][cell] is not outs[cell]:
        sim._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} reads rank {q}'s output chunk "
                                                             f"{cell} while rank {q} rewrites it (it changed "
                                                             f"after their last sync)"))
    return outs[cell]


def waiting(sim, st, step) -> tuple[int, str]:
    """(the peer st waits for, why) for a deadlock report; a peer that finished is UNMATCHED."""
    me, ps = st.sched.rank, _state(sim)
    if step.kind == "sync":
        for p in step.remote:
            if ps.arrivals[p][me] < ps.arrivals[me][p]:
                if sim.ranks[p].done:
                    sim._stop(Failure(UNMATCHED, me, st.index, step.chunk, f"{st.where()} waits at a sync "
                                      f"with rank {p}, which finished its schedule without reaching it"))
                return p, (f"waits at its sync #{ps.arrivals[me][p]} with rank {p}, which has reached "
                           f"only {ps.arrivals[p][me]} syncs with this rank")
    for q in step.remote:
        if q != me and sim.ranks[q].round < st.round:
            verb = "write into" if step.writes else "read"
            return q, f"waits for rank {q} to enter round {st.round} to {verb} its buffer"
    return step.remote[0], "waits on a peer"


def stage(s, index: int) -> int:
    """The cost model's stage of step ``index`` of schedule ``s``: between the k-th and the
    (k+1)-th sync, reads and write_copy are stage 3k, a write_out_copy (which sends what this
    rank's earlier steps there produced) 3k + 1; the (k+1)-th sync is stage 3k + 2."""
    k = sum(1 for x in s.steps[:index] if x.kind == "sync")
    kind = s.steps[index].kind
    return 3 * k + (2 if kind == "sync" else 1 if kind == "write_out_copy" else 0)


def cost_messages(scheds, m, chunk) -> None:
    """Add the reads, writes and syncs of registered schedules to cost.Messages ``m``: a read of a
    peer's chunk is an item of ``chunk`` bytes from the peer (reduced on arrival for
    read_reduce_copy), a write into a peer's chunk one to the peer; a sync with p is an empty
    message from p, which the model prices at one alpha."""
    for s in scheds:
        for i, st in enumerate(s.steps):
            if not st.remote:
                continue
            k = stage(s, i)
            for q in st.remote:
                if q == s.rank:
                    continue
                size = 0 if st.kind == "sync" else chunk
                a, b = (s.rank, q) if st.writes else (q, s.rank)
                m.size[a, b, k] += size
                m.items[a, b, k]  # noqa: B018 - the key exists: the message is counted
                if st.reduces:
                    m.reduced[s.rank, k] += size
