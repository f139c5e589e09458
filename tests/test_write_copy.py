"""write_copy: a rank's input chunk written straight into peers' outputs, and the simulator's
race check for it (schedule/peer_read.py). Schedules only: the runs on real ranks are in
test_cma_collectives.py (plain buffers) and test_registered.py (comm.alloc)."""
from __future__ import annotations

import pytest

import ringcomm
from ringcomm.schedule import faults as F
from ringcomm.schedule.cost import messages
from ringcomm.schedule.faults import ScheduleError
from ringcomm.schedule.onecopy import read_broadcast
from ringcomm.schedule.simulate import check
from ringcomm.schedule.spec import IN_PLACE
from ringcomm.schedule.step import (BLOCK, OWN, SPLIT, Schedule, Step, copy, read_copy, read_out_copy, sync,
                                    write_copy)
from ringcomm.viz import frames


def _gather(n, steps_of):
    return [Schedule("all_gather", "w", r, n, n, OWN, BLOCK, tuple(steps_of(r))) for r in range(n)]


def _written_gather(r, n=3):
    """all_gather by writes: each rank puts its block into every peer's output, then all sync."""
    others = [q for q in range(n) if q != r]
    return [copy(r), write_copy(r, others), sync(others)]


def test_the_step_and_its_flags():
    s = write_copy(1, [0, 2])
    assert (s.writes, s.reads, s.copies, s.reduces, s.remote) == (True, None, False, False, (0, 2))
    assert str(s) == "write_copy(1, writes=[0, 2])"
    assert not copy(0).writes and not read_copy(0, 1).writes
    with pytest.raises(ValueError, match="remote=peers"):
        Step("write_copy", 0)
    assert Schedule("broadcast", "w", 0, 2, 2, SPLIT, SPLIT, (write_copy(1, 1), sync(1))).registered


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_broadcast_root_writes_each_reader_one_chunk(n):
    for root in range(n):
        scheds = [read_broadcast(r, n, root) for r in range(n)]
        check("broadcast", scheds, root=root)  # both forms, every output cell
        writes = [(st.chunk, st.remote) for st in scheds[root].steps if st.writes]
        assert writes == [(r, (r,)) for r in range(n) if r != root]
        for r in range(n):
            if r != root:
                assert sorted(st.chunk for st in scheds[r].steps if st.reads) == [c for c in range(n) if c != r]


def test_all_gather_by_writes_is_race_free():
    check("all_gather", _gather(3, _written_gather))
    report = ringcomm.algorithms.verify("all_gather", _gather(3, _written_gather), 3, 1000)
    assert report.failures == [] and report.postcondition is None


def test_a_write_without_a_later_sync_is_malformed():
    scheds = _gather(3, lambda r: [copy(r), write_copy(r, [q for q in range(3) if q != r])])
    with pytest.raises(ScheduleError) as e:
        check("all_gather", scheds)
    assert e.value.kinds == {F.MALFORMED}
    assert "while this rank still writes into them" in str(e.value)


def test_a_write_into_itself_is_malformed():
    scheds = _gather(2, lambda r: [copy(r), write_copy(r, [r]), sync([1 - r])])
    with pytest.raises(ScheduleError) as e:
        check("all_gather", scheds)
    assert e.value.kinds == {F.MALFORMED}


def test_the_owner_writing_the_same_chunk_races():
    # 2-rank broadcast where the reader also reads chunk 1, which the root writes into it
    scheds = [Schedule("broadcast", "w", 0, 2, 2, SPLIT, SPLIT, (write_copy(1, 1), copy(0), copy(1), sync(1))),
              Schedule("broadcast", "w", 1, 2, 2, SPLIT, SPLIT, (read_copy(0, 0), read_copy(1, 0), sync(0)))]
    with pytest.raises(ScheduleError) as e:
        check("broadcast", scheds, root=0)
    races = [f for f in e.value.failures if f.kind == F.RACE]
    assert races and "rank 1's chunk 1" in races[0].detail, e.value
    assert races[0].form is None  # a race in both forms: both write the output chunk


def test_a_write_over_an_input_the_owner_still_reads_races_in_place_only():
    # all_gather in place: rank 1's buf is its output block 1. Rank 0 writes block 1 of rank 1's
    # output (its own block 0's data there would be misplaced, so write a chunk that lies over
    # rank 1's input) while rank 1 copies that input out to rank 0 -- unordered.
    def steps(r):
        if r == 0:
            return [copy(0), read_copy(1, 1), write_copy(1, 1), sync(1)]
        return [copy(1), read_copy(0, 0), sync(0)]
    with pytest.raises(ScheduleError) as e:
        check("all_gather", _gather(2, steps))
    kinds = {f.kind: f for f in e.value.failures}
    assert F.RACE in kinds and kinds[F.RACE].form == IN_PLACE, e.value


def test_syncs_order_a_write_before_a_later_read():
    # rank 0 writes its block into ranks 1 and 2, then syncs with both. Rank 2 touches nothing
    # before its first sync: after it, it reads block 1 from rank 1's output and copies block 0
    # from rank 0 over what rank 0 wrote there. Every access is ordered after the write.
    def steps(r):
        if r == 0:
            return [copy(0), write_copy(0, [1, 2]), read_copy(1, 1), read_copy(2, 2), sync([1, 2]), sync([1, 2])]
        if r == 1:
            return [copy(1), read_copy(2, 2), sync([0, 2]), sync([0, 2])]
        return [copy(2), sync([0, 1]), read_out_copy(1, 1), read_copy(0, 0), sync([0, 1])]
    check("all_gather", _gather(3, steps))


def test_a_third_rank_reading_the_written_chunk_unordered_races():
    # rank 0 writes its block into rank 1 only; rank 2 copies block 0 from rank 0 itself. Then a
    # variant where rank 2 takes block 0 from rank 1's output before any sync: rank 0 may still
    # be writing it there.
    def steps(r):
        if r == 0:
            return [copy(0), write_copy(0, 1), read_copy(1, 1), read_copy(2, 2), sync([1, 2])]
        if r == 1:
            return [copy(1), read_copy(2, 2), sync([0, 2])]
        return [copy(2), read_copy(0, 0), read_copy(1, 1), sync([0, 1])]
    check("all_gather", _gather(3, steps))  # the control: nobody reads what rank 0 writes

    def racy(r):
        if r == 2:
            return [copy(2), read_out_copy(0, 1), read_copy(1, 1), sync([0, 1])]
        return steps(r)
    with pytest.raises(ScheduleError) as e:
        check("all_gather", _gather(3, racy))
    assert e.value.kinds & {F.RACE, F.UNMATCHED}, e.value


def test_two_writers_of_one_chunk_race():
    # ranks 0 and 1 both write chunk 0 into rank 2's buffer (a broadcast from 0 that rank 1
    # helps with): the same value, but two unordered writes of one memory
    def bad(ordered):
        first = (sync(0),) if ordered else ()  # rank 1 writes only after its sync with the root
        return [Schedule("broadcast", "w", r, 3, 3, SPLIT, SPLIT, st) for r, st in enumerate([
            (write_copy(0, 2), copy(0), copy(1), copy(2), sync([1, 2])),
            (*first, write_copy(0, 2), read_copy(0, 0), read_copy(1, 0), read_copy(2, 0), *([] if ordered else
             [sync(0)]), sync(2)),
            (read_copy(1, 0), read_copy(2, 0), sync([0, 1]))])]
    with pytest.raises(ScheduleError) as e:
        check("broadcast", bad(False), root=0)
    assert F.RACE in e.value.kinds, e.value      # (and misplaced: rank 1 writes its own x1[0])
    with pytest.raises(ScheduleError) as e:
        check("broadcast", bad(True), root=0)
    assert F.RACE not in e.value.kinds, e.value  # ordered by the sync: only the wrong value is left


def test_cost_and_viz_count_the_writes():
    scheds = [read_broadcast(r, 2, 0) for r in range(2)]
    m = messages(scheds, 100)
    # two chunks of 50 bytes, both from the root to the reader in stage 0: the root writes one,
    # the reader reads the other; the reader sends nothing
    assert m.size[0, 1, 0] == 50 + 50 and m.size.get((1, 0, 0), 0) == 0
    fr = frames("broadcast", "read", 2, 0)
    arrows = [(a, b, chunks) for f in fr for a, b, chunks, _ in f["msgs"]]
    assert (0, 1, [0, 1]) in arrows or {(0, 1)} <= {(a, b) for a, b, _ in arrows}


def test_a_synced_write_over_an_input_read_later_names_the_writer():
    # in place, rank 0 writes block 1 of rank 1's output, which lies over rank 1's input; after
    # their sync rank 1 copies that input: ordered, so no race, but it reads rank 0's data
    def steps(r):
        if r == 0:
            return [copy(0), write_copy(1, 1), sync(1), read_copy(1, 1), sync(1)]
        return [sync(0), copy(1), read_copy(0, 0), sync(0)]
    with pytest.raises(ScheduleError) as e:
        check("all_gather", _gather(2, steps))
    assert F.RACE not in e.value.kinds, e.value
    raw = [f for f in e.value.failures if f.kind == F.READ_AFTER_WRITE]
    assert any("after rank 0's step 1 write_copy(1, writes=[1]) wrote" in f.detail for f in raw), e.value


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_read_all_gather_writes_its_block_and_the_engine_takes_it_in_pieces(n):
    """schedule/onecopy.py's all_gather writes (the owner reads its block once: docs/06, "The
    ceiling"); read_native cuts the writes and the copy into alternating pieces, each numbered the
    first write's step, unless the call is in place (its copy is none)."""
    from ringcomm import read_engine, read_native as rn
    from ringcomm.schedule.onecopy import read_all_gather
    scheds = [read_all_gather(r, n) for r in range(n)]
    check("all_gather", scheds)
    report = ringcomm.algorithms.verify("all_gather", scheds, n, 1000)
    assert report.failures == [] and report.postcondition is None
    r = n - 1
    kinds = [s.kind for s in scheds[r].steps]
    assert kinds == ["write_copy"] * (n - 1) + ["copy", "sync"]
    m = (5 * rn.CMA_PIECE_BYTES) // 2 // 4 + 3            # float32: 2.5 pieces and 12 bytes
    rows, _ = rn.plan(scheds[r], read_engine.step_spans(scheds[r], m), 4, r)
    pieces = [rows[i:i + n] for i in range(0, len(rows) - 1, n)]
    assert len(pieces) == 3 and rows[-1][rn.KIND] == rn.SYNC_STEP
    for a, piece in enumerate(pieces):
        assert [row[rn.KIND] for row in piece] == [rn.WRITE] * (n - 1) + [rn.COPY]
        assert all(row[rn.STEP] == 0 for row in piece)
        start, want = a * rn.CMA_PIECE_BYTES, min(rn.CMA_PIECE_BYTES, 4 * m - a * rn.CMA_PIECE_BYTES)
        assert all(row[rn.NBYTES] == want for row in piece)
        assert all(row[rn.HERE] == start for row in piece[:-1]) and piece[-1][rn.THERE] == start
    whole, _ = rn.plan(scheds[r], read_engine.step_spans(scheds[r], m), 4, r, pieces=False)
    assert [row[rn.KIND] for row in whole] == [rn.WRITE] * (n - 1) + [rn.COPY, rn.SYNC_STEP]
    broadcast = read_broadcast(0, n, 0)   # the root writes one chunk and copies others: no pairs
    spans = read_engine.step_spans(broadcast, m)
    assert (rn.plan(broadcast, spans, 4, 0)[0] == rn.plan(broadcast, spans, 4, 0, pieces=False)[0]).all()
    block = -(-rn.CMA_WHOLE_BYTES // (4 * (n - 1))) * 4       # bytes, whole floats: the writes move CMA_WHOLE_BYTES
    rows, _ = rn.plan(scheds[r], read_engine.step_spans(scheds[r], block // 4), 4, r)
    assert [row[rn.KIND] for row in rows] == [rn.WRITE] * (n - 1) + [rn.COPY, rn.SYNC_STEP]   # whole
    assert all(row[rn.NBYTES] == block for row in rows[:-1])


def test_cma_writes_go_in_pieces_until_the_block_or_its_writes_are_big():
    from ringcomm import read_native as rn
    whole, big = rn.CMA_WHOLE_BYTES, rn.CMA_WHOLE_BLOCK_BYTES
    assert big < whole
    assert rn.piece_bytes(True, big // 2, 1) == rn.CMA_PIECE_BYTES          # 2 ranks, 2 MiB blocks
    assert rn.piece_bytes(True, big // 2, 2) == rn.CMA_PIECE_BYTES          # 3 ranks, 2 MiB blocks
    assert rn.piece_bytes(True, big - 4, 1) == rn.CMA_PIECE_BYTES
    assert rn.piece_bytes(True, big, 1) == big                              # 2 ranks, 4 MiB blocks
    third = -(-whole // 3)
    assert rn.piece_bytes(True, third, 3) == third                          # 4 ranks: three writes move 8 MiB
    assert rn.piece_bytes(True, 3 * whole, 1) == 3 * whole
    assert rn.piece_bytes(False, 3 * whole, 3) == rn.WRITE_PIECE_BYTES      # memcpys into registered memory
