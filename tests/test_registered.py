"""Registered buffers (comm.alloc) and the one-copy "read" algorithms: schedules, then real ranks."""
from __future__ import annotations

import glob
import os
import re
import signal
import stat
import time

import numpy as np
import pytest

import ringcomm
from cases import ALGOS, BLOCK_COLLECTIVES, COLLECTIVES, DTYPES, OPS, compare, make_input, reference, run_block_case
from harness import World
from ringcomm import catalogue
from ringcomm.registered import READ_MIN_BY_COLLECTIVE, READ_MIN_BYTES, read_min_bytes
from ringcomm.schedule import peer_read
from ringcomm.schedule.onecopy import read_all_reduce, read_back_all_reduce
from ringcomm.schedule.simulate import ScheduleError, check
from ringcomm.schedule.faults import READ_AFTER_WRITE
from ringcomm.schedule.step import (SPLIT, Schedule, Step, read_copy, read_out_copy, read_reduce_copy, sync,
                                    write_out_copy)
from ringcomm.schedule.verify import verify_schedules
from ringcomm.transport import cma

# The collectives with a one-copy algorithm (all_to_all, gather and scatter have none).
READ_COLLECTIVES = tuple(c for c in COLLECTIVES if "read" in catalogue.ALGOS[c])

# ---- the control segment's layout (ctl_layout.py) ------------------------------------------------

def test_control_words_share_cache_lines_by_who_writes_them_and_how_often():
    from ringcomm import ctl_layout as L
    line = lambda word: word // L.LINE_WORDS  # noqa: E731
    assert {line(w) for w in (0, L.PID, L.CLOSED, L.MAPPED)} == {0}            # no call writes these
    assert {line(w) for w in range(L.DESC, L.DESC + 6)} == {line(L.CALLS)} != {0}  # one call's handshake
    for n in (1, 2, 3, 8, 9, 64):
        syncs = {line(L.SYNC + p) for p in range(n)}
        flags = [L.sleep_flag(n, p) for p in range(n)]
        assert min(syncs) > line(L.CALLS) and not syncs & {line(f) for f in flags}, n
        assert flags == list(range(flags[0], flags[0] + n)) and L.ctl_words(n) == flags[-1] + 1, n


def test_the_compiled_read_calls_wake_by_the_layouts_own_flag():
    from ringcomm import ctl_layout, read_native
    flag = read_native._sleep_flag
    assert getattr(flag, "py_func", flag) is ctl_layout.sleep_flag   # jitted by kernel(), or not yet


# ---- the schedules, symbolically ----------------------------------------------------------------


def test_read_steps_are_checked_when_built():
    with pytest.raises(ValueError, match="remote=peers and no src or dst"):
        Step("read_copy", 0, src=(1,))
    with pytest.raises(ValueError, match="does not reduce"):
        Step("read_out_copy", 0, remote=(1, 2))
    with pytest.raises(ValueError, match="remote= is for"):
        Step("recv", 0, src=(1,), remote=(2,))
    s = read_all_reduce(1, 3)
    assert s.registered and not catalogue.build_schedule("all_reduce", "ring", 1, 3, None).registered
    assert [str(x) for x in s.steps] == ["read_reduce_copy(1, reads=[0, 1, 2])", "write_out_copy(1, writes=[0, 2])",
                                         "sync(0, with=[0, 2])"]
    assert str(read_back_all_reduce(1, 3).steps[1]) == "sync(0, with=[0, 2])"
    # the cost model's stages: the write sends what the reduction made, so it comes after the reads
    assert [peer_read.stage(s, i) for i in range(3)] == [0, 1, 2]
    assert [peer_read.stage(read_back_all_reduce(1, 3), i) for i in range(5)] == [0, 2, 3, 3, 5]


@pytest.mark.parametrize("make", [read_all_reduce, read_back_all_reduce])
def test_both_read_all_reduces_verify_in_and_out_of_place(make):
    for n in (2, 3, 5):
        rep = verify_schedules("all_reduce", [make(r, n) for r in range(n)], 1001)
        assert rep.ok and rep.rank_identical and rep.size_independent, rep.summary()


def _broken_push(n, steps):
    scheds = [read_all_reduce(r, n) for r in range(n)]
    scheds[1] = Schedule("all_reduce", "read", 1, n, n, SPLIT, SPLIT, tuple(steps))
    return verify_schedules("all_reduce", scheds, 100)


def test_a_broken_write_out_copy_is_caught():
    # before rank 1 has reduced its chunk: it has nothing to write
    rep = _broken_push(3, [write_out_copy(1, (0, 2)), read_reduce_copy(1, (0, 1, 2)), sync((0, 2))])
    assert not rep.ok and "writes its output chunk 1 into its peers before any step wrote it" in rep.postcondition
    # into the peers' chunk 0, which rank 0 writes there: the wrong value, and a race with rank 0's write
    rep = _broken_push(3, [read_reduce_copy(1, (0, 1, 2)), write_out_copy(0, (0, 2)), sync((0, 2))])
    assert not rep.ok, rep.summary()
    # leaving without the last sync: rank 1's peers may still be writing into its output
    rep = _broken_push(3, [read_reduce_copy(1, (0, 1, 2)), write_out_copy(1, (0, 2))])
    assert not rep.ok and "no sync with rank(s) [0, 2] follows" in rep.postcondition, rep.postcondition


def test_a_peer_write_does_not_excuse_a_later_overwrite_by_the_owner():
    # Rank 1 writes rank 0's chunk 0 back unchanged (write_out_copy of a copy of it); in the next
    # phase rank 0 overwrites that chunk (in place: its input) while rank 1 reads it again. The
    # in-place rule lets a peer's own write over a chunk it read, but not the owner's write after it.
    def s(r, *steps):
        return Schedule("all_reduce", "mine", r, 3, 3, SPLIT, SPLIT, steps)
    scheds = [s(0, sync(1), read_copy(0, 2), sync((1, 2))),
              s(1, read_copy(0, 0), write_out_copy(0, 0), sync(0), read_copy(0, 0), sync(0)),
              s(2, sync(0))]
    rep = verify_schedules("all_reduce", scheds, 10)
    assert any(f.kind == READ_AFTER_WRITE and "rank 0 overwrote its input chunk 0 in the phase in which rank 1 "
               "reads it" in f.detail for f in rep.failures), rep.summary()


def test_read_all_reduce_has_one_order_for_every_rank_and_size():
    rep = ringcomm.verify("all_reduce", "read", 5, 1001)
    assert rep.ok and rep.rank_identical and rep.size_independent, rep.summary()
    assert rep.orders == [(0, 1001, "((((x0 + x1) + x2) + x3) + x4) then post-op")]


def _broken(n, index, step):
    scheds = [read_back_all_reduce(r, n) for r in range(n)]
    steps = list(scheds[1].steps)
    if step is None:
        del steps[index]
    else:
        steps[index] = step
    scheds[1] = Schedule("all_reduce", "read", 1, n, n, SPLIT, SPLIT, tuple(steps))
    return scheds


def test_reading_an_output_before_its_owner_wrote_it_is_caught():
    # Rank 1 copies rank 0's output chunk 0 before the sync that separates the phases.
    scheds = _broken(3, 1, read_out_copy(0, 0))
    with pytest.raises(ScheduleError, match="reads rank 0's output chunk 0 before rank 0 wrote it"):
        check("all_reduce", scheds, nslots=2, slices=1, rounds=2)


def test_leaving_while_peers_may_still_read_is_caught():
    scheds = _broken(3, 4, None)  # rank 1 drops its last sync: its reads of phase 2 are unguarded
    rep = verify_schedules("all_reduce", scheds, 100)
    assert not rep.ok and "read_out_copy(0, reads=[0]): no sync with rank(s) [0] follows" in rep.postcondition


def test_unmatched_sync_is_a_deadlock_with_its_trace():
    scheds = _broken(3, 1, sync((0,)))  # rank 1 skips its first sync with rank 2
    rep = verify_schedules("all_reduce", scheds, 100)
    assert not rep.ok
    assert "sync" in rep.postcondition and "rank 2" in rep.postcondition, rep.postcondition


def test_wrong_reduction_is_caught():
    scheds = _broken(3, 0, read_reduce_copy(1, (0, 1)))  # forgets rank 2's input
    rep = verify_schedules("all_reduce", scheds, 100)
    assert not rep.ok and "final" in rep.postcondition


def _everyone_reduces_everything(rank, n):
    """Right out of place, wrong in place: each rank reduces every chunk itself, so it overwrites
    its input chunks while the peers still read them."""
    steps = tuple(read_reduce_copy(c, tuple(range(n))) for c in range(n)) + (sync(tuple(q for q in range(n) if q != rank)),)
    return Schedule("all_reduce", "everyone", rank, n, n, SPLIT, SPLIT, steps)


def test_overwriting_an_input_that_a_peer_reads_is_caught():
    rep = verify_schedules("all_reduce", [_everyone_reduces_everything(r, 3) for r in range(3)], 100)
    assert not rep.ok and "in place" in rep.postcondition, rep.postcondition
    with pytest.raises(ringcomm.algorithms.ScheduleError, match="in place"):
        ringcomm.register_algorithm("everyone", "all_reduce", _everyone_reduces_everything, sizes=(3,))


def test_cost_and_viz_see_the_reads():
    one = ringcomm.cost("all_reduce", "read", 4, 4 << 20, alpha=1e-5, beta=1e-10, gamma=1e-10)
    assert one > 0
    from ringcomm import viz
    frames = viz.frames("all_gather", "read", 3)
    assert [f["stage"] for f in frames] == [0]
    assert sorted((a, b) for a, b, _, _ in frames[0]["msgs"]) == [(a, b) for a in range(3) for b in range(3) if a != b]


# ---- real ranks ----------------------------------------------------------------------------------

BIG = 600_011  # several pieces per chunk (256 KiB; 1 MiB for two operands): the reduction loop and its scratch path run


def _cases(n):
    cases, i = [], 0
    for coll in READ_COLLECTIVES:
        for dtype in DTYPES[::3] + ("float32",):
            op = OPS[i % len(OPS)] if dtype != "float32" else "sum"
            count = (0, 1, 7, 1000)[i % 4] if dtype != "float32" else (BIG if coll == "all_reduce" else 1001)
            cases.append(dict(collective=coll, dtype=dtype, op=op, count=count, algo="read",
                              root=(0, n - 1)[i % 2], inplace=bool(i % 3), seed=i))
            i += 1
    return cases


def _run_case(comm, case, area):
    """cases.run_case with every buffer a view of the registered ``area`` (a uint8 alloc)."""
    n, r = comm.world_size, comm.rank
    coll, count, root = case["collective"], case["count"], case["root"]
    insize = count * n if coll == "reduce_scatter" else count
    inputs = [make_input(case, k, insize) for k in range(n)]
    dt = inputs[r].dtype
    half = area.size // 2 // dt.itemsize * dt.itemsize
    x = area[:insize * dt.itemsize].view(dt)                     # the input, at the area's start
    o = area[half:half + max(count * n, count) * dt.itemsize].view(dt)  # outputs, from the middle
    x[...] = inputs[r]
    calls = comm._registry.engine.calls
    if coll == "all_reduce":
        got = comm.all_reduce(x, case["op"], out=None if case["inplace"] else o[:count], algo=case["algo"])
        want = reference(case, inputs)
    elif coll == "reduce":
        out = None if case["inplace"] else o[:count]
        if out is not None:
            out[...] = 0
        got = comm.reduce(x, root, case["op"], out=out, algo=case["algo"])
        want = reference(case, inputs) if r == root else (inputs[r] if case["inplace"] else np.zeros_like(x))
    elif coll == "broadcast":
        got = comm.broadcast(x, root, algo=case["algo"])
        want = inputs[root]
    elif coll == "all_gather":
        out = o[:count * n]
        if case["inplace"]:
            out[r * count:(r + 1) * count] = x
            x = out[r * count:(r + 1) * count]
        got = comm.all_gather(x, out, algo=case["algo"])
        want = np.concatenate(inputs)
    else:
        out = x[r * count:(r + 1) * count] if case["inplace"] else o[:count]
        got = comm.reduce_scatter(x, out, case["op"], algo=case["algo"])
        want = reference(case, inputs)[r * count:(r + 1) * count]
    reads = case["algo"] == "read" and count > 0
    if comm._registry.engine.calls != calls + reads:
        return f"{case}: {'did not run' if reads else 'ran'} the read algorithm"
    return compare(np.array(got), want, {**case, "buffers": "registered"})


def _other_cases(n):
    """Every other built-in algorithm of every collective once (all_to_all, gather and scatter
    have only those): registered memory is memory, whatever runs on it."""
    cases, i = [], 0
    for coll in COLLECTIVES:
        for algo in (a for a in ALGOS[coll] if a is not None):
            cases.append(dict(collective=coll, dtype=("float32", "int32", "float64", "bfloat16")[i % 4],
                              op="sum" if coll in BLOCK_COLLECTIVES else OPS[i % len(OPS)], count=1001,
                              algo=algo, root=(0, n - 1)[i % 2], inplace=bool(i % 2), seed=100 + i,
                              counts="equal" if algo == "bruck" else "packed"))
            i += 1
    return cases


class _Carve:
    """cases.run_block_case's ``dev``: each array it is given becomes a copy carved out of the
    registered ``area``, 64-byte aligned, one after the other."""

    def __init__(self, area):
        self.area, self.at = area, 0

    def __call__(self, a):
        a = np.asarray(a)
        self.at = -(-self.at // 64) * 64
        view = self.area[self.at:self.at + a.nbytes].view(a.dtype)
        view[...] = a
        self.at += a.nbytes
        return view


def _counting_native_runs(comm) -> list:
    """The native engine's calls that it ran, counted in [0] (the engine is the default)."""
    native, runs = comm._executor.native, [0]
    assert native is not None, f"engine {comm._executor.engine!r}: RINGCOMM_ENGINE=native is the default"
    run = native.run

    def counted(plan, call):
        done = run(plan, call)
        runs[0] += done
        return done
    native.run = counted
    return runs


def _matrix(comm, cases, others):
    area = comm.alloc(2 * 8 * BIG * comm.world_size + 64, np.uint8)
    assert area.flags.c_contiguous and not area.any()
    runs = _counting_native_runs(comm)
    from ringcomm import fetch_reduce
    eng, pushed = comm._registry.engine, []
    push, enter = eng._push, fetch_reduce.enter

    def python_push(*args):   # Python's steps: the peers' output chunks, or None
        got = push(*args)
        pushed.append(got is not None)
        return got
    eng._push = python_push
    # the compiled step (read_native's REDUCE row, then fetch_reduce) writes the pieces itself
    fetch_reduce.enter = lambda block: pushed.append(bool(block.words[fetch_reduce.B_NPUSH])) or enter(block)
    errors = []
    for c in cases:   # all_reduce's write_out_copy goes with its reducing step's pieces, but for AVG's
        before = len(pushed)
        errors.append(_run_case(comm, c, area))
        went = pushed[before:]
        if c["collective"] == "all_reduce" and c["count"] and went != [c["op"] != "avg"]:
            errors.append(f"{c}: the reduced pieces went to the peers as built: {went}")
    errors = [e for e in errors if e]
    del eng._push
    fetch_reduce.enter = enter
    if runs[0]:
        errors.append(f"the native engine ran {runs[0]} read calls: they belong to read_engine.py")
    for case in others:
        before, calls = runs[0], comm._registry.engine.calls
        if case["collective"] in BLOCK_COLLECTIVES:
            err = run_block_case(comm, case, dev=_Carve(area), host=lambda a, dtype: np.array(a))
        else:
            err = _run_case(comm, case, area)
        if err is None and (runs[0] != before + 1 or comm._registry.engine.calls != calls):
            err = f"{case}: did not run in the native engine"
        if err:
            errors.append(err)
    return errors, _segments()[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_on_registered_buffers(n):
    # Every collective with "read", in and out of place, then every other algorithm on the same
    # registered memory, in the native engine (the default). Small slots for the plain calls in
    # between (the fingerprint and barrier paths stay FIFO ones).
    with World(n, {"RINGCOMM_BUFFSIZE": "65536"}, timeout=120) as w:
        results = w.run(_matrix, _cases(n), _other_cases(n), timeout=200)
    assert [errs for errs, _ in results] == [[]] * n, "\n".join(e for errs, _ in results for e in errs)
    # alloc returned once every peer had mapped this rank's segments, and unlinked their names.
    assert [names for _, names in results] == [[]] * n


def _misuse(comm):
    out = {}
    a = comm.alloc(16, np.float32)
    plain = np.ones(16, np.float32)
    for name, fn in [("read on plain", lambda: comm.all_reduce(plain, algo="read")),
                     ("read with plain out", lambda: comm.all_reduce(a, out=plain.copy(), algo="read")),
                     ("bad dtype", lambda: comm.alloc(4, np.complex64)),
                     ("bad shape", lambda: comm.alloc((2, -1), np.float32)),
                     ("shape type", lambda: comm.alloc("4", np.float32))]:
        try:
            fn()
            out[name] = "accepted"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    big = comm.alloc(READ_MIN_BYTES // 4, np.float32)
    calls = comm._registry.engine.calls
    comm.all_reduce(a)  # automatic choice: the ring for 64 bytes, "read" for READ_MIN_BYTES
    comm.all_reduce(big)
    out["auto"] = comm._registry.engine.calls - calls
    a[:] = comm.rank + 1
    comm.all_reduce(a, algo="ring")  # registered memory also works with every other algorithm
    out["ring"] = float(a[0])
    comm.all_reduce(plain)  # and plain buffers keep their algorithms
    out["plain"] = float(plain[0])
    try:
        comm.alloc(8 if comm.rank == 0 else 16, np.float32)
    except ValueError as e:
        out["sizes"] = str(e)
    return out


@pytest.fixture(scope="module")
def pair():
    """Two ranks that several tests share (starting a world costs seconds)."""
    with World(2, timeout=30) as w:
        yield w


@pytest.mark.timeout(120)
def test_misuse_is_refused_before_any_byte_moves(pair):
    res = pair.run(_misuse, timeout=60)
    for r, out in enumerate(res):
        assert out["read on plain"].startswith("ValueError") and "comm.alloc()" in out["read on plain"]
        assert out["read with plain out"].startswith("ValueError")
        assert out["bad dtype"].startswith("TypeError") and out["bad shape"].startswith("ValueError")
        assert out["shape type"].startswith("TypeError")
        assert out["ring"] == 3.0 and out["plain"] == 2.0 and out["auto"] == 1
        assert "alloc #2 has" in out["sizes"] and f"on rank {1 - r}" in out["sizes"]


def test_registered_calls_take_read_from_a_few_kib_and_later_with_more_ranks_than_cores(monkeypatch):
    # (measured: registered.READ_MIN_BY_COLLECTIVE)
    from ringcomm import plain_read
    monkeypatch.setattr(plain_read, "CORES", 2)
    assert read_min_bytes("broadcast", 2) == read_min_bytes("all_gather", 2) == 4 << 10
    assert read_min_bytes("all_reduce", 2) == 16 << 10 and read_min_bytes("reduce_scatter", 2) == 64 << 10
    assert read_min_bytes("reduce", 2) == 256 << 10 and read_min_bytes("reduce", 4) == 4 << 20
    assert read_min_bytes("broadcast", 4) == 64 << 10 and read_min_bytes("all_gather", 3) == 16 << 10
    assert read_min_bytes("all_reduce", 4) == 64 << 10 and read_min_bytes("reduce_scatter", 4) == 256 << 10
    # with a core per rank, every collective takes "read" from READ_MIN_BYTES (the one crossover before)
    assert all(read_min_bytes(c, 2) <= READ_MIN_BYTES for c in READ_COLLECTIVES)


def _async_group_and_blocks(comm):
    """Registered buffers in queued calls, in a group beside FIFO calls, and in all_to_all (which
    has no read algorithm: automatic choice must not pick one from READ_MIN_BYTES up)."""
    n, r, out = comm.world_size, comm.rank, {}
    a = comm.alloc(READ_MIN_BYTES // 4 * n, np.float32)
    b = comm.alloc(READ_MIN_BYTES // 4 * n, np.float32)
    calls = comm._registry.engine.calls
    a[:] = r + 1
    comm.all_reduce(a, async_op=True).wait()  # queued on the progress thread
    out["async"] = float(a.min()), float(a.max())
    a[:] = np.arange(a.size) + 100 * r
    comm.all_to_all(a, b)  # rank r's block i is rank i's block r
    blk = a.size // n
    out["all_to_all"] = all(np.array_equal(b[i * blk:(i + 1) * blk], np.arange(r * blk, (r + 1) * blk) + 100 * i)
                            for i in range(n))
    c, d = np.full(10, r + 1.0, np.float32), np.full(5, float(r), np.float32)
    a[:] = r + 1
    with comm.group():  # the read call comes second in issue order: it runs first, on every rank
        comm.all_reduce(c, algo="ring")
        comm.all_reduce(a, algo="read")
        comm.send(d, (r + 1) % n)
        comm.recv(d, (r - 1) % n)
    out["group"] = float(c[0]), float(a.min()), float(a.max()), float(d[0])
    out["reads"] = comm._registry.engine.calls - calls
    return out


@pytest.mark.timeout(120)
def test_registered_calls_queue_group_and_skip_block_collectives(pair):
    for r, out in enumerate(pair.run(_async_group_and_blocks, timeout=60)):
        assert out == {"async": (3.0, 3.0), "all_to_all": True, "group": (3.0, 3.0, 3.0, float(1 - r)),
                       "reads": 2}, out


def _abort_while_a_peer_reads(comm):
    a = comm.alloc(1000, np.float32)
    if comm.rank == 0:
        comm.abort()
        comm._store.get("seen", timeout=30)  # stay alive (and unclosed) until rank 1 has its error
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(a, algo="read")
        return "no error"
    except ringcomm.RingcommError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        comm._store.set("seen", b"1")


@pytest.mark.timeout(120)
def test_an_aborted_peer_ends_a_registered_wait_at_once():
    with World(2, timeout=30) as w:
        w.start(_abort_while_a_peer_reads)
        answers = w.collect([0, 1], 60)
    status, got = answers[1]
    assert status == "ok" and got[0] == "PeerFailure", got
    assert "rank 0 closed its communicator" in got[1] and got[2] < 5, got


def _one_side(comm):
    a = comm.alloc(1000, np.float32)
    if comm.rank == 0:
        comm.all_reduce(a, algo="read")  # rank 1 never enters: rank 0 must time out, naming both ranks
    return _segments()


def _segments():
    """(names of this process's registered segments still in /dev/shm, modes of those it maps)."""
    mine = f"rc-{os.environ['RINGCOMM_JOB_ID']}-{os.getpid()}-m"
    with open("/proc/self/maps") as f:
        ranges = {line.split()[0] for line in f if mine in line}
    modes = {stat.S_IMODE(os.stat(f"/proc/self/map_files/{r}").st_mode) for r in ranges}  # unlinked too
    return sorted(glob.glob(f"/dev/shm/{mine}*")), modes


@pytest.mark.timeout(120)
def test_a_peer_that_never_enters_is_a_timeout_naming_it():
    with World(2, timeout=2) as w:
        w.start(_one_side)
        answers = w.collect([0, 1], 60)
    status, text = answers[0]
    assert status == "err" and "CollectiveTimeout" in text, text
    assert ("rank 0 (this process) timed out after 2 s waiting for all_reduce #" in text
            and "registered buffer of rank 1 over shm" in text), text
    status, (names, modes) = answers[1]
    assert status == "ok" and names == [] and modes == {0o600}  # mapped, private, and no name left


def _after_close(comm):
    a = comm.alloc(8, np.int32)
    a[:] = comm.rank
    comm.all_reduce(a)
    import ringcomm as rc
    other = rc.init(comm.rank, comm.world_size, store=comm._store)
    b = other.alloc(8, np.int32)
    b[:] = 5
    other.close()
    b += 1  # still this process's memory after close
    try:
        other.all_reduce(b)
        refused = False
    except rc.CommunicatorClosed:
        refused = True
    return int(a.sum()), int(b.sum()), refused


@pytest.mark.timeout(120)
def test_arrays_stay_valid_after_close(pair):
    assert pair.run(_after_close, timeout=60) == [(8, 48, True)] * 2


def _large_copies(comm):
    """Copies big enough to stream (stream_copy.STREAM_MIN_BYTES): an all_gather's own block and
    its peer's, and a 2-rank broadcast's halves (the root writes one into the reader's buffer, the
    reader reads the other); a few odd elements over, so each copy has a partial last line.
    Returns how many bytes Python's path streamed, over the all_gather's block, whether all were
    right, the calls the compiled path handed back, and whether the engine is the native one."""
    from ringcomm import native_sync, read_native, stream_copy
    count = stream_copy.STREAM_MIN_BYTES // 2 + 3   # bytes: twice the threshold, and 12 over
    n, r = comm.world_size, comm.rank
    x, out = comm.alloc(count, np.float32), comm.alloc(n * count + 1, np.float32)[1:]   # out: 4 bytes off a line
    x[...] = np.arange(count, dtype=np.float32) + r * count
    eng = comm._registry.engine
    comm.all_gather(x, out, algo="read")   # the first: the engine's compiled state, on the native engine
    if eng.consts is not None:   # a peer late on a busy machine is waited for in compiled code, not by Python
        eng.consts[read_native.BUDGET] = int(30 * native_sync.cycles_per_second())
    streamed, compiled = [0], stream_copy.kernel()
    stream_copy._kernel = lambda d, s: streamed.__setitem__(0, streamed[0] + d.nbytes) or compiled(d, s)
    before = eng.handed_back
    comm.all_gather(x, out, algo="read")
    gathered = bool(np.array_equal(out, np.arange(n * count, dtype=np.float32)))
    comm.broadcast(x, root=1, algo="read")
    broadcast = bool(np.array_equal(x, np.arange(count, dtype=np.float32) + count))
    stream_copy._kernel = compiled
    return round(streamed[0] / x.nbytes, 3), gathered, broadcast, eng.handed_back - before, \
        comm._executor.native is not None


@pytest.mark.timeout(120)
@pytest.mark.skipif(not __import__("ringcomm.stream_copy").stream_copy.enabled(),
                    reason="streamed copies are x86-64 only, and RINGCOMM_STREAM_COPY=0 turns them off")
def test_large_copies_out_of_registered_buffers_stream_and_are_exact(pair):
    # the native engine: both calls in read_native's compiled call, whose copies through the
    # peer's mapping stream there (read_native._copy, tests/test_stream_copy.py), none in Python
    assert pair.run(_large_copies, timeout=60) == [(0.0, True, True, 0, True)] * 2
    # Python's steps: each rank's own block into its peer's output and its own, in pieces that
    # stream because the block is big, and one half of the broadcast (written or read)
    with World(2, timeout=30, env={"RINGCOMM_ENGINE": "python"}) as w:
        assert w.run(_large_copies, timeout=60) == [(2.5, True, True, 0, False)] * 2


def _compiled_copies(comm):
    """Registered broadcast and all_gather, forced onto "read", in and out of place and at an
    offset into their allocations: each call must enter read_native's compiled call (counted),
    and be exact. Returns (calls, compiled entries, errors)."""
    from ringcomm import read_native
    n, r = comm.world_size, comm.rank
    comm.alloc(1, np.int8)   # (the registry, with its engine, comes with the first allocation)
    compiled, entered = read_native.kernel(), [0]
    read_native._kernel = lambda a: entered.__setitem__(0, entered[0] + 1) or compiled(a)
    eng = comm._registry.engine
    if eng.run_call is not None:
        eng.run_call = read_native._kernel
    errors, calls = [], 0
    try:
        for count in (1, 7, 1000, 70_001):
            x = comm.alloc(count + 3, np.int32)[3:]          # 12 bytes into its allocation
            out = comm.alloc(n * count, np.int32)
            x[...] = np.arange(count) + 1000 * r
            for root in range(n):
                y = x.copy() if r == root else np.full(count, -1, np.int32)
                x[...] = y
                comm.broadcast(x, root=root, algo="read")
                calls += 1
                if not np.array_equal(x, np.arange(count) + 1000 * root):
                    errors.append(f"broadcast {count} from {root}")
                x[...] = np.arange(count) + 1000 * r
            comm.all_gather(x, out, algo="read")
            calls += 1
            want = np.concatenate([np.arange(count) + 1000 * q for q in range(n)])
            if not np.array_equal(out, want):
                errors.append(f"all_gather {count}")
            out[...] = -1
            out[r * count:(r + 1) * count] = x
            comm.all_gather(out[r * count:(r + 1) * count], out, algo="read")   # in place
            calls += 1
            if not np.array_equal(out, want):
                errors.append(f"all_gather in place {count}")
    finally:
        read_native._kernel = compiled
        if eng.run_call is not None:
            eng.run_call = compiled
    return calls, entered[0], errors


@pytest.mark.timeout(120)
def test_registered_copies_run_in_the_compiled_call_and_are_exact():
    with World(3, timeout=60) as w:
        results = w.run(_compiled_copies, timeout=90)
    for r, (calls, entered, errors) in enumerate(results):
        assert errors == [], f"rank {r}: {errors}"
        assert entered >= calls, f"rank {r}: {calls} calls entered the compiled call {entered} times"


def _compiled_reductions(comm):
    """Registered all_reduce and reduce_scatter, forced onto "read", in and out of place: each
    call's reducing step must run in fetch_reduce's compiled loop (counted), operands read where
    the peers' buffers are mapped, and be exact. Returns (reducing calls, compiled steps, errors)."""
    from ringcomm import fetch_reduce, native_sync, read_native
    n, r = comm.world_size, comm.rank
    x = comm.alloc(5, np.float32)
    comm.all_reduce(x, algo="read")   # the first: the engine's compiled state
    eng = comm._registry.engine
    hz = native_sync.cycles_per_second()   # a peer late on a busy machine is waited for in compiled code
    eng.consts[[read_native.BUDGET, read_native.YIELDS, read_native.YIELD_BUDGET]] = int(1e-3 * hz), 10**9, int(30 * hz)
    enter, steps = fetch_reduce.enter, [0]
    fetch_reduce.enter = lambda block: steps.__setitem__(0, steps[0] + 1) or enter(block)
    errors, calls = [], 0
    try:
        for count, dtype, op in ((1, np.int32, "max"), (7, np.float32, "sum"), (3000, np.float64, "prod"),
                                 (70_001, np.float32, "sum"), (999, np.int64, "avg")):
            x = comm.alloc(n * count + 1, dtype)[1:]   # one element into its allocation
            out = comm.alloc(count, dtype)
            base = np.arange(n * count, dtype=dtype) % 5 + 1
            mine = [base * (q + 1) for q in range(n)]
            want = {"sum": sum(mine), "max": mine[-1], "prod": np.prod(mine, axis=0),
                    "avg": sum(mine) // n}[op].astype(dtype)
            x[...] = mine[r]
            comm.all_reduce(x, op=op, algo="read")
            calls += 1
            if not np.array_equal(x, want):
                errors.append(f"all_reduce {count} {op}")
            x[...] = mine[r]
            comm.reduce_scatter(x, out, op=op, algo="read")
            calls += 1
            if not np.array_equal(out, want[r * count:(r + 1) * count]):
                errors.append(f"reduce_scatter {count} {op}")
            x[...] = mine[r]
            comm.reduce_scatter(x, x[r * count:(r + 1) * count], op=op, algo="read")   # in place
            calls += 1
            if not np.array_equal(x[r * count:(r + 1) * count], want[r * count:(r + 1) * count]):
                errors.append(f"reduce_scatter in place {count} {op}")
    finally:
        fetch_reduce.enter = enter
    return calls, steps[0], errors


@pytest.mark.timeout(120)
def test_registered_reductions_run_in_the_compiled_loop_and_are_exact():
    with World(3, timeout=60) as w:
        results = w.run(_compiled_reductions, timeout=90)
    for r, (calls, steps, errors) in enumerate(results):
        assert errors == [], f"rank {r}: {errors}"
        assert steps == calls, f"rank {r}: {calls} reducing calls, {steps} steps in the compiled loop"


def _past_the_table(comm):
    """Allocation #MAP_CAP is not in the compiled calls' table (peer_maps): its calls hand back
    to Python's steps, which read it through their views, exactly."""
    from ringcomm import peer_maps
    arrays = [comm.alloc(10, np.float32) for _ in range(peer_maps.MAP_CAP + 1)]
    eng, r = comm._registry.engine, comm.rank
    got = []
    for k in (peer_maps.MAP_CAP - 1, peer_maps.MAP_CAP):
        x = arrays[k]
        before = eng.handed_back
        x[...] = r + 1
        comm.broadcast(x, root=1, algo="read")
        ok = bool((x == 2).all())
        x[...] = r + 1
        comm.all_reduce(x, algo="read")
        got.append((ok and bool((x == 3).all()), eng.handed_back - before))
    return got


@pytest.mark.timeout(120)
def test_an_allocation_past_the_compiled_table_goes_by_pythons_steps():
    with World(2, timeout=30) as w:
        for r, got in enumerate(w.run(_past_the_table, timeout=90)):
            (in_table, handed_in), (past, handed_past) = got
            assert in_table and past, got
            assert handed_past >= 1, f"rank {r}: the call on the allocation past the table ran compiled: {got}"


def _another_size_than_the_peers(comm):
    """Rank 1 passes the first half of its allocation where rank 0 passes the whole of its own: a
    broadcast's root would write its half past rank 1's buffer, into the rest of the allocation.
    Returns the error and whether that rest is untouched."""
    a = comm.alloc(1000, np.float32)
    a[...] = -7
    x = a if comm.rank == 0 else a[:500]
    try:
        comm.broadcast(x, root=0, algo="read")
        said = "no error"
    except ringcomm.RingcommError as e:
        said = str(e)
    return said, bool((a[500:] == -7).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "python"])
def test_registered_buffers_of_other_sizes_are_an_error_on_both_and_nothing_is_written_past_them(engine):
    with World(2, {"RINGCOMM_ENGINE": engine}, timeout=10) as w:
        got = w.run(_another_size_than_the_peers, timeout=60)
    for r, (said, untouched) in enumerate(got):
        assert "the ranks passed different sizes" in said and f"rank {1 - r}'s" in said, got
        assert untouched, f"rank {r}: written past the buffer: {got}"


_KEPT = {}  # per rank process: arrays kept between two calls of a world


def _alloc(comm):
    _KEPT["a"] = comm.alloc(1000, np.float32)
    return os.getpid()


def _enter(comm):
    comm.all_reduce(_KEPT["a"], algo="read")  # waits for rank 1, which is killed instead of entering


@pytest.mark.timeout(120)
def test_a_killed_peer_is_reported_while_it_is_an_unreaped_zombie():
    with World(2, timeout=60) as w:
        w.run(_alloc, timeout=60)
        w.start(_enter, ranks=[0])
        os.kill(w.procs[1].pid, signal.SIGKILL)  # not joined: a zombie of this process until the world closes
        t0 = time.monotonic()
        status, text = w.collect([0], 60)[0]
        took = time.monotonic() - t0
        w.kill()
    assert status == "err" and "PeerFailure" in text, text
    assert re.search(r"rank 0 \(this process\) failed waiting for all_reduce #\d+ to start so as to read the "
                     r"registered buffer of rank 1 over shm: rank 1 \(pid \d+\) died", text), text
    assert took < 20, f"the dead peer was seen after {took:.1f} s, not within a few liveness checks"


def _alloc_alone(comm):
    comm.alloc(1 << 20, np.uint8)  # rank 1 never calls alloc: rank 0 waits with its names in /dev/shm


@pytest.mark.timeout(60)
def test_names_are_unlinked_on_sigterm_inside_alloc():
    with World(2, timeout=60) as w:
        w.start(_alloc_alone, ranks=[0])
        pattern = f"/dev/shm/rc-{w.job}-{w.procs[0].pid}-m*"
        deadline = time.monotonic() + 30
        while len(glob.glob(pattern)) < 2:  # its control segment and the allocation
            assert time.monotonic() < deadline, "rank 0 never created its segments"
            time.sleep(0.01)  # polling for files another process writes, with a deadline
        os.kill(w.procs[0].pid, signal.SIGTERM)
        w.procs[0].join(10)
        assert w.procs[0].exitcode == -signal.SIGTERM
        assert glob.glob(pattern) == [], "SIGTERM left registered segments in /dev/shm"
        w.kill()


def test_one_rank_and_forced_tcp_keep_working():
    with ringcomm.init(0, 1) as comm:  # a world of one: alloc is ordinary memory, "read" a local copy
        a = comm.alloc((2, 3), np.float64)
        a[:] = 2
        out = comm.alloc(6, np.float64)
        comm.all_reduce(a, out=out, algo="read")
        assert out.tolist() == [2.0] * 6 and a.shape == (2, 3)


def _tcp_alloc(comm):
    import ringcomm as rc
    os.environ["RINGCOMM_TRANSPORT"] = "tcp"
    try:
        other = rc.init(comm.rank, comm.world_size, store=comm._store)
    finally:
        del os.environ["RINGCOMM_TRANSPORT"]
    a = other.alloc(100, np.float32)  # no shared memory between the ranks: an ordinary array
    a[:] = comm.rank + 1
    other.all_reduce(a)
    try:
        other.all_reduce(a, algo="read")
        refused = ""
    except ValueError as e:
        refused = str(e)
    other.close()
    return float(a[0]), refused


@pytest.mark.timeout(120)
def test_alloc_without_shared_memory_is_ordinary_memory(pair):
    for total, refused in pair.run(_tcp_alloc, timeout=60):
        assert total == 3.0 and "all share this host" in refused


def _mixed(comm, collective="all_reduce"):
    # (big enough that registered buffers take "read" for each collective here)
    a = comm.alloc(READ_MIN_BY_COLLECTIVE["reduce_scatter"] // 4, np.float32)  # every rank allocates ...
    part = comm.alloc(a.size // comm.world_size, np.float32)
    whole = comm.alloc(a.size * comm.world_size, np.float32)
    a[:] = 1
    plain = comm.rank != 0                           # ... but rank 1 passes plain memory
    buf = np.ones(a.size, np.float32) if plain else a
    out = np.empty(part.size, np.float32) if plain else part
    try:
        if collective == "all_reduce":
            comm.all_reduce(buf)
        elif collective == "reduce_scatter":
            comm.reduce_scatter(buf, out)
            buf = out
        elif collective == "broadcast":
            buf[:] = comm.rank + 1
            comm.broadcast(buf, root=1)
        else:   # all_gather
            out = np.empty(whole.size, np.float32) if plain else whole
            buf[:] = 2
            comm.all_gather(buf, out)
            buf = out
        return f"ran: {np.unique(buf).tolist()}"
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.timeout(120)
def test_debug_check_names_a_rank_that_passes_plain_memory_its_peer_cannot_read():
    # RINGCOMM_CMA=0: rank 0 cannot read rank 1's plain buffer, so only rank 0 picks the read steps
    with World(2, {"RINGCOMM_DEBUG": "check", "RINGCOMM_CMA": "0"}, timeout=30) as w:
        answers = w.run(_mixed, timeout=60)
    for text in answers:  # both ranks raise, naming what each called, instead of waiting for the timeout
        assert text.startswith("CollectiveMismatch") and "rank 0 called collective #1: all_reduce(" in text
        assert "algo=read)" in text and text.count("algo=read") == 1, text


@pytest.mark.timeout(120)
def test_a_rank_that_passes_plain_memory_is_a_timeout_that_says_why():
    # A 64 KiB reduce_scatter runs the read steps on registered buffers, the FIFO ring on plain ones
    # where their CMA reads start higher up (by default they start at 1 MiB: here at 64 MiB), so the
    # two ranks run different algorithms. Each names the other within the timeout; the registered
    # side says what most likely happened.
    with World(2, {"RINGCOMM_CMA_MIN": str(64 << 20)}, timeout=2) as w:
        answers = w.run(_mixed, "reduce_scatter", timeout=60)
    assert all(text.startswith("CollectiveTimeout") for text in answers), answers
    assert "waiting for reduce_scatter #1 to start so as to read the registered buffer of rank 1" in answers[0]
    assert "if rank 1 passed plain memory to this call where this rank passed comm.alloc memory" in answers[0]
    assert "rank 1 (this process) timed out after 2 s" in answers[1] and "rank 0" in answers[1], answers[1]


@pytest.mark.skipif(not cma.available(), reason="no process_vm_readv in this libc (not Linux)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "all_gather"])
def test_registered_and_plain_buffers_mix_where_peers_read_plain_ones_by_cma(collective):
    # rank 0 reads (and writes) rank 1's plain buffer by CMA, rank 1 rank 0's registered one
    # through its mapping; the copies in read_native's compiled call on both
    env = {"RINGCOMM_DEBUG": "check", "RINGCOMM_CMA_MIN": str(READ_MIN_BY_COLLECTIVE["reduce_scatter"])}
    with World(2, env, timeout=30) as w:
        assert w.run(_mixed, collective, timeout=60) == ["ran: [2.0]"] * 2
