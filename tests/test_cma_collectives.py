"""Plain numpy buffers in the one-copy read steps through CMA (ringcomm/plain_read.py), on real ranks."""
from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

import ringcomm
from cases import DTYPES, call_case, compare
from harness import World
from ringcomm.transport import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv in this libc (not Linux)")


def _cases(n):
    cases, i = [], 0
    for coll in ("broadcast", "all_gather", "all_reduce", "reduce_scatter", "reduce"):
        for dtype in DTYPES[::2] + ("uint8",):
            count = (1, 7, 1000, 33)[i % 4]
            cases.append(dict(collective=coll, dtype=dtype, op="sum", count=count, algo=None,
                              root=(0, n - 1)[i % 2], inplace=bool(i % 3), seed=i))
            i += 1
    cases.append(dict(collective="all_gather", dtype="float32", op="sum", count=(1 << 20) + 3, algo=None,
                      root=0, inplace=True, seed=99))
    # out of place, 8 MiB and 12 bytes a rank: the own block's copy streams (read_native._copy)
    cases.append(dict(collective="all_gather", dtype="float32", op="sum", count=(2 << 20) + 3, algo=None,
                      root=0, inplace=False, seed=98))
    # reductions of fetched pieces: several pieces and a short last one, every op, 1- to 8-byte types
    for j, (coll, dtype, op) in enumerate([("all_reduce", "float32", "avg"), ("all_reduce", "int8", "prod"),
                                           ("all_reduce", "bfloat16", "max"), ("reduce_scatter", "float64", "min"),
                                           ("reduce_scatter", "int32", "sum"), ("reduce_scatter", "float16", "avg")]):
        count = (1 << 19) // np.dtype("float32" if dtype == "bfloat16" else dtype).itemsize * 3 + 5
        cases.append(dict(collective=coll, dtype=dtype, op=op, count=count, algo=None, root=0,
                          inplace=bool(j % 2), seed=50 + j))
    return cases


def _both_paths(comm, cases):
    """Every case by CMA reads (RINGCOMM_CMA_MIN=1: from one byte) and by the FIFOs: right both
    times, only the collectives in plain_read.COLLECTIVES on the read steps (reduce keeps the
    FIFOs), and the same bytes wherever the result is exact (copies, integers, min and max: a float
    sum's order differs between the read schedule and the ring; both are checked as right)."""
    from ringcomm import plain_read
    reg, errors = comm._registry, []
    for case in cases:
        got = {}
        for cma_on in (True, False):
            if reg is not None:
                reg.cma = cma_on if reg.cma is not None else None
            calls = reg.engine.calls if reg is not None else 0
            result, want = call_case(comm, case)
            err = compare(result, want, case)
            reg = comm._registry
            if err:
                errors.append(f"cma={cma_on}: {err}")
            read = reg.engine.calls - calls if reg is not None else 0
            if read != (cma_on and case["collective"] in plain_read.COLLECTIVES):
                errors.append(f"cma={cma_on}: {case}: {read} read calls")
            got[cma_on] = result.tobytes()
        exact = (case["collective"] in ("broadcast", "all_gather") or case["op"] in ("min", "max")
                 or np.dtype(case["dtype"] if case["dtype"] != "bfloat16" else "uint16").kind in "iu")
        if exact and got[True] != got[False]:
            errors.append(f"{case}: CMA and FIFO results differ")
    return errors


@pytest.mark.timeout(240)
def test_collectives_read_plain_buffers_by_cma_as_right_as_by_the_fifos():
    with World(3, {"RINGCOMM_CMA_MIN": "1", "RINGCOMM_BUFFSIZE": "65536"}, timeout=120) as w:
        errors = w.run(_both_paths, _cases(3), timeout=200)
    assert errors == [[]] * 3, "\n".join(e for errs in errors for e in errs)


def _engines_agree(comm, cases):
    """Each reducing case by CMA on the native engine (its reducing steps in fetch_reduce's compiled
    loop, counted, built the way a case's "build" names where it names one, and all_reduce's
    pieces written into every peer as they are built, but for AVG's) and on the reference engine
    (Python's loop, then the write step): right both times, the same bits."""
    from ringcomm import fetch_reduce, stream_copy
    run, enter, ran, builds, pushes, errors = fetch_reduce.run, fetch_reduce.enter, [0], [], [], []

    def counted(*args):   # Python's steps (a call handed back): fetch_reduce.run
        ran[0] += 1
        builds.append(args[9])
        pushes.append(args[11].size)
        return run(*args)

    def counted_block(block):   # the compiled call's reducing step (ReadEngine._fetch_step)
        ran[0] += 1
        builds.append(int(block.words[fetch_reduce.B_BUILD]))
        pushes.append(int(block.words[fetch_reduce.B_NPUSH]))
        return enter(block)
    fetch_reduce.run, fetch_reduce.enter = counted, counted_block
    for case in cases:
        got = {}
        for engine in ("native", "python"):
            comm._executor.engine = engine
            before = ran[0]
            result, want = call_case(comm, case)
            err = compare(result, want, case)
            if err:
                errors.append(f"{engine}: {err}")
            if (ran[0] > before) != (engine == "native"):
                errors.append(f"{engine}: {case}: {ran[0] - before} compiled steps")
            want_build = getattr(fetch_reduce, case.get("build", ""), None)
            if want_build == fetch_reduce.STREAM and not stream_copy.enabled():   # not x86-64, or turned off
                want_build = fetch_reduce.INTO_OUT
            if engine == "native" and want_build is not None and set(builds[before:]) != {want_build}:
                errors.append(f"{case}: built {builds[before:]}, not {case['build']}")
            want_push = comm.world_size - 1 if case["collective"] == "all_reduce" and case["op"] != "avg" else 0
            if engine == "native" and set(pushes[before:]) != {want_push}:
                errors.append(f"{case}: pieces written into {pushes[before:]} peers, not {want_push}")
            got[engine] = result.tobytes()
        if got["native"] != got["python"]:
            errors.append(f"{case}: the engines' bits differ")
    fetch_reduce.run, fetch_reduce.enter = run, enter
    return errors


@pytest.mark.timeout(240)
def test_reducing_read_steps_give_the_same_bits_compiled_as_in_python():
    # 2 and 3 ranks (three operands: the fold goes on past the first pair; in place on 3 ranks, a
    # rank whose own input is the third operand builds each piece in scratch), pieces and a tail
    cases = []
    for j, (coll, dtype, op) in enumerate([("all_reduce", "float32", "sum"), ("all_reduce", "float16", "avg"),
                                           ("all_reduce", "bfloat16", "prod"), ("all_reduce", "int8", "max"),
                                           ("reduce_scatter", "float64", "min"), ("reduce_scatter", "int32", "avg"),
                                           ("reduce_scatter", "float32", "sum"), ("all_reduce", "uint8", "sum")]):
        count = 3 * ((1 << 18) // np.dtype("float32" if dtype == "bfloat16" else dtype).itemsize) + 7 * 6
        cases.append(dict(collective=coll, dtype=dtype, op=op, count=count, algo=None, root=0,
                          inplace=bool(j % 2), seed=70 + j))
    # out of place, 8 MiB and 12 bytes of output a rank: built in L2 and streamed out (fetch_reduce.STREAM)
    cases.append(dict(collective="reduce_scatter", dtype="float32", op="sum", count=(2 << 20) + 3, algo=None,
                      root=0, inplace=False, seed=90, build="STREAM"))
    # 1 MiB and 12 bytes of output: streamed, as no step reads it back (reduce_scatter; all_reduce,
    # whose chunk is written into the peers as it is built); under 1 MiB fetched into the output
    n_elems = (1 << 18) + 3
    cases.append(dict(collective="reduce_scatter", dtype="float32", op="sum", count=n_elems, algo=None,
                      root=0, inplace=False, seed=91, build="STREAM"))
    cases.append(dict(collective="all_reduce", dtype="float32", op="sum", count=3 * n_elems, algo=None,
                      root=0, inplace=False, seed=92, build="STREAM"))
    cases.append(dict(collective="reduce_scatter", dtype="float32", op="max", count=n_elems - 1000, algo=None,
                      root=0, inplace=False, seed=93, build="INTO_OUT"))
    for n in (2, 3):
        with World(n, {"RINGCOMM_CMA_MIN": "1"}, timeout=120) as w:
            errors = w.run(_engines_agree, cases, timeout=200)
        assert errors == [[]] * n, "\n".join(e for errs in errors for e in errs)


def _late_and_mismatched(comm, engine):
    """On 2 ranks, copy-only calls on one engine: rank 1 entering 0.2 s late (the compiled wait
    hands over to Python's), then sizes that differ between the ranks (an error on both, no hang)."""
    comm._executor.engine = engine
    x = np.arange(50_000, dtype=np.float32) * (comm.rank + 1)
    out = np.empty(2 * x.size, np.float32)
    comm.all_gather(x, out)                  # the probe, and the compiled plan's first use
    eng = comm._registry.engine
    before = eng.handed_back
    if comm.rank == 1:   # arrives late (not a synchronisation: the results are right either way),
        time.sleep(0.2)  # so rank 0's 200 us of compiled polling end and Python's wait takes over
    comm.broadcast(x, root=1)
    got = np.empty(14, np.int64)
    comm.all_gather(np.full(7, comm.rank, np.int64), got)
    late = eng.handed_back - before
    right = bool((x == np.arange(x.size) * 2).all()) and got.tolist() == [0] * 7 + [1] * 7
    try:
        comm.broadcast(np.zeros(1000 + comm.rank, np.float32), root=0)
        mismatch = "no error"
    except ringcomm.RingcommError as e:
        mismatch = str(e)
    return right, late, mismatch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_late_peer_and_mismatched_sizes_on_the_copy_path(engine):
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=30) as w:
        results = w.run(_late_and_mismatched, engine, timeout=60)
    for rank, (right, late, mismatch) in enumerate(results):
        assert right, f"rank {rank}: wrong results"
        assert "different sizes" in mismatch, f"rank {rank}: {mismatch}"
    if engine == "native":   # rank 0 waited in compiled code first, then handed the wait to Python
        assert results[0][1] >= 1, results
    else:
        assert results[0][1] == 0, results


def _late_on_the_lane(comm):
    """A known call (repeated on the same arrays: it goes down read_engine.ReadLane, whose argument
    block holds its buffers) whose root enters 0.2 s late: rank 0's compiled call hands back mid-call
    and Python goes on from the block's buffers."""
    x = np.zeros(50_000, np.float32)
    for i in range(3):
        if comm.rank == 1:
            x[:] = np.arange(x.size) + i
        comm.broadcast(x, root=1)
    (known,) = [k for key, k in comm._known.entries.items() if key[2][0] == "broadcast"]
    eng = comm._registry.engine
    before = eng.handed_back
    if comm.rank == 1:
        x[:] = np.arange(x.size) * 3
        time.sleep(0.2)   # late (not a synchronisation: the results are right either way)
    comm.broadcast(x, root=1)
    return type(known.lane).__name__, eng.handed_back - before, bool((x == np.arange(x.size) * 3).all())


@pytest.mark.timeout(120)
def test_a_known_call_whose_peer_is_late_hands_back_from_its_lane():
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=30) as w:
        results = w.run(_late_on_the_lane, timeout=60)
    assert [r[0] for r in results] == ["ReadLane"] * 2, results
    assert all(r[2] for r in results), results
    assert results[0][1] >= 1, results   # rank 0 waited in compiled code, then in Python


def _reductions_in_compiled_calls(comm):
    """Reducing calls by CMA on the native engine: the compiled call waits for the peers and stops
    at the reducing step, which fetch_reduce runs (ReadEngine._fetch_step), and goes on to the sync
    (a rank whose compiled wait outlasts its budget goes on in Python instead: the rank that enters
    second never waits for the other to enter). Then a peer 0.2 s late (the compiled wait hands
    over to Python's), a dtype the compiled loop is made not to take (Python's steps take the rest
    of the call), and sizes that differ between the ranks (an error on both, no hang)."""
    from ringcomm import fetch_reduce, read_engine
    real, steps, runs = read_engine.ReadEngine._fetch_step, [], []
    run, enter = fetch_reduce.run, fetch_reduce.enter
    fetch_reduce.run = lambda *args: runs.append(1) or run(*args)
    fetch_reduce.enter = lambda block: runs.append(1) or enter(block)

    def counted(self, ex, sched, call, plan, ain, aout, i):
        steps.append(sched.collective)
        return real(self, ex, sched, call, plan, ain, aout, i)
    read_engine.ReadEngine._fetch_step = counted
    r, n = comm.rank, comm.world_size
    x, out = np.arange(3000, dtype=np.float32) + r, np.empty(3000, np.float32)
    part = np.empty(3000 // n, np.float32)
    want = n * np.arange(3000, dtype=np.float32) + n * (n - 1) / 2
    right = []
    for _ in range(4):
        comm.all_reduce(x, out=out)
        comm.reduce_scatter(x, part)
        right.append(bool((out == want).all() and (part == want[r * part.size:(r + 1) * part.size]).all()))
    eng, known = comm._registry.engine, list(steps)
    before = eng.handed_back
    if r == 1:   # arrives late (not a synchronisation: the results are right either way)
        time.sleep(0.2)
    comm.all_reduce(x, out=out)
    right.append(bool((out == want).all()))
    late = eng.handed_back - before
    loop, ran, compiled = fetch_reduce.loop, len(steps), len(runs)
    fetch_reduce.loop = lambda dtype: None if dtype == np.int32 else loop(dtype)
    xi = np.arange(3000, dtype=np.int32) * (r + 1)
    comm.all_reduce(xi)
    right.append(bool((xi == np.arange(3000) * n * (n + 1) // 2).all()) and len(runs) == compiled)
    fetch_reduce.loop, fetch_reduce.run, fetch_reduce.enter = loop, run, enter
    read_engine.ReadEngine._fetch_step = real
    try:
        comm.all_reduce(np.zeros(1000 + r, np.float32))
        mismatch = "no error"
    except ringcomm.RingcommError as e:
        mismatch = str(e)
    return right, known, late, steps[ran:], mismatch


@pytest.mark.timeout(120)
def test_reducing_calls_by_cma_run_compiled_up_to_their_reducing_step():
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=30) as w:
        results = w.run(_reductions_in_compiled_calls, timeout=60)
    for rank, (right, steps, late, int_steps, mismatch) in enumerate(results):
        assert all(right), (rank, right)
        assert int_steps in ([], ["all_reduce"]), int_steps   # stopped there, then went on in Python
        assert "different sizes" in mismatch, f"rank {rank}: {mismatch}"
    for coll in ("all_reduce", "reduce_scatter"):   # each call: at least on the rank that entered second
        assert sum(steps.count(coll) for _, steps, *_ in results) >= 4, results
    assert sum(len(r[3]) for r in results) >= 1, results
    assert results[0][2] >= 1, results   # rank 0 waited in compiled code, then handed the wait to Python


def _refuse(comm, how):
    if comm.rank == 1:
        if how == "eperm":  # what a Yama or container refusal returns, for this rank's probes
            cma.probe = lambda pid, addr, expect: "not permitted (faked by the test)"
        else:
            os.environ["RINGCOMM_CMA"] = "0"
    x = np.full(1 << 18, comm.rank, np.float32)
    comm.broadcast(x, root=1)
    out = np.empty(2 * x.size, np.float32)
    comm.all_gather(x, out)
    return comm._registry.cma, bool((x == 1).all()), bool((out[x.size:] == 1).all() and (out[:x.size] == 1).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["eperm", "RINGCOMM_CMA=0"])
def test_a_refused_probe_on_one_rank_keeps_every_rank_on_the_fifos(how):
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=60) as w:
        assert w.run(_refuse, how, timeout=60) == [(False, True, True)] * 2


def _die_during(comm, method, root, collective, engine):
    """Rank 0 copies by CMA to or from rank 1 (copy_to: it reads rank 1's buffer, the broadcast's
    root or an all_reduce's input chunk to reduce; copy_from: as the root it writes half of rank
    1's); rank 1 is killed just as the copy starts: in Python's Remote copy (the reference engine,
    and the native engine's copies of reducing calls), for the compiled copy-only calls
    (read_native.py) once rank 1 has entered the call and before the compiled code reads its
    descriptor, and for the native engine's reducing steps as their compiled fetch starts
    (fetch_reduce.py: it hands the piece back, and Python's read of it says why)."""
    from ringcomm import fetch_reduce, plain_read, read_engine
    comm._executor.engine = engine

    def kill(pid):
        os.kill(pid, signal.SIGKILL)
        while not _gone(pid):   # it is our sibling: a zombie of the test process, not reaped
            time.sleep(0.01)

    if method == "fetch_reduce":   # the native engine's reducing step: its compiled fetch fails
        run, enter = fetch_reduce.run, fetch_reduce.enter

        def killed_first(out, own, own_j, pids, *rest):   # (a call handed back to Python's steps)
            kill(int(pids[1 - own_j]))
            return run(out, own, own_j, pids, *rest)

        def killed_first_block(block):   # (the compiled call's reducing step)
            kill(int(comm._registry.peers[1, "ctl"].words[read_engine.PID]))
            return enter(block)
        fetch_reduce.run, fetch_reduce.enter = killed_first, killed_first_block
    elif engine == "python" or collective != "broadcast":
        original = getattr(plain_read.Remote, method)

        def killed_first(self, arr):
            kill(self.pid)
            original(self, arr)
        setattr(plain_read.Remote, method, killed_first)
    else:
        compiled = read_engine.ReadEngine._run_compiled

        def killed_first(self, *args):
            words, deadline = self.reg.peers[1, "ctl"].words, time.monotonic() + 30
            while words[read_engine.CALLS] < self.calls and time.monotonic() < deadline:
                time.sleep(0.001)   # polls until rank 1 has entered the call (its descriptor is out)
            kill(int(words[read_engine.PID]))
            return compiled(self, *args)
        read_engine.ReadEngine._run_compiled = killed_first
    _call(comm, root, collective)


def _writes_fail_then_python_writes(comm):
    """Rank 0's compiled step is given a bad address for its peer's output: every write fails
    (EFAULT), so the step reduces in full and Python writes the chunk (read_engine._reduce). In
    place too, where reducing a piece twice would double it."""
    from ringcomm import fetch_reduce
    run, enter, bad = fetch_reduce.run, fetch_reduce.enter, []

    def bad_writes(*args):   # (a call handed back to Python's steps)
        if args[11].size and comm.rank == 0:   # a step whose pieces go to the peers
            bad.append(1)
            args = (*args[:12], np.full_like(args[12], 64))   # page 0: not mapped in the peer
        return run(*args)

    def bad_writes_block(block):   # (the compiled call's reducing step)
        w = block.words
        if w[fetch_reduce.B_NPUSH] and comm.rank == 0:
            bad.append(1)
            off = w[fetch_reduce.B_OUT_OFF]
            w[fetch_reduce.B_OUT_OFF] = 1 << 47   # past the end of the peer's address space
            try:
                return enter(block)
            finally:
                w[fetch_reduce.B_OUT_OFF] = off
        return enter(block)
    fetch_reduce.run, fetch_reduce.enter = bad_writes, bad_writes_block
    right = []
    for inplace in (False, True):
        x = np.arange(1 << 19, dtype=np.float32) + comm.rank
        out = x if inplace else np.empty_like(x)
        comm.all_reduce(x, out=None if inplace else out)
        right.append(bool((out == 2 * np.arange(1 << 19, dtype=np.float32) + 1).all()))
    fetch_reduce.run, fetch_reduce.enter = run, enter
    return right, len(bad)


@pytest.mark.timeout(120)
def test_writes_into_a_peer_that_fail_in_compiled_code_are_made_by_python():
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=30) as w:
        results = w.run(_writes_fail_then_python_writes, timeout=60)
    assert [r[0] for r in results] == [[True, True]] * 2, results
    assert results[0][1] == 2 and results[1][1] == 0, results


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
        return True


def _call(comm, root, collective):
    x = np.full(1 << 20, comm.rank, np.float32)
    if collective == "broadcast":
        comm.broadcast(x, root=root)
    else:
        comm.all_reduce(x)


# (the copy the peer dies in, root, collective, what the message says this rank was doing, the
# engines that make that copy: all_reduce's reads and writes are fetch_reduce's on the native engine)
_KILLED_DURING = [
    ("copy_to", 1, "broadcast", "reading \\(CMA\\) its buffer in broadcast #\\d+ from", ("native", "python")),
    ("copy_from", 0, "broadcast", "writing \\(CMA\\) into its buffer in broadcast #\\d+ of", ("native", "python")),
    ("copy_to", None, "all_reduce", "reading \\(CMA\\) its buffer in all_reduce #\\d+ from", ("python",)),
    ("copy_from", None, "all_reduce", "writing \\(CMA\\) into its buffer in all_reduce #\\d+ of", ("python",)),
    ("fetch_reduce", None, "all_reduce", "reading \\(CMA\\) its buffer in all_reduce #\\d+ from", ("native",))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method, root, collective, doing, engine", [
    (*case[:4], engine) for case in _KILLED_DURING for engine in case[4]])
def test_a_peer_killed_during_a_cma_copy_is_reported_at_once(method, root, collective, doing, engine):
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=60) as w:
        w.start(_die_during, method, root, collective, engine, ranks=[0])
        w.start(_call, root, collective, ranks=[1])
        t0 = time.monotonic()
        status, text = w.collect([0], 60)[0]
        took = time.monotonic() - t0
        w.kill()
    assert status == "err" and "PeerFailure" in text, text
    assert re.search(rf"rank 0 \(this process\) failed {doing} rank 1 over shm: rank 1 \(pid \d+\) died", text), text
    assert took < 20, f"the dead peer was reported after {took:.1f} s"
