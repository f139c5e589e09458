"""ringcomm.verify: postcondition, reduction orders, determinism certificate, shortest deadlock trace."""
from __future__ import annotations

import dataclasses
import random

import pytest

import ringcomm
from ringcomm import catalogue
from ringcomm.schedule.ring import ring_all_reduce
from ringcomm.schedule.step import SPLIT, Schedule, recv, recv_reduce_copy, recv_reduce_copy_send, send
from ringcomm.schedule.verify import FIFOS, chunk_span, deadlock, verify_schedules

BUILTIN = sorted((c, a) for c, algos in catalogue.ALGOS.items() for a in algos
                 if (c, a) not in ringcomm.algorithms.USER)


@pytest.mark.parametrize("collective,algo", BUILTIN)
def test_every_builtin_algorithm_verifies_at_1_to_9(collective, algo):
    for n in range(1, 10):
        for root in ((0, n - 1) if collective in catalogue.ROOTED else (None,)):
            rep = ringcomm.verify(collective, algo, n, 1000, root=root)
            assert rep.ok, rep.summary()
            assert set(rep.deadlocks) == set(FIFOS)
            if collective == "all_reduce" and algo == "oneshot":  # each rank starts from its own input
                assert rep.identical_up_to_commutation == (n <= 2), rep.summary()
            elif collective == "all_reduce" and algo == "doubling":  # partners fold a op b and b op a
                assert rep.identical_up_to_commutation and (rep.rank_identical == (n == 1)), rep.summary()
            elif collective == "all_reduce":
                assert rep.rank_identical, rep.summary()  # MPI: every rank gets the same bits
            if collective in ("all_reduce", "reduce", "reduce_scatter"):
                assert rep.orders[0][0] == 0 and rep.orders[-1][1] == 1000
                assert all(a < b for a, b, _ in rep.orders)


def _ring(n):
    return [ring_all_reduce(r, n) for r in range(n)]


def _replace(scheds, rank, index, step):
    steps = list(scheds[rank].steps)
    if step is None:
        del steps[index]
    else:
        steps[index] = step
    scheds[rank] = dataclasses.replace(scheds[rank], steps=tuple(steps))
    return scheds


def test_planted_wrong_chunk_index_caught():
    scheds = _ring(4)
    s = scheds[2].steps[1]  # recv_reduce_send of the wrong chunk, on one rank
    broken = _replace(scheds, 2, 1, type(s)(s.kind, (s.chunk + 1) % 4, s.src, s.dst))
    rep = verify_schedules("all_reduce", broken, 100)
    assert not rep.ok and "connection" in rep.postcondition and "chunks" in rep.postcondition


def test_planted_missing_step_caught():
    broken = _replace(_ring(5), 3, 2, None)
    rep = verify_schedules("all_reduce", broken, 100)
    assert not rep.ok and "connection 2->3" in rep.postcondition
    # consistently missing on both ends: rank 3 never gets its last chunk, rank 2 never sends it
    scheds = _replace(_ring(5), 3, -1, None)
    last = scheds[2].steps[-2]
    broken = _replace(scheds, 2, -2, recv(last.chunk, last.src))
    rep = verify_schedules("all_reduce", broken, 100)
    assert not rep.ok and "rank 3 output chunk 4 is None" in rep.postcondition


def test_planted_double_count_caught():
    scheds = _ring(3)
    s = scheds[1].steps[3]  # recv_copy_send made to reduce again
    broken = _replace(scheds, 1, 3, recv_reduce_copy_send(s.chunk, s.src, s.dst))
    assert "counted twice" in verify_schedules("all_reduce", broken, 10).postcondition


def _send_all_first(rank):
    """All-reduce on 2 ranks, 6 chunks: each rank first sends the 3 chunks the other one
    finishes, then finishes its own 3 and sends them back. Right with unbounded FIFOs; with a
    small FIFO both ranks fill it before either receives."""
    peer, mine, theirs = 1 - rank, range(3 * rank, 3 * rank + 3), range(3 - 3 * rank, 6 - 3 * rank)
    steps = [send(c, peer) for c in theirs]
    steps += [recv_reduce_copy_send(c, peer, peer) for c in mine]
    steps += [recv(c, peer) for c in theirs]
    return Schedule("all_reduce", "send_all_first", rank, 2, 6, SPLIT, SPLIT, tuple(steps))


def test_planted_ordering_that_deadlocks_with_small_fifo_has_shortest_trace():
    rep = verify_schedules("all_reduce", [_send_all_first(0), _send_all_first(1)], 600)
    assert rep.postcondition is None, "correct with unbounded FIFOs"
    assert rep.deadlocks[8, 1] is None, "fine while 3 small messages fit in 8 slots"
    trace = rep.deadlocks[2, 1]
    assert trace and not rep.ok
    # the shortest run: each rank posts the 2 slices its FIFO holds, then both wait for a slot
    assert "ranks [0, 1] wait for each other; the shortest run into it has 4 events" in trace
    assert trace.count("posts to") == 4 and trace.count("waits for a free slot") == 2
    assert "the shortest run into it has 16 events" in rep.deadlocks[8, 4]  # 8 slices each


def test_one_slot_deadlocks_every_ring_and_init_refuses_it(monkeypatch):
    """A step holds its incoming slot until it has an outgoing one, so one slot deadlocks the
    ring; the trace is the n sends that fill every FIFO. init() refuses RINGCOMM_NSLOTS=1."""
    for n in (2, 3, 5):
        trace = deadlock(_ring(n), 1, 1)
        assert f"the shortest run into it has {n} events" in trace
    rep = ringcomm.verify("all_reduce", "ring", 3, 100, nslots=1)   # asked of verify: what would happen
    assert not rep.ok and rep.postcondition is None and rep.deadlocks[2, 1] is None
    assert "the shortest run into it has 3 events" in rep.deadlocks[1, 1]
    monkeypatch.setenv("RINGCOMM_NSLOTS", "1")
    with pytest.raises(ValueError, match="RINGCOMM_NSLOTS=1 must be at least 2"):
        ringcomm.init(0, 1)


def test_shortest_trace_leaves_out_unrelated_ranks():
    """Ranks 0 and 1 deadlock while ranks 2..4 run a long ring of their own: the trace holds
    only the 4 events of the stuck pair, not the dozens of the others."""
    pair = [_send_all_first(0), _send_all_first(1)]
    ring3 = _ring(3)
    scheds = []
    for r in range(5):
        if r < 2:
            s = pair[r]
            scheds.append(dataclasses.replace(s, world_size=5))
        else:
            s = ring3[r - 2]
            steps = tuple(type(st)(st.kind, st.chunk, tuple(p + 2 for p in st.src),
                                   tuple(p + 2 for p in st.dst)) for st in s.steps)
            scheds.append(Schedule("all_reduce", "mix", r, 5, 6, SPLIT, SPLIT,
                                   tuple(type(st)(st.kind, st.chunk % 3, st.src, st.dst) for st in steps)))
    trace = deadlock(scheds, 2, 1)
    assert "ranks [0, 1]" in trace and "has 4 events" in trace
    assert "rank 2" not in trace and "rank 3" not in trace


def test_orders_and_determinism_certificate():
    rep = ringcomm.verify("all_reduce", "ring", 3, 7)
    # 7 elements, 3 chunks: [0,3) [3,5) [5,7); chunk c's sum starts at rank c+1 and ends at rank c
    assert [(a, b) for a, b, _ in rep.orders] == [(0, 3), (3, 5), (5, 7)]
    assert rep.orders[0][2] == "(x0 + (x2 + x1)) then post-op"
    assert rep.rank_identical and not rep.size_independent
    assert "element 1 is in chunk" in rep.witness
    rs = ringcomm.verify("reduce_scatter", "ring", 4, 1000)
    assert rs.size_independent and rs.orders == [(0, 1000, "(x0 + (x3 + (x2 + x1))) then post-op")]
    assert ringcomm.verify("reduce", "tree", 6, 10, root=2).size_independent


def test_ranks_disagreeing_on_the_order_are_reported():
    """Every rank adds the others' inputs to its own: x0+x1+x2 on rank 0, x1+x0+x2 on rank 1."""
    def direct(rank, n):
        others = tuple(q for q in range(n) if q != rank)
        steps = (send(0, others), recv_reduce_copy(0, others)) if n > 1 else ()
        return Schedule("all_reduce", "direct", rank, n, 1, SPLIT, SPLIT, steps)
    two = verify_schedules("all_reduce", [direct(r, 2) for r in range(2)], 5)
    assert two.ok and not two.rank_identical and two.identical_up_to_commutation
    three = verify_schedules("all_reduce", [direct(r, 3) for r in range(3)], 5)
    assert three.ok and not three.identical_up_to_commutation
    assert "rank 0: ((x0 + x1) + x2); rank 1: ((x1 + x0) + x2)" in three.rank_note


def test_builder_failure_is_reported_not_raised():
    def broken(rank, n):
        raise RuntimeError("no schedule for you")
    ringcomm.register_algorithm("broken_at_5", "all_reduce",
                                lambda r, n: broken(r, n) if n == 5 else ring_all_reduce(r, n), sizes=(2,))
    try:
        rep = ringcomm.verify("all_reduce", "broken_at_5", 5, 10)
        assert not rep.ok and "no schedule for you" in rep.postcondition
    finally:
        ringcomm.unregister_algorithm("broken_at_5", "all_reduce")


def test_chunk_span_cuts_each_round_into_even_contiguous_chunks():
    """The executor and the verifier share step.chunk_span; its SPLIT cut covers the round
    exactly, in order, with lengths that differ by at most one."""
    rnd = random.Random(5)
    for _ in range(2000):
        nchunks, m = rnd.randint(1, 9), rnd.randint(0, 50)
        a = rnd.randint(0, m)
        b = rnd.randint(a, m)
        spans = [chunk_span("split", nchunks, c, a, b, m) for c in range(nchunks)]
        assert spans[0][0] == a and sum(n for _, n in spans) == b - a
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))
        assert max(n for _, n in spans) - min(n for _, n in spans) <= 1
        c = rnd.randrange(nchunks)
        assert chunk_span("block", nchunks, c, a, b, m) == (c * m + a, b - a)
        assert chunk_span("own", nchunks, c, a, b, m) == (a, b - a)


def _order_ranges(comm, count: int):
    """all_reduce of 2**24, 1, 1 (float32) on ranks 0, 1, 2: an element is 16777218 exactly when
    x0 was added last, (x0 + (x2 + x1)); its ranges on rank 0, and the engine that ran the call."""
    import numpy as np
    x = np.full(count, [2.0 ** 24, 1.0, 1.0][comm.rank], np.float32)
    comm.all_reduce(x, algo="ring")
    hit = np.flatnonzero(x == np.float32(16777218)).tolist()
    ranges = []
    for i in hit:
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return [tuple(r) for r in ranges], comm._executor.engine


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "python"])
def test_the_orders_verify_reports_are_the_orders_the_executor_computes(engine):
    """verify() cuts the call as the executor does, engine included: the native engine's slices
    (RINGCOMM_SLICE, 256 KiB) or, with RINGCOMM_ENGINE=python, whole slots. 1M floats cross several
    rounds of the native cut (one round of whole slots), each round's chunks in the three orders.
    (verify cut whole slots for both: 1 range reported, 2 computed by the native engine.)"""
    from harness import World
    count = 1_000_000
    with World(3, {"RINGCOMM_ENGINE": engine}, timeout=60) as w:
        (ranges, ran), *_ = w.run(_order_ranges, count, timeout=90)
    assert ran == engine
    rep = ringcomm.verify("all_reduce", "ring", 3, count, slice_bytes=None if engine == "python" else 256 << 10)
    want = [(a, b) for a, b, order in rep.orders if order.startswith("(x0 + (x2 + x1))")]
    assert ranges == want and len(want) == (1 if engine == "python" else 2), (ranges, rep.orders)


def test_verify_slices_as_the_native_engine_by_default():
    from ringcomm.assemble import DEFAULT_SLICE
    from ringcomm.schedule.verify import NATIVE_SLICE
    assert NATIVE_SLICE == DEFAULT_SLICE
