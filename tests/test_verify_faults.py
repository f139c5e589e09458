"""Planted faults, one class at a time, at several world sizes and for several collectives:
verify must name the right kind (ringcomm.schedule.faults) every time, never certify a wrong
schedule, never call a shape it did not check "no deadlock", and accept every built-in.

Each fault is made the way a researcher would make one: take a correct schedule and change a
step (or write a small one by hand). The in-place faults are also run on real processes, to
show that the executor computes exactly what the verifier predicts, in place and out of place.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ringcomm
from harness import World
from ringcomm import catalogue
from ringcomm.schedule import faults as F
from ringcomm.schedule.faults import ScheduleError
from ringcomm.schedule.simulate import check
from ringcomm.schedule.spec import IN_PLACE, OUT_OF_PLACE
from ringcomm.schedule.step import (BLOCK, OWN, SPLIT, Schedule, Step, copy, copy_send, recv,
                                    recv_copy_send, recv_reduce_copy, recv_reduce_copy_send, send)
from ringcomm.schedule.verify import FIFOS, NOT_CHECKED, fifo_shapes, verify_schedules

SIZES = (2, 3, 4, 5, 7)
ROOTED = catalogue.ROOTED


def build(collective, algo, n, root=None):
    return catalogue.schedules(collective, algo, n, root if collective in ROOTED else None)


def with_steps(s: Schedule, steps, **kw) -> Schedule:
    return dataclasses.replace(s, steps=tuple(steps), **kw)


def rekind(step: Step, kind: str) -> Step:
    return Step(kind, step.chunk, step.src, step.dst)


def verdict(collective, scheds, root=None, **kw):
    return verify_schedules(collective, scheds, 100, root=root, **kw)


def assert_caught(rep, kind, *, rank=None, step=None, chunk=None):
    assert not rep.ok and kind in rep.kinds, rep.summary()
    if rank is not None:
        hit = [f for f in rep.failures if f.kind == kind]
        assert any((f.rank, f.step, f.chunk) == (rank, step, chunk) for f in hit), hit
    for shape, dl in rep.deadlocks.items():  # checked, or honestly not
        assert dl is None or dl.startswith(("deadlock with", NOT_CHECKED)), (shape, dl)


# ---- hand-written schedules, at any world size (module level: real processes build them too) --

def late_send(rank, n):
    """One-shot all_reduce, but rank 1 sends its input after finishing its sum: right out of
    place; in place it sends the sum, and ranks 0 and 2 get 212 where 111 is right (n = 3)."""
    if n == 1:
        return Schedule("all_reduce", "late_send", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    others = tuple(q for q in range(n) if q != rank)
    steps = (send(0, others), recv_reduce_copy(0, others))
    return Schedule("all_reduce", "late_send", rank, n, 1, SPLIT, SPLIT, steps[::-1] if rank == 1 else steps)


def echo_all_gather(rank, n):
    """Ring all_gather, but rank 1 first sends rank 0 its own block as block 0, which rank 0
    keeps until its ring step rewrites block 0 from its input: in place (buf is out's block 0)
    that input is already gone."""
    s = catalogue.ALGOS["all_gather"]["ring"](rank, n)
    if rank == 1:
        return with_steps(s, (send(0, 0),) + s.steps, algo="echo")
    if rank == 0:
        return with_steps(s, (recv(0, 1),) + s.steps, algo="echo")
    return with_steps(s, s.steps, algo="echo")


def early_copy_reduce_scatter(rank, n):
    """Ring reduce_scatter whose first step also copies chunk r-1 to the output: overwritten by
    the final step out of place, but in place (out is buf's block r) it overwrites input block r
    before the final step reads it."""
    s = catalogue.ALGOS["reduce_scatter"]["ring"](rank, n)
    first = s.steps[0]
    return with_steps(s, (copy_send(first.chunk, first.dst),) + s.steps[1:], algo="early_copy")


def all_reduce_as_reduce(rank, n, root):
    """Ring all_reduce passed off as reduce: the root is right, but every other rank writes the
    sum into its buffer, which reduce leaves alone (in place that buffer is the rank's input)."""
    s = catalogue.ALGOS["all_reduce"]["ring"](rank, n)
    return dataclasses.replace(s, collective="reduce", algo="greedy")


def finish_then_lend_reduce(rank, n, root):
    """Star reduce whose root, after finishing, sends its input to the next rank, which keeps it."""
    if n == 1:
        return Schedule("reduce", "lend", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    nxt, others = (root + 1) % n, tuple(q for q in range(n) if q != root)
    if rank == root:
        steps = (recv_reduce_copy(0, others), send(0, nxt))
    else:
        steps = (send(0, root),) + ((recv(0, root),) if rank == nxt else ())
    return Schedule("reduce", "lend", rank, n, 1, SPLIT, SPLIT, steps)


def diamond_reduce(rank, n, root):
    """Star reduce where the last rank also sends its input to the first, which adds it and
    passes it on to the root: the root gets it twice (n >= 3)."""
    others = tuple(q for q in range(n) if q != root)
    first, last = others[0], others[-1]
    if rank == root:
        steps = (recv_reduce_copy(0, others),)
    elif rank == first:
        steps = (Step("recv_reduce_send", 0, (last,), (root,)),)
    else:
        steps = (send(0, (root, first) if rank == last else root),)
    return Schedule("reduce", "diamond", rank, n, 1, SPLIT, SPLIT, steps)


def bulk_oneshot(rank, n, nchunks=3):
    """One-shot all_reduce of 3 chunks that sends all of them before receiving any: right with
    unbounded FIFOs, stuck once a FIFO holds fewer than 3 steps' slices."""
    others = tuple(q for q in range(n) if q != rank)
    steps = [send(c, others) for c in range(nchunks)] + [recv_reduce_copy(c, others) for c in range(nchunks)]
    return Schedule("all_reduce", "bulk", rank, n, nchunks, SPLIT, SPLIT, tuple(steps))


def hub_without_final(collective, rank, n, root=0):
    """Every rank sends to a hub, which adds them all and sends the sum back without copying
    it (no final step): AVG would never divide."""
    hub, others = (root + 1) % n, tuple(q for q in range(n) if q != (root + 1) % n)
    back = others if collective == "all_reduce" else (root,)
    if rank == hub:
        steps = (Step("recv_reduce_send", 0, others, back),)
    else:
        steps = (send(0, hub),) + ((recv(0, hub),) if rank in back else ())
    return Schedule(collective, "hub", rank, n, 1, SPLIT, SPLIT, steps)


# ---- the fault classes --------------------------------------------------------------------

UNREDUCE = {"recv_reduce_send": "recv_send", "recv_reduce_copy_send": "recv_copy_send",
            "recv_reduce_copy": "recv"}
REREDUCE = {"recv": "recv_reduce_copy", "recv_copy_send": "recv_reduce_copy_send",
            "recv_send": "recv_reduce_send"}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("collective,algo", [("all_reduce", "ring"), ("all_reduce", "rabenseifner"),
                                             ("reduce_scatter", "ring"), ("reduce_scatter", "halving"),
                                             ("reduce", "ring"), ("reduce", "binomial")])
def test_missing_contribution(collective, algo, n):
    """A rank passes a partial sum on without adding its own input; where every reduction
    takes several peers at once, one peer is left out on both ends (still matched)."""
    scheds = build(collective, algo, n, root=0)
    found = [(r, i) for r in range(n) for i, st in enumerate(scheds[r].steps) if st.kind in UNREDUCE]
    single = [(r, i) for r, i in found if len(scheds[r].steps[i].src) == 1]
    r, i = (single or found)[0]
    steps, st = list(scheds[r].steps), scheds[r].steps[i]
    if single:
        steps[i] = rekind(st, UNREDUCE[st.kind])
    else:
        leaf = st.src[-1]
        steps[i] = Step(st.kind, st.chunk, st.src[:-1], st.dst)
        j = next(j for j, x in enumerate(scheds[leaf].steps) if x.dst == (r,) and x.chunk == st.chunk)
        scheds[leaf] = with_steps(scheds[leaf], scheds[leaf].steps[:j] + scheds[leaf].steps[j + 1:])
    scheds[r] = with_steps(scheds[r], steps)
    rep = verdict(collective, scheds, root=0)
    assert_caught(rep, F.MISSING)
    assert any(f.form is None for f in rep.failures if f.kind == F.MISSING)  # wrong in both forms


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algo", ["ring", "tree", "rabenseifner"])
def test_counted_twice_all_reduce(algo, n):
    """A rank adds its input again to a value that already holds it (the finished sum)."""
    scheds = build("all_reduce", algo, n)
    i = max(i for i, st in enumerate(scheds[1].steps) if st.kind in REREDUCE)
    steps = list(scheds[1].steps)
    steps[i] = rekind(steps[i], REREDUCE[steps[i].kind])
    scheds[1] = with_steps(scheds[1], steps)
    assert_caught(verdict("all_reduce", scheds), F.TWICE, rank=1, step=i, chunk=steps[i].chunk)


@pytest.mark.parametrize("n", [3, 4, 5, 7])
def test_counted_twice_reduce(n):
    root = n - 1
    rep = verdict("reduce", [diamond_reduce(r, n, root) for r in range(n)], root=root)
    assert_caught(rep, F.TWICE, rank=root, step=0, chunk=0)


def _relabel(scheds, n):
    """Every rank handles chunk c + 1 where it handled c: still matched, but off by one block."""
    def move(st):
        return Step(st.kind, (st.chunk + 1) % n, st.src, st.dst)
    return [with_steps(s, [move(st) for st in s.steps]) for s in scheds]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("collective,algo", [("all_gather", "ring"), ("all_gather", "bruck"),
                                             ("all_gather", "doubling"), ("reduce_scatter", "ring"),
                                             ("reduce_scatter", "halving")])
def test_misplaced_block(collective, algo, n):
    rep = verdict(collective, _relabel(build(collective, algo, n), n))
    assert_caught(rep, F.MISPLACED)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algo", ["ring", "tree", "binomial"])
def test_misplaced_broadcast_from_the_wrong_root(algo, n):
    assert_caught(verdict("broadcast", build("broadcast", algo, n, root=0), root=1), F.MISPLACED)


BUILTIN = sorted((c, a) for c, algos in catalogue.ALGOS.items() for a in algos
                 if (c, a) not in ringcomm.algorithms.USER)
# Those with FIFO messages to break (the read algorithms have none: tests/test_registered.py).
FIFO_BUILTIN = [(c, a) for c, a in BUILTIN if a not in catalogue.REGISTERED_ONLY]


@pytest.mark.parametrize("collective,algo", FIFO_BUILTIN)
def test_unmatched_send_or_receive(collective, algo):
    """The last rank drops its last receiving step, or a rank sends to the wrong peer: no FIFO
    shape can be checked on schedules that do not match up, and none is called deadlock-free."""
    for n in (2, 3, 5):
        scheds = build(collective, algo, n, root=0)
        last = max(r for r in range(n) if any(st.src for st in scheds[r].steps))
        i = max(i for i, st in enumerate(scheds[last].steps) if st.src)
        scheds[last] = with_steps(scheds[last], scheds[last].steps[:i] + scheds[last].steps[i + 1:])
        rep = verdict(collective, scheds, root=0)
        assert_caught(rep, F.UNMATCHED)
        assert rep.deadlock_free is None and all(d.startswith(NOT_CHECKED) for d in rep.deadlocks.values())
        assert "no deadlock" not in rep.summary()
    scheds = build(collective, algo, 5, root=0)
    r, i = next((r, i) for r in range(5) for i, st in enumerate(scheds[r].steps) if st.dst)
    st = scheds[r].steps[i]
    wrong = [q for q in range(5) if q != r and q not in st.dst]
    steps = list(scheds[r].steps)  # to a rank that expects nothing, or one peer fewer
    steps[i] = Step(st.kind, st.chunk, st.src, tuple(wrong[:1]) + st.dst[1:] if wrong else st.dst[:-1])
    scheds[r] = with_steps(scheds[r], steps)
    assert_caught(verdict(collective, scheds, root=0), F.UNMATCHED)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_deadlock_at_every_fifo_size(collective, n):
    """A ring that no rank starts: each first forwards a token it must receive from the rank
    before. Matched message for message, stuck even with unbounded FIFOs; reported as a
    deadlock with its shortest trace, and no shape says "no deadlock"."""
    def tokened(s):
        token = Step("recv_send", 0, ((s.rank - 1) % n,), ((s.rank + 1) % n,))
        return with_steps(s, (token,) + s.steps)
    rep = verdict(collective, [tokened(s) for s in build(collective, "ring", n)])
    assert_caught(rep, F.DEADLOCK)
    dl = next(f for f in rep.failures if f.kind == F.DEADLOCK)
    assert dl.fifo is None and "every FIFO size, even unbounded" in dl.detail
    assert (dl.step, dl.chunk) == (0, 0) and "wait for each other" in dl.detail
    assert "has 0 events" in dl.detail  # nothing can happen first: the shortest trace is empty
    assert rep.deadlock_free is False and rep.postcondition
    assert all(d.startswith("deadlock with") for d in rep.deadlocks.values())
    assert "no deadlock" not in rep.summary()


@pytest.mark.parametrize("n", SIZES)
def test_deadlock_only_with_small_fifos_is_a_structured_failure(n):
    """Sending 3 chunks before receiving any fits 8 one-slice slots but not 2 slots, nor 8
    slots with 3 slices a step; the postcondition holds, each failure names its shape."""
    rep = verdict("all_reduce", [bulk_oneshot(r, n) for r in range(n)])
    assert rep.postcondition is None and rep.deadlocks[8, 1] is None and rep.deadlocks[8, 2] is None
    assert rep.deadlocks[2, 1].startswith("deadlock with nslots=2, slices=1")
    assert [f.fifo for f in rep.failures] == [(2, 1), (8, 3), (8, 4)] and rep.kinds == {F.DEADLOCK}
    assert rep.deadlock_free is False and not rep.ok
    # the tree's root runs a chunk ahead of its children: as many slices as slots deadlock (n = 4)
    tree = verdict("all_reduce", build("all_reduce", "tree", 4), fifos=[(2, 1), (2, 2)])
    assert [f.fifo for f in tree.failures] == [(2, 2)] and tree.deadlocks[2, 1] is None


READ_AFTER_WRITE = {  # name: (collective, builder, rooted, right out of place?)
    "all_reduce late send": ("all_reduce", late_send, False, True),
    "all_gather echo": ("all_gather", echo_all_gather, False, True),
    "reduce_scatter early copy": ("reduce_scatter", early_copy_reduce_scatter, False, True),
    "reduce finish then lend": ("reduce", finish_then_lend_reduce, True, True),
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(READ_AFTER_WRITE))
def test_read_after_write_in_place(name, n):
    collective, builder, rooted, right_out_of_place = READ_AFTER_WRITE[name]
    root = n - 1 if rooted else None
    scheds = [builder(r, n, root) if rooted else builder(r, n) for r in range(n)]
    rep = verdict(collective, scheds, root=root)
    assert_caught(rep, F.READ_AFTER_WRITE)
    raw = [f for f in rep.failures if f.kind == F.READ_AFTER_WRITE]
    assert all(f.form == IN_PLACE and f.rank is not None and f.step is not None for f in raw)
    if right_out_of_place:  # the fault is in-place only: nothing shows out of place
        assert all(f.form == IN_PLACE for f in rep.failures), rep.summary()
    with pytest.raises(ScheduleError) as err:  # and registration refuses it, naming the step
        ringcomm.register_algorithm(f"planted_{collective}", collective, builder, sizes=(n,))
    assert F.READ_AFTER_WRITE in err.value.kinds and "reads its input chunk" in str(err.value)
    assert f"planted_{collective}" not in ringcomm.algorithms.algorithms(collective)


def test_read_after_write_names_the_step_of_the_planted_fault():
    rep = ringcomm.verify("all_reduce", late_send, 3, 10)
    (f,) = rep.failures
    assert (f.kind, f.rank, f.step, f.chunk, f.form) == (F.READ_AFTER_WRITE, 1, 1, 0, IN_PLACE)
    assert "after step 0 recv_reduce_copy(0, from=[0, 2]) wrote" in f.detail
    assert "postcondition: FAILS" in rep.summary() and "read-after-write at rank 1, step 1" in rep.summary()


LAYOUTS = (SPLIT, BLOCK, OWN)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                                        "gather", "scatter"])
def test_schedules_relabelled_to_other_layouts_are_refused(collective, n):
    """Layouts say which memory a chunk is; the expected contributions and the in-place aliases
    are the API's only under the collective's own. Relabelled, the issue's planted fault
    (late_send, SPLIT -> OWN) was certified and gave 212 in place, a broadcast relabelled
    SPLIT -> OWN destroyed the root's data, and an all_gather relabelled OWN -> ... read past
    its input: every relabelling must be refused, by verify and by registration."""
    root = n - 1 if collective in ROOTED else None
    algos = [a for a in catalogue.ALGOS[collective] if a not in catalogue.REGISTERED_ONLY]
    own = {(s.in_layout, s.out_layout) for a in algos for s in build(collective, a, n, root)}
    assert len(own) == 1, own  # every built-in uses the collective's layouts
    for algo in algos:
        for ins in LAYOUTS:
            for outs in LAYOUTS:
                if (ins, outs) in own:
                    continue
                scheds = [dataclasses.replace(s, in_layout=ins, out_layout=outs)
                          for s in build(collective, algo, n, root)]
                rep = verdict(collective, scheds, root=root)
                assert not rep.ok and rep.kinds == {F.MALFORMED}, (algo, ins, outs, rep.summary())
                assert f"cuts its buffers as {ins} -> {outs}" in str(rep.failures[0])
                with pytest.raises(ScheduleError, match="malformed"):
                    check(collective, scheds, root=root)


def test_late_send_relabelled_is_refused_by_registration():
    def relabelled(rank, n):
        return dataclasses.replace(late_send(rank, n), out_layout=OWN)
    with pytest.raises(ScheduleError) as err:
        ringcomm.register_algorithm("late_send_own", "all_reduce", relabelled, sizes=(3,))
    assert err.value.kinds == {F.MALFORMED} and "split -> own" in str(err.value)
    assert "late_send_own" not in ringcomm.algorithms.algorithms("all_reduce")


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_to_all"])
def test_block_layouts_need_a_block_per_rank(collective):
    """A BLOCK, OWN, TO or FROM buffer has a block per rank (all_to_all: per source and
    destination): more chunks would name blocks past the buffer's end."""
    n = 3
    algo = next(a for a in catalogue.ALGOS[collective] if a not in catalogue.REGISTERED_ONLY)
    scheds = [dataclasses.replace(s, nchunks=s.nchunks + n) for s in build(collective, algo, n)]
    rep = verdict(collective, scheds)
    assert rep.kinds == {F.MALFORMED} and "chunks; under" in str(rep.failures[0]), rep.summary()


@pytest.mark.parametrize("n", SIZES)
def test_read_after_write_broadcast_root_overwritten_first(n):
    """The root receives a non-root's (meaningless) buffer into its own before sending it."""
    scheds = build("broadcast", "ring", n, root=0)
    scheds[1] = with_steps(scheds[1], (send(0, 0),) + scheds[1].steps)
    scheds[0] = with_steps(scheds[0], (recv(0, 1),) + scheds[0].steps)
    assert_caught(verdict("broadcast", scheds, root=0), F.READ_AFTER_WRITE, rank=0, step=1, chunk=0)


@pytest.mark.parametrize("n", SIZES)
def test_clobbered_buffer(n):
    """Right out of place; in place every non-root rank overwrites its input with the sum."""
    for root in (0, n - 1):
        rep = verdict("reduce", [all_reduce_as_reduce(r, n, root) for r in range(n)], root=root)
        assert rep.kinds == {F.CLOBBER}, rep.summary()
        assert {f.rank for f in rep.failures} == set(range(n)) - {root}
        assert all(f.form == IN_PLACE for f in rep.failures)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce"])
def test_post_op_never_applied(collective, n):
    rep = verdict(collective, [hub_without_final(collective, r, n) for r in range(n)], root=0)
    assert_caught(rep, F.POST_OP)


def test_malformed_schedules():
    ring = build("all_reduce", "ring", 3)
    bad_peer = [with_steps(ring[0], (send(0, 7),) + ring[0].steps[1:])] + ring[1:]
    assert_caught(verdict("all_reduce", bad_peer), F.MALFORMED, rank=0, step=0, chunk=0)
    swapped = [ring[1], ring[0], ring[2]]
    assert_caught(verdict("all_reduce", swapped), F.MALFORMED)

    split_vs_block = [dataclasses.replace(ring[0], in_layout=BLOCK, out_layout=OWN)] + ring[1:]
    rep = verdict("all_reduce", split_vs_block)  # the two ends would cut different slices
    assert rep.kinds == {F.MALFORMED} and "differ in length" in rep.postcondition

    def raises(rank, n):
        raise RuntimeError("no schedule for you")
    rep = ringcomm.verify("all_reduce", raises, 3, 10)
    assert rep.kinds == {F.MALFORMED} and "no schedule for you" in rep.postcondition
    assert rep.deadlock_free is None and all(d.startswith(NOT_CHECKED) for d in rep.deadlocks.values())
    assert ringcomm.verify("all_reduce", lambda r, n: None, 3, 10).kinds == {F.MALFORMED}


# ---- carried sums: recursive doubling keeps its running sum in the output ---------------------

@pytest.mark.parametrize("n", (3, 4, 5, 8))
def test_a_carried_sum_marked_final_too_early(n):
    """Rank 1's first kept sum left final (no partial=True): AVG would divide it before the
    later exchanges add to it."""
    s = build("all_reduce", "doubling", n)
    steps = list(s[1].steps)
    i = next(i for i, st in enumerate(steps) if st.partial)
    steps[i] = dataclasses.replace(steps[i], partial=False)
    rep = verdict("all_reduce", [s[0], with_steps(s[1], steps)] + s[2:])
    assert_caught(rep, F.POST_OP)
    assert any(f.rank == 1 for f in rep.failures if f.kind == F.POST_OP), rep.summary()


def test_carrying_an_output_that_nothing_wrote():
    s = build("all_reduce", "doubling", 4)
    steps = list(s[0].steps)
    steps[1] = dataclasses.replace(steps[1], base="out")   # the first exchange: nothing kept yet
    rep = verdict("all_reduce", [with_steps(s[0], steps)] + s[1:])
    assert_caught(rep, F.MALFORMED, rank=0, step=1, chunk=0)
    assert "no earlier step of rank 0 wrote it" in rep.summary()


def test_restarting_from_the_input_loses_the_first_exchange():
    s = build("all_reduce", "doubling", 4)
    steps = list(s[0].steps)
    steps[2] = dataclasses.replace(steps[2], base="in")   # x0 op (x2 + x3): x1 is missing
    rep = verdict("all_reduce", [with_steps(s[0], steps)] + s[1:])
    assert_caught(rep, F.MISSING)


def test_base_and_partial_are_checked_where_they_are_made():
    with pytest.raises(ValueError, match="base='out'"):
        Step("recv", 0, (1,), base="out")
    with pytest.raises(ValueError, match="partial=True"):
        Step("send", 0, (), (1,), partial=True)
    with pytest.raises(ValueError, match="base must be"):
        send(0, 1, base="output")
    with pytest.raises(ValueError, match="FIFO steps"):
        Step("read_copy", 0, remote=(1,), base="out")
    assert str(recv_reduce_copy_send(0, 1, 2, base="out", partial=True)) == \
        "recv_reduce_copy_send(0, from=[1], to=[2], base=out, partial)"
    assert not recv_reduce_copy_send(0, 1, 2, partial=True).final and recv_reduce_copy(0, 1, base="out").final


# ---- the model: in-place forms, no false positives -----------------------------------------

def test_in_place_model_follows_the_layouts():
    """Broadcast has only its in-place form: a root that never copies already holds its data.
    all_reduce without a copy on one rank is right in place only for n = 1."""
    def lazy_root(rank, n, root):
        s = catalogue.ALGOS["broadcast"]["ring"](rank, n, root)
        st = s.steps[0]
        return with_steps(s, (send(0, st.dst),)) if rank == root and n > 1 else s
    for n in SIZES:
        assert verdict("broadcast", [lazy_root(r, n, 0) for r in range(n)], root=0).ok
    empty = [Schedule("all_reduce", "none", 0, 1, 1, SPLIT, SPLIT, ())]
    rep = verdict("all_reduce", empty)
    assert [(f.kind, f.form) for f in rep.failures] == [(F.MISSING, OUT_OF_PLACE)]
    # all_gather: writing its own block back in place changes nothing, so may be read again
    def own_first(rank, n):
        s = catalogue.ALGOS["all_gather"]["ring"](rank, n)
        return with_steps(s, (copy(rank),) + s.steps)
    assert verdict("all_gather", [own_first(r, 4) for r in range(4)]).ok


@pytest.mark.parametrize("collective,algo", BUILTIN)
def test_every_builtin_is_clean_in_every_form(collective, algo):
    """No false positive: check() runs the in-place form of each collective too."""
    for n in (1, 2, 3, 5, 6, 8):
        for root in (range(n) if collective in ROOTED else (None,)):
            check(collective, build(collective, algo, n, root), root=root, nslots=4, slices=2, rounds=2)


# ---- the front end -----------------------------------------------------------------------------

def test_verify_takes_a_name_a_builder_or_schedules():
    by_name = ringcomm.verify("all_reduce", "ring", 5, 1000)
    by_builder = ringcomm.verify("all_reduce", catalogue.ALGOS["all_reduce"]["ring"], 5, 1000)
    by_list = ringcomm.verify("all_reduce", build("all_reduce", "ring", 5), 5, 1000)
    assert by_name.ok and by_builder.ok and by_list.ok
    assert by_name.orders == by_builder.orders == by_list.orders
    rooted = ringcomm.verify("reduce", catalogue.ALGOS["reduce"]["tree"], 6, 10, root=4)
    assert rooted.ok and rooted.root == 4
    with pytest.raises(ValueError, match="need one per rank"):
        ringcomm.verify("all_reduce", build("all_reduce", "ring", 5), 4, 10)
    with pytest.raises(TypeError, match="algo must be"):
        ringcomm.verify("all_reduce", 3, 4, 10)


def test_nslots_sets_the_fifo_shapes_checked_and_the_docstring_says_so():
    assert set(ringcomm.verify("all_reduce", "ring", 4, 10).deadlocks) == set(FIFOS) == set(fifo_shapes(8))
    assert FIFOS == ((2, 1), (8, 1), (8, 2), (8, 3), (8, 4))
    rep = ringcomm.verify("all_reduce", "tree", 5, 10, nslots=4)
    assert list(rep.deadlocks) == [(2, 1), (4, 1), (4, 2)] and rep.ok
    assert list(ringcomm.verify("all_reduce", "ring", 4, 10, nslots=16).deadlocks)[-1] == (16, 8)
    assert list(ringcomm.verify("all_reduce", "ring", 4, 10, nslots=1).deadlocks) == [(2, 1), (1, 1)]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="nslots"):
            ringcomm.verify("all_reduce", "ring", 4, 10, nslots=bad)
    doc = " ".join(ringcomm.verify.__doc__.split())
    assert "(2, 1), (8, 1), (8, 2), (8, 3), (8, 4)" in doc and "nslots=" in doc and "changes" in doc


def test_rank_note_names_the_ranks_that_disagree():
    """Ranks 0-3 get rank 0's sum; rank 4 adds the inputs itself, in another order."""
    def star(rank, n):
        others = tuple(q for q in range(1, n))
        if rank == 0:
            steps = (send(0, n - 1), Step("recv_reduce_copy_send", 0, others, others[:-1]))
        elif rank == n - 1:
            steps = (send(0, 0), recv_reduce_copy(0, tuple(range(n - 2, -1, -1))))
        else:
            steps = (send(0, (0, n - 1)), recv(0, 0))
        return Schedule("all_reduce", "star", rank, n, 1, SPLIT, SPLIT, steps)
    rep = ringcomm.verify("all_reduce", star, 5, 10)
    assert rep.ok and not rep.rank_identical, rep.summary()
    assert rep.rank_note == ("chunk 0: ranks 0-3: ((((x0 + x1) + x2) + x3) + x4); "
                             "rank 4: ((((x4 + x3) + x2) + x1) + x0)")
    many = ringcomm.verify("all_reduce", "oneshot", 9, 10)  # every rank its own order
    assert "rank 0:" in many.rank_note and "ranks 4-8: 5 other orders" in many.rank_note


# ---- real processes: the executor does what the model says ------------------------------------

PLANTED = {"late_send": ("all_reduce", late_send), "echo": ("all_gather", echo_all_gather),
           "early_copy": ("reduce_scatter", early_copy_reduce_scatter),
           "greedy": ("reduce", all_reduce_as_reduce)}


def _run_planted(comm, name, in_place):
    """Run a planted schedule unchecked (as a registration that let it through would), with
    inputs 10^rank, and return what this rank's buffers hold afterwards."""
    collective, builder = PLANTED[name]
    catalogue.add(collective, name, builder)
    n, r, count = comm.world_size, comm.rank, 4
    if collective == "all_gather":
        out = np.full(n * count, -1.0)
        x = out[r * count:(r + 1) * count] if in_place else np.empty(count)
        x[...] = 10.0 ** r
        comm.all_gather(x, out, algo=name)
        return out.tolist()
    if collective == "reduce_scatter":  # block b of rank r holds 10^r + 1000 b
        x = np.repeat(10.0 ** r + 1000.0 * np.arange(n), count)
        out = x[r * count:(r + 1) * count] if in_place else np.empty(count)
        comm.reduce_scatter(x, out, algo=name)
        return out.tolist()
    x = np.full(count, 10.0 ** r)
    out = None if in_place else np.zeros(count)
    if collective == "reduce":
        comm.reduce(x, root=0, out=out, algo=name)
    else:
        comm.all_reduce(x, out=out, algo=name)
    return (x if in_place else out).tolist()


def _run_builtins_in_place(comm, count):
    """Every built-in algorithm of every collective, in place, against numpy."""
    n, r, wrong = comm.world_size, comm.rank, []
    inputs = [np.arange(count * n, dtype=np.float64) * (q + 1) + q for q in range(n)]
    for collective, algos in catalogue.ALGOS.items():
        if collective == "all_to_all":
            continue  # no in-place form: out may not overlap buf
        for algo in (a for a in algos if a not in PLANTED and a not in catalogue.REGISTERED_ONLY):
            if collective == "gather":  # in place on the root: buf is out's block root
                x = np.zeros(count * n)
                x[r * count:(r + 1) * count] = inputs[r][:count]
                comm.gather(x[r * count:(r + 1) * count], x if r == 1 else None, root=1, algo=algo)
                want = np.concatenate([i[:count] for i in inputs]) if r == 1 else x
            elif collective == "scatter":  # in place on the root: out is buf's block root
                x = inputs[r].copy() if r == 0 else np.zeros(count)
                comm.scatter(x if r == 0 else None, x[:count], root=0, algo=algo)
                x, want = x[:count], inputs[0][r * count:(r + 1) * count]
            elif collective == "all_reduce":
                x = inputs[r][:count].copy()
                comm.all_reduce(x, algo=algo)
                want = sum(i[:count] for i in inputs)
            elif collective == "reduce":
                x = inputs[r][:count].copy()
                comm.reduce(x, root=1, algo=algo)
                want = sum(i[:count] for i in inputs) if r == 1 else inputs[r][:count]
            elif collective == "broadcast":
                x = inputs[r][:count].copy()
                comm.broadcast(x, root=2 % n, algo=algo)
                want = inputs[2 % n][:count]
            elif collective == "all_gather":
                x = np.zeros(count * n)
                x[r * count:(r + 1) * count] = inputs[r][:count]
                comm.all_gather(x[r * count:(r + 1) * count], x, algo=algo)
                want = np.concatenate([i[:count] for i in inputs])
            else:
                x = inputs[r].copy()
                comm.reduce_scatter(x, x[r * count:(r + 1) * count], algo=algo)
                x, want = x[r * count:(r + 1) * count], sum(inputs)[r * count:(r + 1) * count]
            if not np.array_equal(x, want):
                wrong.append((collective, algo, count))
    return wrong


@pytest.fixture(scope="module")
def world3():
    with World(3, {"RINGCOMM_BUFFSIZE": "4096", "RINGCOMM_NSLOTS": "4"}, timeout=60) as w:
        yield w


def test_executor_agrees_with_the_model_on_planted_in_place_faults(world3):
    """Each planted schedule is right out of place and wrong in place, exactly where verify said."""
    out_of_place = {name: world3.run(_run_planted, name, False, timeout=60) for name in PLANTED}
    in_place = {name: world3.run(_run_planted, name, True, timeout=60) for name in PLANTED}
    assert out_of_place["late_send"] == [[111.0] * 4] * 3
    assert in_place["late_send"] == [[212.0] * 4, [111.0] * 4, [212.0] * 4]  # the numbers
    right_gather = [1.0] * 4 + [10.0] * 4 + [100.0] * 4
    assert out_of_place["echo"] == [right_gather] * 3
    assert all(got[:4] == [10.0] * 4 for got in in_place["echo"])  # rank 1's block where rank 0's belongs
    right_scatter = [[111.0 + 3000.0 * r] * 4 for r in range(3)]
    assert out_of_place["early_copy"] == right_scatter
    assert all(got != want for got, want in zip(in_place["early_copy"], right_scatter))
    assert out_of_place["greedy"][0] == [111.0] * 4
    assert in_place["greedy"] == [[111.0] * 4] * 3  # ranks 1 and 2 lost their input (reduce's root is 0)
    kinds = {"late_send": {F.READ_AFTER_WRITE}, "echo": {F.READ_AFTER_WRITE},
             "early_copy": {F.READ_AFTER_WRITE}, "greedy": {F.CLOBBER}}
    for name, (collective, builder) in PLANTED.items():
        rep = ringcomm.verify(collective, builder, 3, 4, root=0 if collective in ROOTED else None)
        assert rep.kinds == kinds[name] and all(f.form == IN_PLACE for f in rep.failures), rep.summary()


def test_builtins_in_place_on_real_processes(world3):
    for count in (7, 1000):  # one slice and several (4 KiB FIFO of 4 slots)
        assert world3.run(_run_builtins_in_place, count, timeout=120) == [[]] * 3
