"""What the simulator needs to run steps that read a peer's registered buffer (step.READS).

Kept apart from simulate.py, which calls in here at four points (validate, advance, value,
deadlock) for steps with ``remote`` peers; everything else of a read step (the final post-op,
the copy into the output) is simulate.py's own code.

The model, as ringcomm/registered.py runs it:

- A rank's input is readable once the rank has entered the round, and until it leaves it.
- ``sync`` with peers P: the j-th sync of rank r with p waits until p has reached its j-th sync
  with r (a barrier per pair; counts are kept for the whole run, rounds included).
- ``read_out_copy`` of rank q's output chunk c reads it as it was when q reached the sync that
  the reader has passed last with q: it must have been written by then, and not rewritten since
  (a write after that sync races with the read).
- In place (the output over the input: the same chunk under the SPLIT layouts, the rank's own
  block of the BLOCK side otherwise), a rank must not overwrite an input chunk that a peer reads
  in the same phase, nor before it (the peer would read the result, not the input). The check
  holds for every call, so a schedule that passes is safe in place and out of place; storing a
  chunk's own input value again (all_gather's own block) changes nothing and is allowed.
- Static rules (validate): the peers exist; read_reduce_copy combines this rank's own input with
  at least one peer's; every read of a peer is followed, later in the schedule, by a sync with
  that peer, so no rank leaves the call while another still reads its buffers.
"""
from __future__ import annotations

from collections import defaultdict

from .step import BLOCK, OWN, SPLIT


class _State:
    """Per simulation: arrivals[r][p] = syncs of r with p reached so far; pending: the sync
    (round, step, slice) each rank has arrived at and not yet passed; seen[(q, p, j)]: q's
    outputs (round, [values]) when it reached its j-th sync with p."""

    def __init__(self):
        self.arrivals = defaultdict(lambda: defaultdict(int))
        self.pending = {}
        self.seen = {}
        self.input_reads = defaultdict(set)  # (round, owner, reader, pair phase) -> input chunks read


def _state(sim) -> _State:
    st = sim.__dict__.get("_peer_read")
    if st is None:
        st = sim.__dict__["_peer_read"] = _State()
    return st


def validate(schedules, error) -> None:
    """Raise ``error`` (simulate.ScheduleError) for a read step that breaks a static rule."""
    n = len(schedules)
    for s in schedules:
        r = s.rank
        for i, st in enumerate(s.steps):
            if not st.remote:
                continue
            where = f"rank {r} step {i} {st}"
            combined = st.kind == "read_reduce_copy"
            bad = [p for p in st.remote if not 0 <= p < n or (p == r and not combined)]
            if bad or len(set(st.remote)) != len(st.remote):
                raise error(f"{where}: peer out of range, repeated, or this rank itself (n={n})")
            if combined and (r not in st.remote or len(st.remote) < 2):
                raise error(f"{where}: read_reduce_copy combines this rank's own input with its peers' "
                            f"inputs, in the order given: name rank {r} and at least one peer")
            if st.kind == "sync":
                continue
            later = {p for x in s.steps[i + 1:] if x.kind == "sync" for p in x.remote}
            unsynced = sorted(p for p in st.remote if p != r and p not in later)
            if unsynced:
                raise error(f"{where}: no sync with rank(s) {unsynced} follows, so they could leave the "
                            f"call (and reuse their buffers) while this rank still reads them")


def advance(sim, st, step) -> bool:
    """Whether st can do ``step`` now (ScheduleError where the read would race)."""
    me, ps = st.sched.rank, _state(sim)
    if step.kind == "sync":
        here = (st.round, st.index, st.slice)
        if ps.pending.get(me) != here:  # arrive once: count it and keep what our outputs hold now
            ps.pending[me] = here
            for p in step.remote:
                _check_overwrites(sim, st, p)
                ps.arrivals[me][p] += 1
                ps.seen[me, p, ps.arrivals[me][p]] = (st.round, list(sim.outputs[st.round][me]))
        if any(ps.arrivals[p][me] < ps.arrivals[me][p] for p in step.remote):
            return False
        del ps.pending[me]
        for p in step.remote:
            st.known |= sim.ranks[p].known
        return True
    for q in step.remote:
        if q == me:
            continue
        other = sim.ranks[q]
        if other.round < st.round and not other.done:
            return False  # q has not entered this round yet
        if other.round > st.round or other.done:
            raise _error(sim)(f"{st.where()} reads rank {q}'s buffer after rank {q} left round {st.round}")
        st.known.add((q, st.round))
        if step.reads == "in":
            key = q if st.sched.in_layout == OWN else step.chunk
            cell = _cell_over(other.sched, key)
            if cell is not None and _changes(sim.outputs[st.round][q][cell], q, key):
                raise _error(sim)(f"{st.where()} reads rank {q}'s input chunk {key}, which rank {q} has already "
                                  f"overwritten with its output when the call is in place")
            ps.input_reads[st.round, q, me, ps.arrivals[me][q]].add(key)
    return True


def _cell_over(s, key):
    """The output cell of schedule ``s`` that lies over its input chunk ``key`` in place, or None."""
    if s.in_layout == SPLIT and s.out_layout == SPLIT:
        return key
    if s.in_layout == BLOCK and s.out_layout == OWN:   # out is block ``rank`` of the input
        return s.rank % s.nchunks if key == s.rank else None
    if s.in_layout == OWN and s.out_layout == BLOCK:   # the input is block ``rank`` of out
        return s.rank if key == s.rank else None
    return None


def _changes(value, q, key) -> bool:
    """Whether storing ``value`` over rank q's input chunk ``key`` changes it."""
    from .simulate import Sym
    return value is not None and value != Sym(((q, key),), (q, key))


def _check_overwrites(sim, st, p) -> None:
    """At st's arrival at a sync with p, which ends a phase of the pair: no output cell st wrote in
    that phase may lie over an input chunk that p read in it."""
    ps, me, s = _state(sim), st.sched.rank, st.sched
    phase = ps.arrivals[me][p]
    read = ps.input_reads.get((st.round, me, p, phase))
    if not read:
        return
    rd, before = ps.seen.get((me, p, phase), (None, None))
    now = sim.outputs[st.round][me]
    for key in read:
        cell = _cell_over(s, key)
        if cell is None:
            continue
        old = before[cell] if rd == st.round else None
        if now[cell] is not old and _changes(now[cell], me, key):
            raise _error(sim)(f"{st.where()}: rank {me} overwrote its input chunk {key} (in place) in the phase "
                              f"in which rank {p} reads it: no sync between the read and the write")


def value(sim, st, step, where: str):
    """The Sym a read step computes (None for a sync)."""
    if step.kind == "sync":
        return None
    from .simulate import Sym, _combine
    s, me = st.sched, st.sched.rank
    if step.reads == "in":
        vals = []
        for q in step.remote:
            leaf = (q, q) if s.in_layout == OWN else (q, step.chunk)
            vals.append(Sym((leaf,), leaf))
        acc = vals[0]
        for v in vals[1:]:
            acc = _combine(acc, v, where)
        return acc
    q, ps = step.remote[0], _state(sim)
    j = ps.arrivals[me][q]
    rd, outs = ps.seen.get((q, me, j), (None, None))
    cell = q % s.nchunks if s.out_layout == OWN else step.chunk
    if j == 0 or rd != st.round or outs[cell] is None:
        raise _error(sim)(f"{where} reads rank {q}'s output chunk {cell} before rank {q} wrote it "
                          f"(no sync between rank {q}'s write and this read)")
    if sim.outputs[st.round][q][cell] is not outs[cell]:
        raise _error(sim)(f"{where} reads rank {q}'s output chunk {cell} while rank {q} rewrites it "
                          f"(it changed after their last sync)")
    return outs[cell]


def waiting(sim, st, step) -> tuple[int, str]:
    """(the peer st waits for, why) for a deadlock report."""
    me, ps = st.sched.rank, _state(sim)
    if step.kind == "sync":
        for p in step.remote:
            if ps.arrivals[p][me] < ps.arrivals[me][p] and sim.ranks[p].done:
                raise _error(sim)(f"{st.where()} waits at a sync with rank {p}, which finished its "
                                  f"schedule without reaching it")
            if ps.arrivals[p][me] < ps.arrivals[me][p]:
                return p, (f"waits at its sync #{ps.arrivals[me][p]} with rank {p}, which has reached "
                           f"only {ps.arrivals[p][me]} syncs with this rank")
    for q in step.remote:
        if q != me and sim.ranks[q].round < st.round:
            return q, f"waits for rank {q} to enter round {st.round} to read its buffer"
    return step.remote[0], "waits on a peer"


def _error(sim):
    from .simulate import ScheduleError
    return ScheduleError


def stage(s, index: int) -> int:
    """The cost model's stage of step ``index`` of schedule ``s``: reads between the k-th and the
    (k+1)-th sync are stage 2k, the (k+1)-th sync is stage 2k + 1."""
    k = sum(1 for x in s.steps[:index] if x.kind == "sync")
    return 2 * k + (s.steps[index].kind == "sync")


def cost_messages(scheds, m, chunk) -> None:
    """Add the reads and syncs of registered schedules to cost.Messages ``m``: a read of a peer's
    chunk is an item of ``chunk`` bytes from the peer (reduced on arrival for read_reduce_copy);
    a sync with p is an empty message from p, which the model prices at one alpha."""
    for s in scheds:
        for i, st in enumerate(s.steps):
            if not st.remote:
                continue
            k = stage(s, i)
            for q in st.remote:
                if q == s.rank:
                    continue
                size = 0 if st.kind == "sync" else chunk
                m.size[q, s.rank, k] += size
                m.items[q, s.rank, k]  # noqa: B018 - the key exists: the message is counted
                if st.reduces:
                    m.reduced[s.rank, k] += size
