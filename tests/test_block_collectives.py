"""all_to_all, gather and scatter: their arguments, packed counts, and their schedules.

The data itself runs in the collective matrix (tests/cases.py, test_collectives.py); here: bad
input refused before any byte moves (on one process, and on every rank of a world, which stays
usable), RINGCOMM_DEBUG=check naming counts that disagree, which algorithms may move packed
counts, and the schedules under the simulator with the zero-length blocks packed counts make.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import ringcomm
from harness import World
from ringcomm import catalogue, vcounts
from ringcomm.schedule.alltoall import is_direct
from ringcomm.schedule.simulate import simulate
from ringcomm.schedule.step import FROM, TO, chunk_span


@pytest.fixture
def comm():
    with ringcomm.init() as c:
        yield c


def test_world_of_one(comm):
    x = np.arange(6, dtype=np.int32)
    out = np.zeros(6, np.int32)
    assert comm.all_to_all(x, out) is out and (out == x).all()
    out[:] = 0
    comm.all_to_all(x, out, send_counts=np.array([6]), recv_counts=(6,), algo="pairwise")
    assert (out == x).all()
    whole = np.zeros(6, np.int32)
    assert comm.gather(x, whole) is whole and (whole == x).all()
    assert comm.gather(whole, whole) is whole             # in place: buf is the root's own block
    mine = np.zeros(6, np.int32)
    assert comm.scatter(x, mine, 0, algo="binomial") is mine and (mine == x).all()
    comm.scatter(whole, whole)                             # in place: out is the root's own block


@pytest.mark.parametrize("kw, exc, match", [
    (dict(send_counts=[4]), ValueError, "pass both or neither"),
    (dict(recv_counts=[4]), ValueError, "pass both or neither"),
    (dict(send_counts=[4.0], recv_counts=[4]), TypeError, "must hold ints"),
    (dict(send_counts=[True], recv_counts=[4]), TypeError, "must hold ints"),
    (dict(send_counts="4", recv_counts=[4]), TypeError, "list, tuple or integer array"),
    (dict(send_counts={4}, recv_counts=[4]), TypeError, "list, tuple or integer array"),
    (dict(send_counts=np.array([4.0]), recv_counts=[4]), TypeError, "1-D integer array"),
    (dict(send_counts=np.array([[4]]), recv_counts=[4]), TypeError, "1-D integer array"),
    (dict(send_counts=[2, 2], recv_counts=[4]), ValueError, "2 entries, expected world_size = 1"),
    (dict(send_counts=[-4], recv_counts=[4]), ValueError, ">= 0"),
    (dict(send_counts=[3], recv_counts=[3]), ValueError, r"sum\(send_counts\)"),
    (dict(send_counts=[4], recv_counts=[5]), ValueError, r"sum\(recv_counts\)"),
    (dict(algo="nope"), ValueError, "no algorithm 'nope'"),
])
def test_all_to_all_bad_counts(comm, kw, exc, match):
    x, out = np.arange(4, dtype=np.float32), np.full(4, -1, np.float32)
    with pytest.raises(exc, match=match):
        comm.all_to_all(x, out, **kw)
    assert (out == -1).all()


def test_all_to_all_bad_buffers(comm):
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(ValueError, match="overlap"):
        comm.all_to_all(x, x)
    with pytest.raises(ValueError, match="overlap"):
        comm.all_to_all(x[:4], x[2:6])
    with pytest.raises(TypeError, match="dtypes differ"):
        comm.all_to_all(x, np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="expected 8"):
        comm.all_to_all(x, np.zeros(7, np.float32))
    with pytest.raises(TypeError, match="numpy array"):
        comm.all_to_all([1.0], np.zeros(1, np.float32))


def test_gather_and_scatter_bad_arguments(comm):
    x, y = np.ones(4, np.int32), np.ones(8, np.int32)
    for call, match in [(lambda: comm.gather(x), "must pass out"),
                        (lambda: comm.gather(x, np.zeros(5, np.int32)), "expected 4"),
                        (lambda: comm.gather(x, np.zeros(4, np.int64)), "dtypes differ"),
                        (lambda: comm.gather(x, x, root=1), "out of range"),
                        (lambda: comm.scatter(None, x), "must pass buf"),
                        (lambda: comm.scatter(x, np.zeros(3, np.int32)), "expected 3"),
                        (lambda: comm.scatter(y[:4], y[2:6]), "overlap"),
                        (lambda: comm.gather(y[2:6], y[:4]), "overlap"),
                        (lambda: comm.scatter(x, x, root=-1), "out of range")]:
        with pytest.raises((TypeError, ValueError), match=match):
            call()


def test_counts_accepted_as_lists_tuples_and_integer_arrays():
    for given in ([1, 0, 2], (1, 0, 2), np.array([1, 0, 2], np.uint8), np.array([1, 0, 2], np.int64)):
        assert vcounts.counts_tuple(given, 3, "c") == (1, 0, 2)
    torch = pytest.importorskip("torch", reason="torch split sizes as a tensor")
    assert vcounts.counts_tuple(torch.tensor([1, 0, 2]), 3, "c") == (1, 0, 2)
    with pytest.raises(TypeError, match="1-D integer array"):
        vcounts.counts_tuple(torch.tensor([1.0, 0.0, 2.0]), 3, "c")
    assert vcounts.spans((1, 0, 2)) == ((0, 1), (1, 0), (1, 2))


def test_only_direct_algorithms_take_packed_counts():
    for n in range(1, 9):
        pw = [catalogue.build_schedule("all_to_all", "pairwise", r, n, None) for r in range(n)]
        br = [catalogue.build_schedule("all_to_all", "bruck", r, n, None) for r in range(n)]
        assert all(is_direct(s) for s in pw)
        assert all(is_direct(s) for s in br) == (n <= 3)  # from 4 ranks up Bruck forwards (j = 3)
    assert vcounts.direct_algo(None, "", 4) == "pairwise"
    assert vcounts.direct_algo(None, "bruck", 4) == "pairwise"  # RINGCOMM_ALGO=bruck: not here
    assert vcounts.direct_algo(None, "pairwise", 4) == "pairwise"
    with pytest.raises(ValueError, match="forwards blocks through other ranks"):
        vcounts.direct_algo("bruck", "", 4)


def test_registered_all_to_all_takes_counts_if_direct():
    from ringcomm.schedule.alltoall import bruck_all_to_all, pairwise_all_to_all
    try:
        ringcomm.register_algorithm("mine", "all_to_all", bruck_all_to_all)
        with pytest.raises(ValueError, match="forwards blocks"):
            vcounts.direct_algo("mine", "", 4)
        ringcomm.register_algorithm("mine", "all_to_all", pairwise_all_to_all, replace=True)
        assert vcounts.direct_algo("mine", "", 4) == "mine"  # looked at afresh once replaced
        assert vcounts.direct_algo(None, "mine", 4) == "mine"  # RINGCOMM_ALGO=mine
    finally:
        ringcomm.unregister_algorithm("mine", "all_to_all")


def test_packed_layout_cuts_every_block_alike_on_both_ends():
    n, blocks = 3, ((0, 5), (5, 0), (5, 2))
    # chunk 1 * 3 + 2: rank 1's block for rank 2, in the sender's input (TO) at block 2
    assert chunk_span(TO, n * n, 5, 0, 4, 5, blocks) == (5, 2)
    assert chunk_span(TO, n * n, 5, 4, 8, 5, blocks) == (7, 0)    # a later round: empty
    assert chunk_span(FROM, n * n, 5, 4, 8, 5, blocks) == (5, 0)  # block 1 is empty
    assert chunk_span(FROM, n * n, 2, 4, 8, 5, blocks) == (4, 1)  # block 0, its last element
    assert chunk_span(TO, n * n, 4, 2, 4, 10) == (12, 2)          # equal blocks of 10


def _drop_empty(scheds, c):
    """The schedules as packed counts run them: a step on a block of no elements moves nothing."""
    import dataclasses
    n = len(scheds)
    return [dataclasses.replace(s, steps=tuple(st for st in s.steps if c[st.chunk // n][st.chunk % n]),
                                stages=()) for s in scheds]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_pairwise_with_empty_blocks_never_deadlocks(n):
    """Packed counts with zeros skip those blocks at both ends; what is left still finishes, with
    every non-empty block where it belongs, at the FIFO shapes the executor uses."""
    rnd = random.Random(n)
    base = catalogue.schedules("all_to_all", "pairwise", n)
    for _ in range(20):
        c = [[rnd.choice((0, 1)) for _ in range(n)] for _ in range(n)]
        for nslots in (2, 4, 8):
            res = simulate(_drop_empty(base, c), nslots=nslots, slices=nslots // 2, rounds=2)
            for s in range(n):
                for d in range(n):
                    got = res.outputs[d][s * n + d]
                    assert (got and got.terms) == (((s, s * n + d),) if c[s][d] else None), (c, s, d)


# ---- on every rank of a world ------------------------------------------------------------------

def _refusals(comm):
    """Bad calls on every rank, then a good one: nothing moved, the communicator still works."""
    n, r = comm.world_size, comm.rank
    errors = []
    x, out = np.arange(n, dtype=np.int64) + 10 * r, np.zeros(n, np.int64)
    for call in (lambda: comm.all_to_all(x, out, send_counts=[1] * n, recv_counts=[1] * n, algo="bruck"),
                 lambda: comm.gather(x, out if r != 0 else None, root=0),
                 lambda: comm.scatter(x if r != n - 1 else None, out[:1], root=n - 1)):
        try:
            call()
            errors.append("accepted")
        except ValueError as e:
            errors.append(str(e).split(":")[0])
    comm.all_to_all(x, out, send_counts=[1] * n, recv_counts=[1] * n)
    return errors, out.tolist()


def _mismatched_counts(comm):
    n, r = comm.world_size, comm.rank
    send = [1] * n
    recv = [2 if (r == 2 and i == 0) else 1 for i in range(n)]  # rank 2 expects 2 from rank 0
    x, out = np.ones(sum(send), np.float32), np.zeros(sum(recv), np.float32)
    try:
        comm.all_to_all(x, out, send_counts=send, recv_counts=recv)
        first = "no error"
    except ringcomm.RingcommError as e:
        first = f"{type(e).__name__}: {e}"
    y = np.zeros(n, np.float32)
    comm.all_to_all(np.full(n, r, np.float32), y)  # still usable: nothing moved
    return first, y.tolist(), bool((out == 0).all())


@pytest.mark.timeout(120)
def test_refusals_and_counts_check_on_every_rank():
    with World(4, {"RINGCOMM_DEBUG": "check", "RINGCOMM_ALGO": "bruck"}, timeout=30) as w:
        for r, (errors, got) in enumerate(w.run(_refusals, timeout=60)):
            assert errors[0].startswith("all_to_all algo='bruck'")
            assert errors[1] == "gather", errors            # root without out, others with one
            assert errors[2] == "scatter", errors
            assert got == [10 * i + r for i in range(4)]
        results = w.run(_mismatched_counts, timeout=60)
    texts = {first.split(": ", 1)[1].split(": ", 1)[1] for first, _, _ in results}
    assert len(texts) == 1, texts  # the same words on every rank
    for r, (first, y, untouched) in enumerate(results):
        assert first.startswith(f"CollectiveMismatch: rank {r} (this process): all_to_all counts disagree"), first
        assert "rank 0 sends rank 2 1 elements but rank 2 expects 2" in first, first
        assert y == [0.0, 1.0, 2.0, 3.0] and untouched


def _ring_gather(n, root):
    """Each block walks the ring to the root, forwarded on the way without being kept."""
    from ringcomm.schedule.lang import Program
    p = Program("gather", n, n)
    for c in range(n):
        v, r = p.chunk(c, c), c
        while r != root:
            r = (r + 1) % n
            v = v.copy(r, output=r == root)
        if c == root:
            v.output()
    return p


def _direct_all_to_all(n):
    from ringcomm.schedule.lang import Program
    p = Program("all_to_all", n, n * n)
    for s in range(n):
        for d in range(n):
            v = p.chunk(s, s * n + d)  # rank s's block for d
            v.output() if s == d else v.copy(d)
    return p


def test_programs_for_gather_and_all_to_all():
    from ringcomm.schedule.lang import Program, ProgramError, program_builder
    try:
        ringcomm.register_algorithm("ring", "gather", program_builder(_ring_gather))      # checked at 1..8
        ringcomm.register_algorithm("direct", "all_to_all", program_builder(_direct_all_to_all))
        assert ringcomm.verify("gather", "ring", 5, 100, root=2).ok
        assert ringcomm.verify("all_to_all", "direct", 5, 100).ok
        assert vcounts.direct_algo("direct", "", 5) == "direct"  # so it takes packed counts
    finally:
        ringcomm.unregister_algorithm("ring", "gather")
        ringcomm.unregister_algorithm("direct", "all_to_all")
    with pytest.raises(ProgramError, match="owns chunks 3 .. 5"):
        Program("all_to_all", 3, 9).chunk(1, 2)
    with pytest.raises(ValueError, match="nchunks must be 9"):
        Program("all_to_all", 3, 3)


def test_verify_sees_the_memory_a_block_chunk_lands_in():
    """Under FROM, chunks s * n + 0 .. s * n + n-1 all land in output block s: a rank keeping a
    block bound elsewhere overwrites its own. Found by tests/test_verify_soundness.py's mutants."""
    import dataclasses
    from ringcomm.schedule.step import copy_send
    from ringcomm.schedule.verify import verify_schedules
    scheds = catalogue.schedules("all_to_all", "bruck", 3)
    assert str(scheds[0].steps[1]) == "send(1, to=[1])"
    steps = list(scheds[0].steps)
    steps[1] = copy_send(1, 1)  # rank 0 also keeps its block for rank 1: over block 0, its own
    scheds[0] = dataclasses.replace(scheds[0], steps=tuple(steps))
    rep = verify_schedules("all_to_all", scheds, 10)
    assert not rep.ok and "rank 0 output chunk 0" in rep.summary(), rep.summary()
