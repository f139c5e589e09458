"""The small collectives' fast path (ringcomm/known_calls.py): a repeated call on the same arrays skips
the checks, and only when their outcome cannot have changed."""
from __future__ import annotations

import gc
import pathlib
import re
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import ringcomm
from harness import World


def _repeat_and_change(comm):
    r, n = comm.rank, comm.world_size
    want = n * (n - 1) / 2
    x = np.full((2, 3), r, np.float32)
    out = np.empty_like(x)
    results = {}
    for _ in range(3):                       # the second and third calls take the fast path
        x[...] = r
        comm.all_reduce(x, out=out)
        assert (out == want).all(), out
    results["entries"] = len(comm._known.entries)
    for _ in range(3):
        x[...] = r
        comm.all_reduce(x)                   # in place: its own entry
        assert (x == want).all(), x
    results["entries_after_in_place"] = len(comm._known.entries)

    def refused(fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            return type(e).__name__ + ": " + str(e)
        return "no error"

    x.flags.writeable = False                # the same object, now read-only: in place must refuse
    results["read_only"] = refused(lambda: comm.all_reduce(x))
    x.flags.writeable = True
    x.shape = (3, 2)                         # reshaped in place: still all_reduces all six elements
    x[...] = r
    comm.all_reduce(x, out=out.reshape(3, 2))
    results["reshaped_ok"] = bool((out == want).all())
    small = np.empty(5, np.float32)
    results["small_out"] = refused(lambda: comm.all_reduce(x, out=small))
    as_int = x.view(np.int32)                # another object: its own checks
    results["int_view_ok"] = comm.all_reduce(as_int.copy()).dtype == np.int32
    x.dtype = np.int32                       # the dtype changed in place
    x[...] = r
    comm.all_reduce(x)
    results["dtype_changed_ok"] = bool((x == want).all()) and x.dtype == np.int32

    ref = weakref.ref(out)                   # remembered weakly: the arrays are not kept alive
    del out
    gc.collect()
    results["freed"] = ref() is None
    return results


def _other_collectives(comm):
    r, n = comm.rank, comm.world_size
    res = {}
    buf = np.zeros(4, np.int64)
    for i in range(3):                        # broadcast from rank 1, then the same arrays again
        buf[...] = r * 10 + i
        comm.broadcast(buf, root=1)
        assert (buf == 10 + i).all(), buf
    entries = len(comm._known.entries)
    try:
        comm.broadcast(buf, root=1.0)         # == 1 and hashes alike, but is no rank number
        res["float_root"] = "no error"
    except ValueError as e:
        res["float_root"] = str(e)
    out = np.zeros((n, 4), np.float32)
    mine = np.full(4, r, np.float32)
    for _ in range(3):
        out[...] = -1
        comm.all_gather(mine, out)
        assert (out == np.arange(n, dtype=np.float32)[:, None]).all(), out
    scattered = np.zeros(2, np.float64)
    blocks = np.arange(2 * n, dtype=np.float64)
    for _ in range(3):
        comm.reduce_scatter(blocks, scattered)
        assert (scattered == n * blocks[2 * r:2 * r + 2]).all(), scattered
    part, total = np.zeros(3, np.int32), np.zeros(3, np.int32)
    for root in (1, 1, 1, 0, 0, 0):           # reduce: each root its own entry
        part[...] = r + 1
        total[...] = -1
        comm.reduce(part, root, out=total)
        assert r != root or (total == n * (n + 1) // 2).all(), total
    try:
        comm.reduce(part, 1.0, out=total)     # as broadcast's: == 1, but no rank number
        res["float_reduce_root"] = "no error"
    except ValueError as e:
        res["float_reduce_root"] = str(e)
    res["entries"] = (entries, len(comm._known.entries))
    out.flags.writeable = False               # the same out, now read-only
    try:
        comm.all_gather(mine, out)
        res["read_only_out"] = "no error"
    except ValueError as e:
        res["read_only_out"] = str(e)
    return res


def _rooted(comm):
    """gather and scatter, each root three times: remembered per root (on the ranks that pass
    buf=None to scatter, by their out), right every time, and a changed call still checked."""
    r, n = comm.rank, comm.world_size
    mine, whole, part = np.zeros(3, np.int32), np.zeros(3 * n, np.int32), np.zeros(3, np.int32)
    send = np.arange(3 * n, dtype=np.int32)
    before = len(comm._known.entries)
    for root in (1, 1, 1, 0, 0, 0):
        mine[...] = r + 10
        whole[...] = -1
        comm.gather(mine, whole if r == root else None, root)
        assert r != root or whole.tolist() == [q + 10 for q in range(n) for _ in range(3)], whole
        part[...] = -1
        comm.scatter(send if r == root else None, part, root)
        assert part.tolist() == list(range(3 * r, 3 * r + 3)), part
    res = {"entries": len(comm._known.entries) - before, "non_root_out": None}
    if r == 0:   # no root here: passing out is an error (before any byte moves), remembered calls or not
        try:
            comm.gather(mine, whole, 1)
            res["non_root_out"] = "no error"
        except ValueError as e:
            res["non_root_out"] = str(e)
    return res


def _exchanges(comm):
    """all_to_all: equal blocks remembered and right on every repeat; packed counts (a table per
    call) never remembered, right all the same."""
    r, n = comm.rank, comm.world_size
    send, got = np.zeros(2 * n, np.int32), np.zeros(2 * n, np.int32)
    before = len(comm._known.entries)
    for i in range(3):
        send[...] = np.arange(2 * n) + 100 * r + i      # block j goes to rank j
        comm.all_to_all(send, got)
        assert got.tolist() == [100 * q + 2 * r + k + i for q in range(n) for k in range(2)], got
    equal = len(comm._known.entries) - before
    counts, packed_send, packed_got = (1,) * n, send[:n], got[:n]   # the same objects every time
    for i in range(3):
        packed_send[...] = np.arange(n) + 10 * r + i
        comm.all_to_all(packed_send, packed_got, send_counts=counts, recv_counts=counts)
        assert packed_got.tolist() == [10 * q + r + i for q in range(n)], got
    return equal, len(comm._known.entries) - before - equal


@pytest.mark.timeout(60)
def test_all_to_all_takes_it_with_equal_blocks_only():
    with World(2, {}, timeout=30) as w:
        assert w.run(_exchanges) == [(1, 0)] * 2


@pytest.mark.timeout(60)
def test_gather_and_scatter_take_it_too():
    with World(2, {}, timeout=30) as w:
        for r, res in enumerate(w.run(_rooted)):
            assert res["entries"] == 4, res              # gather and scatter, two roots each
            assert r == 1 or "only the root" in res["non_root_out"], res


@pytest.mark.timeout(60)
def test_broadcast_all_gather_reduce_scatter_and_reduce_take_it_too():
    with World(2, {}, timeout=30) as w:
        for res in w.run(_other_collectives):
            assert res["entries"] == (1, 5), res
            assert "out of range" in res["float_root"] or "broadcast root" in res["float_root"], res
            assert "reduce root" in res["float_reduce_root"], res
            assert "read-only" in res["read_only_out"], res


@pytest.mark.timeout(60)
def test_repeated_small_all_reduce_is_fast_only_while_its_checks_still_hold():
    with World(2, {}, timeout=30) as w:
        for res in w.run(_repeat_and_change):
            assert res["entries"] == 1 and res["entries_after_in_place"] == 2, res
            assert res["read_only"].startswith("ValueError") and "read-only" in res["read_only"], res
            assert res["reshaped_ok"] and res["int_view_ok"] and res["dtype_changed_ok"], res
            assert res["small_out"].startswith("ValueError") and "expected 6" in res["small_out"], res
            assert res["freed"], res


def _registered(comm):
    """Registered buffers take the fast path too: small calls (FIFO algorithms) and large ones
    (the read algorithm), each its own entry, right every time."""
    r, n = comm.rank, comm.world_size
    res = {}
    for count in (16, 1 << 18):                     # 64 B and 1 MiB of float32 (READ_MIN_BYTES)
        x = comm.alloc(count, np.float32)
        out = comm.alloc(count * n, np.float32)
        reads = comm._registry.engine.calls
        before = len(comm._known.entries)
        for i in range(3):
            x[...] = r + i
            comm.all_gather(x, out)
            assert (out.reshape(n, count) == np.arange(n, dtype=np.float32)[:, None] + i).all()
            x[...] = r + i
            comm.all_reduce(x)
            assert (x == n * (n - 1) / 2 + n * i).all()
        lane = comm._known.entries[id(x), id(out), ("all_gather", None)].lane
        res[count] = (len(comm._known.entries) - before, comm._registry.engine.calls - reads, type(lane).__name__)
    return res


@pytest.mark.timeout(60)
def test_calls_on_registered_buffers_are_remembered_and_keep_their_algorithm():
    with World(2, {}, timeout=30) as w:
        for res in w.run(_registered):
            # remembered; the FIFOs below 4 KiB, a FIFO lane (engine_native.Lane) for the all_gather
            assert res[16] == (2, 0, "Lane"), res
            # remembered; every call read the peer, the all_gather down read_native's compiled lane
            assert res[1 << 18] == (2, 6, "ReadLane"), res


def test_a_known_call_carries_its_arrays_addresses():
    """The read engine takes a known call's addresses from its entry (address() costs ~1 us): they
    are the data's, also for a flat view of a 2-D array."""
    from ringcomm.buffers import address
    from ringcomm.known_calls import KnownCalls
    known = KnownCalls()
    buf, out = np.zeros((4, 8), np.float32), np.zeros(64, np.float32)
    known.remember(buf, out, ("all_gather", None), "sum", "read", None)
    known.remember(buf, None, ("broadcast", None, int, 0), "sum", "read", None)
    assert known.get(buf, out, ("all_gather", None)).addrs == (address(buf.reshape(-1)), address(out))
    assert known.get(buf, None, ("broadcast", None, int, 0)).addrs == (address(buf),) * 2


def _cma_calls_on_two_arrays(comm):
    """Known CMA calls on two arrays of one shape, in turn: each reads from its own array's address."""
    r, n = comm.rank, comm.world_size
    a, b = np.zeros((4, 1024), np.float32), np.zeros((4, 1024), np.float32)
    ga, gb = np.zeros((n, 4, 1024), np.float32), np.zeros((n, 4, 1024), np.float32)
    reads = comm._registry.engine.calls if comm._registry else 0
    for i in range(4):
        a[...], b[...] = r + 10 * i, -r - 10 * i
        comm.broadcast(a, root=1)
        comm.broadcast(b, root=1)
        assert (a == 1 + 10 * i).all() and (b == -1 - 10 * i).all(), (a, b)
        a[...], b[...] = r + 10 * i, -r - 10 * i
        comm.all_gather(a, ga)
        comm.all_gather(b, gb)
        want = np.arange(n, dtype=np.float32)[:, None, None] + 10 * i
        assert (ga == want).all() and (gb == -want).all(), (ga, gb)
    return comm._registry.engine.calls - reads


@pytest.mark.timeout(60)
def test_known_calls_by_cma_read_each_arrays_own_memory():
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=30) as w:
        for calls in w.run(_cma_calls_on_two_arrays):
            assert calls == 16, calls   # every call took the CMA read path


# ---- lanes: a known call goes straight into the engine's compiled code (comm._run_known) ----------

def _count_lane_calls():
    """Count, in this rank, the calls that went down a lane ("lane": Lane.run, ReadLane.run) and the
    engines' go_on, where a call that stopped at a wait goes on in Python (class attributes: the
    lanes have slots)."""
    from ringcomm.engine_native import Lane, NativeEngine
    from ringcomm.read_engine import ReadEngine, ReadLane
    counts = {"lane": 0, "go_on": 0, "positions": []}   # positions: the watchdog's seq as each lane call starts
    for cls, name, key in ((Lane, "run", "lane"), (ReadLane, "run", "lane"), (NativeEngine, "go_on", "go_on"),
                           (ReadEngine, "go_on", "go_on")):
        real = getattr(cls, "_real_" + name, None) or getattr(cls, name)
        setattr(cls, "_real_" + name, real)

        def counted(self, *args, _real=real, _key=key):
            counts[_key] += 1
            if _key == "lane":
                ex = self.ex if isinstance(self, ReadLane) else self.engine.x
                counts["positions"].append(ex.position().get("seq"))
            return _real(self, *args)
        setattr(cls, name, counted)
    return counts


def _down_the_lanes(comm, cma: bool):
    """Repeated calls on the same arrays: a call is remembered (known_calls.py), the next known call
    finds its lane, and the calls after it take the lane, with right results; the watchdog's
    position (the executor's current call) is every call's own. Three rounds before counting: the
    first makes the registry (CMA's probe), which forgets the calls remembered before it."""
    r, n = comm.rank, comm.world_size
    small, out = np.zeros(2, np.float32), np.zeros(2, np.float32)
    big = np.zeros(16384, np.float32)                    # 64 KiB: CMA reads where RINGCOMM_CMA_MIN allows
    gathered = np.zeros((n, 16384), np.float32)
    seqs, counts = [], None   # seqs: each counted call's number, where it took a lane

    def counted(call):
        before = counts["lane"] if counts else 0
        call()
        if counts and counts["lane"] > before:
            seqs.append(comm._seq)
    for i in range(6):
        if i == 3:
            counts = _count_lane_calls()
        small[...] = r + i
        counted(lambda: comm.all_reduce(small, out=out))
        assert (out == n * (n - 1) / 2 + n * i).all(), out
        big[...] = r + i
        counted(lambda: comm.broadcast(big, root=1))
        assert (big == 1 + i).all(), big[:4]
        counted(lambda: comm.all_gather(big, gathered))
        assert (gathered == (1 + i)).all(), gathered[:, :4]
    assert comm._executor._call is None   # done: the executor holds no call (nor its arrays)
    lanes = sorted(type(known.lane).__name__ for known in comm._known.entries.values())
    reads = comm._registry.engine.calls if comm._registry else 0
    # The lanes' reused Calls hold the arrays no more than the known calls do: dropped, they go
    refs = [weakref.ref(a) for a in (small, out, big, gathered)]
    del small, out, big, gathered
    gc.collect()
    freed = [ref() is None for ref in refs]
    return counts, seqs, lanes, reads, freed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cma", [False, True], ids=["fifo", "cma"])
def test_known_calls_go_down_their_engines_lane(cma):
    env = {"RINGCOMM_CMA_MIN": "1"} if cma else {"RINGCOMM_CMA": "0"}
    with World(2, env, timeout=30) as w:
        for counts, seqs, lanes, reads, freed in w.run(_down_the_lanes, cma):
            assert counts["positions"] == seqs, (counts["positions"], seqs)
            assert all(freed), freed
            # the three counted rounds took the lanes
            if cma:   # every call read the peer, the all_reduce too (its reducing step: _fetch_step)
                assert lanes == ["ReadLane"] * 3 and reads == 18, (lanes, reads)
                assert counts["lane"] == 9, counts
            else:
                assert lanes == ["Lane"] * 3 and reads == 0, (lanes, reads)
                assert counts["lane"] == 9, counts


def _lane_call_that_waits(comm, coll: str):
    """Rank 0's known call goes down its lane while rank 1 is provably not in it yet (rank 1 enters
    once rank 0's executor waits on it in Python): the compiled code stops at the wait, and the
    engine's go_on finishes the call, with the right result."""
    r = comm.rank
    x = np.zeros(16384 if coll == "broadcast" else 2, np.float32)   # 64 KiB, or 8 bytes
    out = np.zeros_like(x)

    def call():
        if coll == "all_reduce":
            comm.all_reduce(x, out=out)
            return out.copy()
        comm.broadcast(x, root=0)
        return x[:4].copy()
    for i in range(3):   # remembered, then the lane found, then taken
        x[...] = r + 1
        call()
    x[...] = r + 1
    if r == 1:
        comm._store.wait(["lanes/rank0_waits"], 30)
        return call(), None
    counts, got, ex = _count_lane_calls(), {}, comm._executor
    ex._waiting = None
    worker = threading.Thread(target=lambda: got.update(result=call()))
    worker.start()
    deadline = time.monotonic() + 30
    while ex._waiting is None or ex.position().get("seq") != comm._seq:   # rank 0's call waits on rank 1
        assert time.monotonic() < deadline, "rank 0 never waited"
        time.sleep(0.001)
    comm._store.set("lanes/rank0_waits", b"1")
    worker.join(30)
    return got.get("result"), counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("coll", ["all_reduce", "broadcast"])
def test_a_lane_call_that_waits_is_finished_by_the_engine(coll):
    env = {"RINGCOMM_CMA_MIN": "65536"} if coll == "broadcast" else {}   # broadcast: the read lane (CMA)
    with World(2, env, timeout=30) as w:
        (result0, counts), (result1, _) = w.run(_lane_call_that_waits, coll)
    want = 3.0 if coll == "all_reduce" else 1.0
    assert (result0 == want).all() and (result1 == want).all(), (result0, result1)
    assert counts["lane"] == 1 and counts["go_on"] == 1, counts


def _peer_leaves_during_a_lane_call(comm):
    """Rank 1 aborts instead of making the call: rank 0's lane call fails with the engine's message."""
    x = np.ones(2, np.float32)
    for _ in range(3):
        comm.all_reduce(x)
    if comm.rank == 1:
        comm.abort()
        return None
    try:
        comm.all_reduce(x)
    except ringcomm.RingcommError as e:
        return type(e).__name__ + ": " + str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_a_peer_that_leaves_during_a_lane_call_is_reported():
    with World(2, {}, timeout=30) as w:
        said, _ = w.run(_peer_leaves_during_a_lane_call)
    assert said.startswith("PeerFailure") and "rank 0 (this process)" in said, said
    assert "all_reduce #" in said and "rank 1 over shm" in said, said


def _interrupt_where_a_lane_call_goes_on(comm):
    """Rank 0's lane call stops at a wait (rank 1 holds back), and Ctrl-C's handler runs the moment
    the compiled loop returns (signals wait for compiled code): the communicator must break, as
    for any call that moved bytes, and never hand the next call the interrupted one's slices."""
    from ringcomm.engine_native import DONE
    x = np.ones(2, np.float32)
    for _ in range(3):
        comm.all_reduce(x)
    if comm.rank == 1:   # rank 0 sent its 8 bytes before it stopped: this call may finish, rightly
        comm._store.wait(["lanes/interrupted"], 30)
        x[...] = 1
        first = _next_call(comm, x)
        return first, x.copy(), _next_call(comm, x)
    (known,) = comm._known.entries.values()
    loop = known.lane.loop

    def interrupted_on_return(*args):
        if loop(*args) != DONE:
            raise KeyboardInterrupt
        return DONE
    known.lane.loop = interrupted_on_return
    x[...] = 1
    try:
        comm.all_reduce(x)
        first = "returned"
    except KeyboardInterrupt:
        first = "KeyboardInterrupt"
    comm._store.set("lanes/interrupted", b"1")
    return first, _next_call(comm, x)


def _next_call(comm, x):
    try:
        comm.all_reduce(x)
    except ringcomm.RingcommError as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


@pytest.mark.timeout(60)
def test_a_lane_call_interrupted_where_python_takes_over_breaks_the_communicator():
    with World(2, {"RINGCOMM_TIMEOUT": "20"}, timeout=30) as w:
        (first, later), (peer_first, peer_x, peer_later) = w.run(_interrupt_where_a_lane_call_goes_on, timeout=40)
    assert first == "KeyboardInterrupt", first
    assert later.startswith("CommunicatorClosed") and "interrupted by KeyboardInterrupt" in later, later
    assert peer_first != "returned" or (peer_x == 2).all(), (peer_first, peer_x)   # an error, or the right sum
    assert peer_later.startswith("PeerFailure") and "rank 0" in peer_later, peer_later


def _one_call_each(comm):
    """Arrays of calls that ran once (the checked path) or many times (the lanes): once the calls
    returned and the user dropped them, nothing of ringcomm's keeps them alive."""
    refs = []
    for repeats in (5, 1):     # the last call is a checked one
        x, out = np.ones(1 << 16, np.float32), np.zeros((comm.world_size, 1 << 16), np.float32)
        for _ in range(repeats):
            comm.all_reduce(x)
            comm.broadcast(x, root=0)
            comm.all_gather(x, out)
        refs += [weakref.ref(x), weakref.ref(out)]
        del x, out
    gc.collect()
    return [ref() is None for ref in refs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cma", [False, True], ids=["fifo", "cma"])
def test_the_arrays_of_finished_calls_are_not_kept_alive(cma):
    env = {"RINGCOMM_CMA_MIN": "1"} if cma else {"RINGCOMM_CMA": "0"}
    with World(2, env, timeout=30) as w:
        for freed in w.run(_one_call_each):
            assert all(freed), freed


def _interleaved(comm):
    """One buffer in several calls taken in turn (the roots, the ops and the collectives alternate
    call by call): each repeat finds its own entry, and every result is right."""
    r, n = comm.rank, comm.world_size
    buf = np.zeros(4, np.int64)
    for i in range(4):
        for root in range(n):
            buf[...] = 10 * r + i
            comm.broadcast(buf, root)
            assert (buf == 10 * root + i).all(), (root, buf)
        for op, want in (("sum", sum(range(1, n + 1))), ("max", n)):
            buf[...] = r + 1
            comm.all_reduce(buf, op)
            assert (buf == want).all(), (op, buf)
    return len(comm._known.entries)


@pytest.mark.timeout(60)
def test_calls_that_take_turns_on_one_buffer_each_find_their_own_entry():
    with World(2, {}, timeout=30) as w:
        assert w.run(_interleaved) == [4, 4]   # two roots, two ops


def test_the_latest_look_up_never_outlives_its_entry():
    from ringcomm.known_calls import MAX_ENTRIES, KnownCalls
    known = KnownCalls()
    arrays = [np.zeros(2) for _ in range(MAX_ENTRIES + 3)]
    for a in arrays:
        known.remember(a, None, ("all_reduce", "sum", None), "sum", "ring", None)
    assert len(known.entries) == len(known.latest) == MAX_ENTRIES
    assert known.get(arrays[0], None, ("all_reduce", "sum", None)) is None       # the oldest went
    assert known.get(arrays[-1], None, ("all_reduce", "sum", None)) is not None
    assert known.get(arrays[-1], None, ("all_reduce", "max", None)) is None      # other arguments
    # arguments whose == cannot answer (an array for a root) are not remembered calls: the checked
    # path explains them
    assert known.get(arrays[-1], None, ("all_reduce", np.array([1, 2]), None)) is None
    known.forget()
    assert not known.entries and not known.latest


@pytest.mark.timeout(120)
def test_call_layers_example_times_each_layer_of_a_known_call():
    """examples/call_layers.py, the measurement docs/06 "The small call" quotes, under the launcher:
    every layer of both calls timed, the stubbed layers cheaper than the real calls they stand in
    for (a 64 KiB broadcast moves data between processes; a stub returns at once), and the real
    calls right afterwards (a wrong one exits non-zero)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", "examples/call_layers.py",
                          "--calls", "2000"], capture_output=True, text=True, timeout=110, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\[rank 0\] (\S.*?)\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            rows[m[1]] = (float(m[2]), float(m[3]))
    assert set(rows) == {"compiled stub", "lane.run", "comm._run_known", "KnownCalls.get alone",
                         "the public method", "the real call"}, out.stdout
    assert all(a > 0 and b > 0 for a, b in rows.values()), rows
    assert rows["compiled stub"][1] < rows["the real call"][1], rows
    assert re.search(r"\(lane\)\s+Lane\s+(Read)?Lane", out.stdout), out.stdout
    assert "results after the stubs: right" in out.stdout
