"""Schedules checked symbolically: right result, no double counting, no deadlock.

No processes and no data: simulate.py runs every rank's steps over modelled
FIFOs of ``nslots`` slots, the executor's model, and check() compares what each
rank ends with against the collective's meaning.
"""
from __future__ import annotations

import dataclasses

import pytest

from ringcomm.schedule.p2p import barrier, p2p_recv, p2p_send
from ringcomm.schedule.ring import (ring_all_gather, ring_all_reduce, ring_broadcast,
                                    ring_reduce, ring_reduce_scatter)
from ringcomm.schedule.simulate import ScheduleError, check, simulate
from ringcomm.schedule.step import SPLIT, Schedule, recv, recv_reduce_copy, recv_reduce_copy_send, \
    recv_reduce_send, send
from ringcomm.schedule.tree import (K, _lagged, double_binary_tree, tree_all_reduce, tree_broadcast,
                                    tree_reduce)

SIZES = list(range(1, 10)) + [16]
ROOTED = {"ring_broadcast": ("broadcast", ring_broadcast), "ring_reduce": ("reduce", ring_reduce),
          "tree_broadcast": ("broadcast", tree_broadcast), "tree_reduce": ("reduce", tree_reduce)}
UNROOTED = {"ring_all_reduce": ("all_reduce", ring_all_reduce),
            "ring_reduce_scatter": ("reduce_scatter", ring_reduce_scatter),
            "ring_all_gather": ("all_gather", ring_all_gather),
            "tree_all_reduce": ("all_reduce", tree_all_reduce),
            "barrier": ("barrier", barrier)}
# nslots x rounds the executor may use; slices = nslots // 2 keeps the tree's root able
# to run one chunk ahead of its children (tree.py's docstring).
FIFO_SHAPES = [(nslots, rounds) for nslots in (2, 4, 8) for rounds in (1, 2, 3)]


def build(fn, n, *args):
    return [fn(r, n, *args) for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(UNROOTED))
def test_unrooted(name, n):
    collective, fn = UNROOTED[name]
    for nslots, rounds in FIFO_SHAPES:
        check(collective, build(fn, n), nslots=nslots, slices=nslots // 2, rounds=rounds)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(ROOTED))
def test_rooted_every_root(name, n):
    collective, fn = ROOTED[name]
    for root in range(n):
        check(collective, build(fn, n, root), root=root)
    for nslots, rounds in FIFO_SHAPES:  # the deep chains: root 0 and the last rank
        for root in {0, n - 1}:
            check(collective, build(fn, n, root), root=root, nslots=nslots,
                  slices=nslots // 2, rounds=rounds)


def test_outputs_are_symbolic_sums():
    res = check("all_reduce", build(tree_all_reduce, 5))
    value = res.outputs[3][K + 1]
    assert value.terms == tuple((r, K + 1) for r in range(5)) and value.post
    assert res.messages > 0
    gathered = check("all_gather", build(ring_all_gather, 3), rounds=1).outputs
    assert [v.terms for v in gathered[1]] == [((0, 0),), ((1, 1),), ((2, 2),)]


@pytest.mark.parametrize("n", [4, 5, 8, 16])
def test_tree_all_reduce_uses_both_trees(n):
    """Chunks 0..K-1 finish at tree 0's root (rank 0), K..2K-1 at tree 1's."""
    tree0, tree1 = double_binary_tree(n)
    roots = [next(r for r, (p, _) in enumerate(t) if p is None) for t in (tree0, tree1)]
    assert roots[0] != roots[1]
    res = check("all_reduce", build(tree_all_reduce, n), rounds=1)
    finishers = {step.chunk: rank for _, rank, _, step, _ in res.finals}
    assert finishers == {c: roots[c // K] for c in range(2 * K)}


def _assert_spanning_tree(tree, n):
    roots = [r for r, (p, _) in enumerate(tree) if p is None]
    assert len(roots) == 1
    for r, (p, kids) in enumerate(tree):
        assert all(tree[c][0] == r for c in kids)
        if p is not None:
            assert r in tree[p][1]
        seen = {r}
        while p is not None:  # climbing parents reaches the root without a cycle
            assert p not in seen
            seen.add(p)
            p = tree[p][0]


@pytest.mark.parametrize("n", range(2, 65))
def test_double_binary_tree_shape(n):
    trees = double_binary_tree(n)
    for t in trees:
        _assert_spanning_tree(t, n)
    for r in range(n):
        kids = [trees[0][r][1], trees[1][r][1]]
        assert len(kids[0]) + len(kids[1]) <= 2, "a rank handles at most two children in all"
        assert sum(not k for k in kids) <= 1, "a rank is a leaf in at most one tree"
        if n % 2 == 0 or r != 0:
            assert sum(bool(k) for k in kids) <= 1, "a rank is interior in at most one tree"
        else:  # NCCL's shifted tree for odd n: rank 0 has one child in each tree
            assert [len(k) for k in kids] == [1, 1]


def test_double_binary_tree_n8_matches_nccl():
    tree0, tree1 = double_binary_tree(8)
    assert tree0 == ((None, (4,)), (2, ()), (4, (1, 3)), (2, ()), (0, (2, 6)), (6, ()), (4, (5, 7)), (6, ()))
    assert tree1 == ((1, ()), (3, (2, 0)), (1, ()), (7, (5, 1)), (5, ()), (3, (6, 4)), (5, ()), (None, (3,)))


def test_p2p_and_barrier():
    n = 3
    idle = Schedule("send", "p2p", 1, n, 1, SPLIT, SPLIT, ())
    res = simulate([p2p_send(0, n, 2), idle, p2p_recv(2, n, 0)], rounds=3, nslots=2, slices=1)
    assert res.outputs[2][0].terms == ((0, 0),) and res.messages == 3
    with pytest.raises(ValueError):
        p2p_send(1, n, 1)
    assert len(barrier(0, 9).steps) == 8  # ceil(log2 9) = 4 send/recv pairs


# ---- broken schedules must be caught ---------------------------------------------------------

def _replace(schedules, rank, index, step):
    steps = list(schedules[rank].steps)
    if step is None:
        del steps[index]
    else:
        steps[index] = step
    schedules[rank] = dataclasses.replace(schedules[rank], steps=tuple(steps))
    return schedules


def test_missing_step_caught():
    broken = _replace(build(ring_all_reduce, 4), 1, -1, None)
    with pytest.raises(ScheduleError, match="connection 0->1"):
        check("all_reduce", broken)


def test_reduce_applied_twice_caught():
    scheds = build(ring_all_reduce, 3)
    i = next(i for i, s in enumerate(scheds[2].steps) if s.kind == "recv_copy_send")
    s = scheds[2].steps[i]
    broken = _replace(scheds, 2, i, recv_reduce_copy_send(s.chunk, s.src, s.dst))
    with pytest.raises(ScheduleError, match="counted twice"):
        check("all_reduce", broken)


def test_both_send_first_deadlocks_when_slices_exceed_slots():
    def sched(r):
        return Schedule("x", "swap", r, 2, 1, SPLIT, SPLIT, (send(0, 1 - r), recv(0, 1 - r)))
    simulate([sched(0), sched(1)], nslots=2, slices=2)
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate([sched(0), sched(1)], nslots=2, slices=3)
    assert "rank 1 round 0 step 0" in str(err.value) and "free slot on FIFO 1->0" in str(err.value)


def test_tree_all_reduce_needs_two_slots_per_slice():
    """The root runs one chunk ahead of its children: slices == nslots can deadlock."""
    with pytest.raises(ScheduleError, match="deadlock"):
        check("all_reduce", build(tree_all_reduce, 4), nslots=2, slices=2)


@pytest.mark.parametrize("n", [2, 3])
def test_double_tree_at_n2_n3_would_cross_messages(n):
    """Why tree_all_reduce falls back to one binomial tree for n <= 3."""
    tree0, tree1 = double_binary_tree(n)

    def forced(r):
        steps = _lagged([(tree0[r], range(K)), (tree1[r], range(K, 2 * K))])
        return Schedule("all_reduce", "tree", r, n, 2 * K, SPLIT, SPLIT, tuple(steps))
    with pytest.raises(ScheduleError, match="different order"):
        check("all_reduce", [forced(r) for r in range(n)])


def test_incomplete_final_step_caught():
    scheds = [Schedule("reduce", "bad", 0, 3, 1, SPLIT, SPLIT, (recv_reduce_copy(0, 1),)),
              Schedule("reduce", "bad", 1, 3, 1, SPLIT, SPLIT, (send(0, 0),)),
              Schedule("reduce", "bad", 2, 3, 1, SPLIT, SPLIT, ())]
    with pytest.raises(ScheduleError, match="final"):
        check("reduce", scheds, root=0)


def test_missing_post_processing_caught():
    """A complete sum that reaches the output without a final step would skip AVG's division."""
    scheds = [Schedule("reduce", "bad", 0, 3, 1, SPLIT, SPLIT, (send(0, 1), recv(0, 1))),
              Schedule("reduce", "bad", 1, 3, 1, SPLIT, SPLIT, (recv_reduce_send(0, (0, 2), 0),)),
              Schedule("reduce", "bad", 2, 3, 1, SPLIT, SPLIT, (send(0, 1),))]
    with pytest.raises(ScheduleError, match="final"):
        check("reduce", scheds, root=0)


def test_wrong_result_and_unanswered_recv_caught():
    with pytest.raises(ScheduleError, match="expected contributions"):
        check("broadcast", build(tree_broadcast, 5, 2), root=3)
    scheds = [Schedule("x", "bad", 0, 2, 1, SPLIT, SPLIT, (recv(0, 1),)),
              Schedule("x", "bad", 1, 2, 1, SPLIT, SPLIT, ())]
    with pytest.raises(ScheduleError, match="rank 1 sends chunks \\[\\]"):
        simulate(scheds)
