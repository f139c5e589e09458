"""The native engine's pieces: its arithmetic against the host kernels, its memory ordering, and
that it stands aside where it does not apply. (The collective matrix, tests/test_collectives.py,
runs every shm case on both engines and compares their bits.)"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import ringcomm
from harness import World
from ringcomm.kernels import host, native

OPS = ("sum", "prod", "min", "max", "avg")


@pytest.fixture(scope="module")
def compiled():
    import numba
    reduce_into, avg_into = native.compiled()

    @numba.njit
    def red(out, a, b, op, kind16):
        reduce_into(out, a, b, op, kind16)

    @numba.njit
    def avg(arr, n, kind16):
        avg_into(arr, n, kind16)
    return red, avg


def _operands(dt, size, rng):
    if dt.kind in "iu":
        info = np.iinfo(dt)
        a, b = (rng.integers(info.min, info.max, size, dtype=dt, endpoint=True) for _ in range(2))
        a[:2], b[:2] = (info.min, info.max), (info.max, info.min)   # wrap-around at both ends
        return a, b
    a, b = ((rng.standard_normal(size) * 1e3).astype(np.float32).astype(dt) for _ in range(2))
    specials = np.array([np.nan, 1.0, np.inf, -np.inf, 3.0, np.nan], np.float32).astype(dt)
    a[:6], b[:6] = specials, specials[::-1]      # NaN against numbers, inf - inf, never NaN vs NaN
    return a, b


@pytest.mark.parametrize("dtype", [str(d) for d in host.SUPPORTED_DTYPES])
def test_reductions_give_the_host_kernels_bits(compiled, dtype):
    red, avg = compiled
    dt = np.dtype(host.BFLOAT16 if dtype == "bfloat16" else dtype)
    if not native.supported(dt):
        pytest.skip(f"{dt}: this CPU lacks the half conversions; the executor keeps it in Python")
    st, k16 = native.storage(dt), native.kind16(dt)
    rng = np.random.default_rng(12)
    for size in (7, 1000):                        # numpy's scalar tail and its SIMD loops
        a, b = _operands(dt, size, rng)
        for op in OPS:
            want = host.reduce_copy(np.empty_like(a), a, b, op)
            got = np.empty_like(a)
            red(got.view(st), a.view(st), b.view(st), native.OPCODES[op], k16)
            assert got.tobytes() == want.tobytes(), (dt, op, size)
            inplace = a.copy()                    # out is a: the executor's fold of a further source
            red(inplace.view(st), inplace.view(st), b.view(st), native.OPCODES[op], k16)
            assert inplace.tobytes() == want.tobytes(), (dt, op, size, "in place")
            if op == "avg":
                for n in (2, 3, 7, 8):
                    w = host.postprocess(want.copy(), "avg", n)
                    g = want.copy()
                    avg(g.view(st), n, k16)
                    assert g.tobytes() == w.tobytes(), (dt, n)


def _sees_the_store(wait_for):
    """Run ``wait_for(addr)`` (a compiled wait that gives up after 30 s) in a thread, store 1 at
    addr from this one: whether the wait saw it."""
    word = np.zeros(1, np.int64)
    seen, started = [], threading.Event()

    def waiter():
        started.set()
        seen.append(wait_for(word.ctypes.data))
    t = threading.Thread(target=waiter)
    t.start()
    started.wait(10)
    word[0] = 1
    t.join(60)
    return seen == [True]


def test_a_compiled_spin_sees_the_peers_store():
    """An acquire load is re-read on every poll: a spin waiting on a word another thread stores
    returns, instead of spinning on a value LLVM hoisted out of the loop."""
    import numba

    from ringcomm import engine_native, native_sync
    engine_native.kernel()
    wait = engine_native._wait_above
    hz = native_sync.cycles_per_second()

    @numba.njit(nogil=True)
    def spin(addr, spin_cycles):
        return wait(addr, 0, spin_cycles)

    assert _sees_the_store(lambda addr: spin(addr, int(30 * hz)))


def _waiting_loop_ctl(yields, budget_s):
    from ringcomm import engine_native as en, native_sync
    ctl = np.zeros(en.CTL_SIZE, np.int64)
    ctl[en.YIELDS:en.FUTEX_NR + 1] = en._yields_and_wakes(0.0)
    ctl[en.YIELDS], ctl[en.BUDGET] = yields, int(budget_s * native_sync.cycles_per_second())
    return ctl


def test_a_compiled_wait_among_more_ranks_than_cores_yields_until_the_store_or_its_budget():
    """Where ranks outnumber cores the loop's waits do not spin: they sched_yield() (so a rank
    queued on this core runs) and look again, until the peer's store or the budget; then Python's
    wait takes over, as before."""
    import numba

    from ringcomm import engine_native as en, native_sync
    en.kernel()
    wait = en._wait
    assert en._yields_and_wakes(0.0)[0] > 0 and en._yields_and_wakes(2e-3)[0] == 0   # spinning ranks never yield here

    @numba.njit(nogil=True)
    def waiting(ctl, addr):
        return wait(ctl, addr, 0, 0, native_sync.cycles())

    word = np.zeros(1, np.int64)
    assert not waiting(_waiting_loop_ctl(0, 30.0), word.ctypes.data)        # no yields: one look
    t0 = time.perf_counter()   # (after the first call, which compiled `waiting`: seconds on a busy machine)
    assert not waiting(_waiting_loop_ctl(10**9, 0.002), word.ctypes.data)   # endless yields, 2 ms budget
    assert time.perf_counter() - t0 < 1.0
    ctl = _waiting_loop_ctl(10**12, 30.0)
    assert _sees_the_store(lambda addr: waiting(ctl, addr))


def test_the_loop_wakes_a_peer_asleep_on_a_counter_it_moved():
    """The compiled loop wakes a sleeping peer itself (futex), instead of returning to Python for it."""
    import numba

    from ringcomm import engine_native as en
    from ringcomm.transport import futex, shm
    if not futex.available():
        pytest.skip("no futex here: Python's waits sleep in plain pauses, nothing to wake")
    en.kernel()
    wake = en._wake_sleepers

    @numba.njit(nogil=True)
    def wake_receiver(row, conns, ctl):
        wake(row, conns, 0, 1, 0, ctl)

    header = np.zeros(64, np.int64)                  # a segment's words: the receiver sleeps on POSTED
    header[shm.RECV_SLEEPS] = 1
    conns = np.zeros((1, en.CONN_COLUMNS), np.int64)
    conns[0, en.WORDS] = header.ctypes.data
    row = np.zeros(en.PEERS + 1, np.int64)           # one destination: connection row 0
    ctl = _waiting_loop_ctl(0, 1.0)
    sleeper = threading.Thread(target=futex.wait, args=(header.ctypes.data + 8 * shm.POSTED, 0, 30.0))
    t0 = time.perf_counter()
    sleeper.start()
    while sleeper.is_alive() and time.perf_counter() - t0 < 20:
        wake_receiver(row, conns, ctl)               # until the sleeper is asleep and woken
        sleeper.join(0.01)
    assert not sleeper.is_alive() and time.perf_counter() - t0 < 20   # woken, not timed out (30 s)


def test_a_compiled_cma_wait_among_more_ranks_than_cores_yields_within_its_budget():
    import numba

    from ringcomm import native_sync, read_native as rn
    rn.kernel()
    wait = rn._wait_at_least

    @numba.njit(nogil=True)
    def waiting(addr, consts):
        return wait(addr, 1, consts)

    word = np.zeros(1, np.int64)
    assert not waiting(word.ctypes.data, rn.constants(4, 0, 0, yields=0))   # one look (and compiles `waiting`)
    consts = rn.constants(4, 0, 0, yields=10**9)
    assert consts[rn.YIELDS] == 10**9 and consts[rn.YIELD_BUDGET] > 0
    t0 = time.perf_counter()
    assert not waiting(word.ctypes.data, consts)   # endless yields, YIELD_S budget
    assert time.perf_counter() - t0 < 1.0
    consts[rn.YIELD_BUDGET] = int(30 * native_sync.cycles_per_second())
    assert _sees_the_store(lambda addr: waiting(addr, consts))


def _engine_use(comm):
    x = np.arange(3000, dtype=np.float32)
    comm.all_reduce(x)
    plans = [p for _, p in comm._executor._plans.values()]
    return comm._executor.engine, [type(p).__name__ for p in plans], float(x[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_native_over_shm_reference_elsewhere(transport):
    with World(2, {"RINGCOMM_TRANSPORT": transport}, timeout=60) as w:
        results = w.run(_engine_use, timeout=90)
    for engine, plans, x1 in results:
        assert engine == "native" and x1 == 2.0
        # over shm the call got a native plan; over tcp the native plan is None and the call ran
        # the reference engine's plan (a list of slices)
        want = {"NativePlan"} if transport == "shm" else {"NoneType", "list"}
        assert set(plans) == want, plans


def _arrivals(comm):
    """Executor.has_arrived around one 16-byte message 0 -> 1, after the native engine ran calls
    over the link (it keeps the links' counters while it runs: the probe must see through that)."""
    x = np.ones(1000, np.float32)
    for _ in range(3):
        comm.all_reduce(x)                      # the native engine moves the link's counters
    ex = comm._executor
    if comm.rank == 0:
        comm.send(np.arange(4, dtype=np.float32), 1)
        comm.recv(np.empty(1, np.float32), 1)   # sends nothing more until rank 1 has looked
        return None
    deadline, seen = time.monotonic() + 30, ex.has_arrived(0)
    while not seen and time.monotonic() < deadline:   # polls what the send makes visible, with a deadline
        time.sleep(0.001)
        seen = ex.has_arrived(0)
    got = np.empty(4, np.float32)
    comm.recv(got, 0)
    after = ex.has_arrived(0)
    comm.send(np.zeros(1, np.float32), 0)
    return seen, after, got.tolist(), ex.has_arrived(1), ex.has_arrived(7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "python"])
def test_has_arrived_sees_a_message_not_yet_taken(engine):
    with World(2, {"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_ENGINE": engine}, timeout=60) as w:
        _, mine = w.run(_arrivals, timeout=90)
    assert mine == (True, False, [0.0, 1.0, 2.0, 3.0], None, None), mine


def _odd_inputs(comm):
    """A read-only input and an unaligned one (a float32 view one byte into its buffer)."""
    from ringcomm import engine_native as en
    n, r = comm.world_size, comm.rank
    want = np.arange(3000, dtype=np.float32) * n + n * (n - 1) / 2
    ro = np.arange(3000, dtype=np.float32) + r
    ro.flags.writeable = False
    out = np.empty_like(ro)
    comm.all_reduce(ro, out=out)
    raw = bytearray(4 * 3000 + 1)
    odd = np.frombuffer(raw, np.float32, 3000, offset=1)
    odd[:] = np.arange(3000, dtype=np.float32) + r
    native_ran = comm._executor.native.run
    ran = []
    comm._executor.native.run = lambda plan, call: ran.append(native_ran(plan, call)) or ran[-1]
    comm.all_reduce(odd)
    return (out.tobytes() == want.tobytes(), odd.tobytes() == want.tobytes(), ran,
            len(en.kernel(np.float32).signatures))


@pytest.mark.timeout(120)
def test_read_only_and_unaligned_inputs_need_no_second_compiled_loop():
    """The loop's input is typed read-only (warm_once): a read-only input and an unaligned one
    both run in the one compiled version (before, a read-only input compiled a second, ~5 s)."""
    with World(2, {"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_CMA": "0"}, timeout=60) as w:
        results = w.run(_odd_inputs, timeout=90)
    assert results == [(True, True, [True], 1)] * 2, results


def _mismatch(comm, engine):
    comm._executor.engine = engine
    x = np.ones(3000 if comm.rank == 0 else 2999, np.float32)
    try:
        comm.all_reduce(x, algo="ring")
    except ringcomm.RingcommError as e:
        return str(e).splitlines()[0]
    return "no error"


@pytest.mark.timeout(120)
def test_size_mismatch_has_the_reference_engines_message():
    texts = {}
    for engine in ("native", "python"):
        with World(2, {"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_BUFFSIZE": "8192"}, timeout=10) as w:
            texts[engine] = w.run(_mismatch, engine, timeout=60)
    assert "expected" in texts["native"][0] or "expected" in texts["native"][1], texts
    assert texts["native"] == texts["python"], texts


@pytest.mark.parametrize("dtype", ["uint8", "float32"])   # a tail of single bytes; whole words
def test_streamed_slot_copies_land_exactly(dtype):
    """_stream streams whole 8-byte words past the caches and finishes a 1-
    or 2-byte type's last bytes plainly: every byte arrives, from an unaligned source, and nothing
    past the slice is written."""
    from ringcomm import engine_native
    engine_native.kernel()                         # jits the helpers, _stream among them
    dt = np.dtype(dtype)
    rng = np.random.default_rng(3)
    for nbytes in (engine_native.STREAM_MIN - 8, engine_native.STREAM_MIN, 65536 + 6, 65536 + 8):
        k = nbytes // dt.itemsize
        raw = np.zeros(nbytes + 256, np.uint8)
        start = (-raw.ctypes.data) % 64            # a slot starts 64-byte aligned
        dst = raw[start:start + k * dt.itemsize + 64].view(dt)
        src_raw = rng.integers(0, 256, k * dt.itemsize + 3, dtype=np.uint8)
        src = src_raw[3:].view(dt)                 # a source 3 bytes off any alignment
        engine_native._stream(dst[:k], src)
        assert dst[:k].tobytes() == src.tobytes(), (dtype, nbytes)
        assert not dst[k:].view(np.uint8).any(), (dtype, nbytes)   # the bytes after the slice


def _big_cases_on_engines(comm):
    """Slices of full slots (RINGCOMM_BUFFSIZE's default) on both engines, and what the send ends'
    store choice measured (the adaptive mode must have timed both ways)."""
    from cases import COUNTS, run_cases_on_engines
    from ringcomm import engine_native as en
    cases = [dict(collective=c, dtype=("float32", "uint8")[i % 2], op="sum", count=COUNTS[-1], algo=None,
                  root=i % comm.world_size, inplace=bool(i % 2), seed=i)
             for i, c in enumerate(("all_reduce", "all_gather", "reduce_scatter", "broadcast"))]
    errors = run_cases_on_engines(comm, cases)   # 4 MiB a case: 16 slices a send, a trial's worth
    eng = comm._executor.native
    costs = eng.conns[:len(eng.objs), [en.STREAM_COST, en.PLAIN_COST]].tolist()
    return errors, costs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stores", ["auto", "stream", "plain"])
def test_slot_stores_every_way_give_the_reference_bits(stores):
    env = {"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_CMA": "0", "RINGCOMM_SLOT_STORES": stores}
    with World(2, env, timeout=120) as w:
        results = w.run(_big_cases_on_engines, timeout=280)
    for errors, costs in results:
        assert errors == [], "\n".join(errors)
        measured = [c for c in costs if any(c)]   # the send ends (receive ends never store)
        if stores == "auto":
            assert measured and all(s > 0 and p > 0 for s, p in measured), costs
        else:
            assert measured == [], costs           # a fixed way measures nothing


def _send_ends_after(comm, calls):
    """(PLAIN, TRIALS, USUAL, STREAM_COST > 0, PLAIN_COST > 0) of each send end after ``calls``
    more 256 KiB ring all_reduces (2 ranks: a slice or two a send each)."""
    from ringcomm import engine_native as en
    x = np.ones(64 << 10, np.float32)
    for _ in range(calls):
        comm.all_reduce(x, algo="ring")
    eng = comm._executor.native
    return [(int(eng.conns[i, en.PLAIN]), int(eng.conns[i, en.TRIALS]), int(eng.conns[i, en.USUAL]),
             bool(eng.conns[i, en.STREAM_COST]), bool(eng.conns[i, en.PLAIN_COST]))
            for i, conn in enumerate(eng.objs) if type(conn).__name__ == "ShmSend"]


def test_auto_stores_start_plainly_and_first_try_streaming_once_settled():
    from ringcomm import engine_native as en
    settle = 8 + en.TRIAL_MEASURED          # a round of the 8 slots, then the measured slices
    env = {"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_CMA": "0", "RINGCOMM_SLOT_STORES": "auto",
           "RINGCOMM_NSLOTS": "8"}
    with World(2, env, timeout=120) as w:
        early = w.run(_send_ends_after, 3)
        later = w.run(_send_ends_after, 2 * settle)
    for ends in early:   # a few slices: plain stores timed, no trial yet
        assert len(ends) == 1, ends
        plain, trials, usual, stream, plain_cost = ends[0]
        assert (plain, trials, stream, plain_cost) == (1, 0, False, True) and 3 <= usual < settle, ends
    for ends in later:   # `settle` usual slices, then the first trial of streaming, which measured it
        assert [(trials >= 1, usual, stream) for _, trials, usual, stream, _ in ends] == [(True, settle, True)], ends


def test_trial_wait_backs_off_while_plain_and_comes_sooner_while_streaming():
    from ringcomm import engine_native as en
    explore = 1 << 20
    assert [en._trial_wait(explore, t, 1) for t in range(7)] == [explore << min(t, en.TRIAL_BACKOFF) for t in range(7)]
    assert [en._trial_wait(explore, t, 0) for t in range(7)] == [explore >> max(0, en.EARLY_TRIALS - t)
                                                                for t in range(7)]
    assert en._trial_wait(explore, 99, 1) == explore << en.TRIAL_BACKOFF and en._trial_wait(explore, 99, 0) == explore


def test_slot_stores_knob_is_checked(monkeypatch):
    from ringcomm import engine_native as en
    for name, mode in en.STORE_MODES.items():
        monkeypatch.setenv("RINGCOMM_SLOT_STORES", name.upper())
        assert en.slot_stores(64) == mode           # as given, however many ranks
    monkeypatch.setenv("RINGCOMM_SLOT_STORES", "fast")
    with pytest.raises(ValueError, match="RINGCOMM_SLOT_STORES='fast'"):
        en.slot_stores(2)
    monkeypatch.delenv("RINGCOMM_SLOT_STORES")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert en.slot_stores(cores) == en.STORES_AUTO
    assert en.slot_stores(cores + 1) == en.STORES_PLAIN    # more ranks than cores: the measured default


def _lock_path(dtype):
    from ringcomm import engine_native as en
    from ringcomm.kernels import native
    return os.path.join(en.kernel(dtype)._cache._cache_path,
                        f"ringcomm-engine-compile-{os.getuid()}-{native.storage(dtype).name}.lock")


def test_warm_once_compiles_under_a_lock_it_releases_and_never_waits_past_its_deadline(monkeypatch):
    import fcntl

    from ringcomm import engine_native as en
    monkeypatch.setattr(en, "_warmed", {})
    loop = en.warm_once(np.float32)
    assert en._warmed == {np.dtype(np.float32): loop} and loop is en.kernel(np.float32)
    fd = os.open(_lock_path(np.float32), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # released: another holder gets it at once
        # Another element type has a lock of its own: held here, it does not delay float64.
        t0 = time.monotonic()
        en.warm_once(np.float64)
        assert time.monotonic() - t0 < 20 and np.dtype(np.float64) in en._warmed
        # Held by someone else (this fd): warm_once waits its deadline out, then compiles anyway.
        monkeypatch.setattr(en, "COMPILE_LOCK_WAIT_S", 0.2)
        monkeypatch.setattr(en, "_warmed", {})
        t0 = time.monotonic()
        en.warm_once(np.float32)
        assert 0.2 <= time.monotonic() - t0 < 30 and np.dtype(np.float32) in en._warmed
    finally:
        os.close(fd)


def test_each_element_type_has_its_own_loop_and_cache_files():
    """One dispatcher per storage type, its cache files named after it: two processes compiling
    different types never write the same index. Both 16-bit floats share uint16's."""
    import glob

    from ringcomm import engine_native as en
    from ringcomm.kernels import host
    loops = {dt: en.warm_once(dt) for dt in host.SUPPORTED_DTYPES if en.native_kernels.supported(dt)}
    assert len({id(k) for k in loops.values()}) == len({en.native_kernels.storage(d) for d in loops})
    for dt, loop in loops.items():
        name = f"_run_{en.native_kernels.storage(dt).name}"
        assert loop.py_func.__qualname__ == name
        assert len(loop.signatures) == 1
        assert glob.glob(os.path.join(loop._cache._cache_path, f"engine_native.{name}-*.nbi")), name


def _cache_files(tmp_path, mtime):
    """A module, and numba's cache files of one function of it, written at ``mtime``."""
    module, cache = tmp_path / "mod.py", tmp_path / "__pycache__"
    cache.mkdir()
    module.write_text("")
    files = [cache / "mod.fn-12.py311.nbi", cache / "mod.fn-12.py311.1.nbc"]
    for f in files:
        f.write_bytes(b"x")
        os.utime(f, (mtime, mtime))
    return module, files


def test_a_compiled_functions_disk_cache_goes_stale_with_its_dependencies(tmp_path):
    from ringcomm import native_sync
    written = os.stat(native_sync.__file__).st_mtime + 10     # after native_sync.py's last edit
    dep = tmp_path / "layout.py"
    dep.write_text("")
    os.utime(dep, (written + 100, written + 100))              # edited after the cache was written
    module, files = _cache_files(tmp_path, written)
    native_sync.drop_stale_cache(str(module), "fn")            # no dependency newer: kept
    assert all(f.exists() for f in files)
    native_sync.drop_stale_cache(str(module), "fn", deps=[dep])
    assert not any(f.exists() for f in files)


def test_a_cache_index_another_rank_dropped_first_is_no_error(tmp_path, monkeypatch):
    """Two ranks starting on a stale cache both find its index; one unlinks it before the other
    looks at its time (this raised FileNotFoundError in a rank's first compiled call)."""
    import glob

    from ringcomm import native_sync
    module, files = _cache_files(tmp_path, 1e9)
    gone = str(files[0]).replace("fn-12", "fn-13")              # listed, but no longer there
    real_glob = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern: [gone] + real_glob(pattern) if pattern.endswith(".nbi")
                        else real_glob(pattern))
    native_sync.drop_stale_cache(str(module), "fn")            # the real, stale one still goes
    assert not any(f.exists() for f in files)
