"""The native engine: the executor's slice loop compiled by numba, for calls whose links are all shm.

The reference engine (executor.py) runs a slice plan in Python: per slice, wait for the
incoming slot, acquire the outgoing one, reduce or copy, post, release -- about 5 us of
interpreter per slice. Here the same plan is an int64 table (one row per slice, PLAN_COLUMNS)
and the same loop runs as machine code with the GIL released (nogil), over the shm segments'
header words and slots by address: no Python per slice.

The compiled loop never blocks for long. When a counter it needs has not moved after
``spin`` cycles of polling (PAUSE between polls), or when ``budget`` cycles (~1 ms) have
passed, it returns to Python with where it stopped. Python then waits the reference engine's
way -- conn.wait / conn.acquire, with their deadline, abort(), peer liveness and watchdog, and
the very same error messages -- and calls the loop again from that slice. Returning every
millisecond also lets Python run signal handlers (Ctrl-C, SIGTERM's cleanup) during long calls.
Where the host's ranks outnumber its cores nobody spins (spin is 0): a wait sched_yield()s in the
loop (YIELDS times, within the budget), so a rank queued on this core runs at once, without a
trip through Python; and the loop wakes peers asleep on the counters it moved (futex) itself.

Same bits as the reference engine: the rows replay executor._slice's decisions (what is
reduced into what, in which order, where AVG divides) and the reductions are
ringcomm.kernels.native's, which are host.py's arithmetic. Kernels are compiled once per
element type (every op is in each) and cached on disk by numba (``cache=True``): a new process
loads them instead of compiling.
"""
from __future__ import annotations

import os
import threading
import time
import types

import numpy as np

from ringcomm.kernels import native as native_kernels
from ringcomm.transport import futex, shm
from ringcomm.transport.base import Backoff
from ringcomm.transport.futex import FUTEX_WAKE

from . import native_sync
from .env import oversubscribed

# A plan row: flags, offsets and the connection-table rows of the slice's peers.
F_RECVS, F_REDUCES, F_COPIES, F_FINAL, F_BASE_OUT = 1, 2, 4, 8, 16   # F_BASE_OUT: step.base == "out"
FLAGS, IO, OO, K, NBYTES, NSRC, NDST, PEERS = range(8)   # PEERS: nsrc source rows, then ndst dest rows
# The control block: what a call on a plan passes in, and (NEXT, STATUS, CONN) what the loop hands
# back. Where to start and how long to poll change from call to call: those are arguments.
NEXT, STATUS, CONN, NSLOTS, SLOT_BYTES, OP, KIND16, NRANKS, AVG, BUDGET, MAXSRC, STORES, EXPLORE, \
    YIELDS, YIELD_FN, SYSCALL_FN, FUTEX_NR = range(17)
CTL_SIZE = 17
DONE, YIELD, BLOCKED_RECV, BLOCKED_SEND, BAD_SIZE, WAKE = range(6)
SPIN_ROUND_S = 200e-6
# The first poll of a wait is shorter: then Python asks whether the peer waits for this very CPU
# (the link's peer_waits_for_my_cpu, see transport.base.CpuWatch: the scheduler stacked both ranks
# on one core, as it does when busy processes hold the other). If so, every round is a short poll
# and a sched_yield, which hands the core to the peer at once; 200 us rounds cost each hand-off
# 200 us (measured, 2 ranks stacked: broadcast 2.3 GB/s at any size, one 64 KiB slice per ~28 us).
FIRST_ROUND_S, STACKED_ROUND_S = 50e-6, 5e-6
# Connection table columns: the segment's header words, its first slot, this end's counter; then,
# for a send end (see _to_slot): what its slot copies cost with streaming and with ordinary stores
# (cycles per KiB, running averages; 0: not measured yet), the way it stores now (PLAIN: 1 for
# ordinary stores, the way a new connection starts; decided from the costs outside trials and held
# through one, while the trial's samples move them), when it last tried the other way (cycle
# counter), the slices left in that trial, how many trials it has begun, and how many slices it
# has stored the usual way (counted up to a round of the slots plus TRIAL_MEASURED: _to_slot).
WORDS, SLOTS, COUNT, STREAM_COST, PLAIN_COST, PLAIN, TRIED, TRIAL, TRIALS, USUAL = range(10)
CONN_COLUMNS = 10
# From this many bytes a copy into a slot may stream (non-temporal stores, see _to_slot); below it
# a slice is a few lines whose ordinary stores cost less than the fence that streaming needs.
STREAM_MIN = 4096
# How a send end stores into its slots (RINGCOMM_SLOT_STORES): measured and chosen per connection
# (auto), or always one way.
STORES_AUTO, STORES_STREAM, STORES_PLAIN = range(3)
STORE_MODES = {"auto": STORES_AUTO, "stream": STORES_STREAM, "plain": STORES_PLAIN}
EXPLORE_S = 0.025   # auto: the way not taken is tried again after this long (see _trial_wait),
EARLY_TRIALS = 5    # while streaming, the first trials sooner (after 1/32, 1/16, ... of it),
TRIAL_BACKOFF = 4   # while storing plainly, each trial doubles the wait, up to 2**this times it,
TRIAL_MEASURED = 4  # each for a round of the slots (their lines settle where that way puts them), then this many slices
PLAIN_FACTOR = 1.5  # auto: ordinary stores unless they cost the sender this many times streaming
TRIAL_ABORT = 8     # auto: a trial stops at a first copy this many times dearer than the usual way


def _wait_above(addr, floor, spin):
    """Poll the int64 at addr until it exceeds floor, for at most ``spin`` cycles."""
    if native_sync.load_acquire(addr) > floor:
        return True
    if spin <= 0:
        return False
    t0 = native_sync.cycles()
    while True:
        for _ in range(32):
            native_sync.cpu_pause()
            if native_sync.load_acquire(addr) > floor:
                return True
        if native_sync.cycles() - t0 > spin:
            return False


_yield_until = native_sync.yield_until   # compiled with the other helpers (kernel())


def _wait(ctl, addr, floor, spin, t0):
    """_wait_above; then, where ranks outnumber cores (ctl[YIELDS] > 0), sched_yield()s within the
    loop's budget (native_sync.yield_until)."""
    return _wait_above(addr, floor, spin) or _yield_until(addr, floor + 1, ctl[YIELD_FN], ctl[YIELDS], t0,
                                                          ctl[BUDGET])


def _slot(conns, c, nslots, slot_bytes, like, k):
    """The slot connection row c uses next, as an array of k elements of like's type."""
    addr = conns[c, SLOTS] + (conns[c, COUNT] % nslots) * slot_bytes
    return numba_carray(native_sync.typed_ptr(addr, like), k)


def _run(plan, conns, ctl, inp_array, out, i, spin):
    # From row i; a blocked wait polls for ``spin`` cycles before it hands the wait to Python.
    # The input through a pointer of the output's type: x and the slots unify to one array type.
    # (inp_array is typed read-only: see warm_once.)
    inp = numba_carray(native_sync.typed_ptr(inp_array.ctypes.data, out), inp_array.size)
    nslots, maxsrc = ctl[NSLOTS], ctl[MAXSRC]
    t0 = native_sync.cycles()
    while i < plan.shape[0]:
        row = plan[i]
        nbytes, nsrc, ndst = row[NBYTES], row[NSRC], row[NDST]
        # Everything this slice needs must be ready before it touches any byte: a return to
        # Python in the middle of a slice would leave it half done.
        for j in range(nsrc):
            c = row[PEERS + j]
            want = conns[c, COUNT]
            if not _wait(ctl, conns[c, WORDS] + 8 * shm.POSTED, want, spin, t0):
                return _stop(ctl, i, BLOCKED_RECV, c)
            if native_sync.load_acquire(conns[c, WORDS] + 8 * (shm.SIZES + want % nslots)) != nbytes:
                return _stop(ctl, i, BAD_SIZE, c)
        for j in range(ndst):
            c = row[PEERS + maxsrc + j]
            if not _wait(ctl, conns[c, WORDS] + 8 * shm.RELEASED, conns[c, COUNT] - nslots, spin, t0):
                return _stop(ctl, i, BLOCKED_SEND, c)
        _move(row, conns, ctl, inp, out)
        if ndst and nbytes >= STREAM_MIN:
            native_sync.stream_fence()          # streamed slot stores are weakly ordered: all land first
        for j in range(nsrc):                   # give the incoming slots back
            c = row[PEERS + j]
            conns[c, COUNT] += 1
            native_sync.store_release(conns[c, WORDS] + 8 * shm.RELEASED, conns[c, COUNT])
        for j in range(ndst):                   # size first, then the counter that publishes both
            c = row[PEERS + maxsrc + j]
            native_sync.store_release(conns[c, WORDS] + 8 * (shm.SIZES + conns[c, COUNT] % nslots), nbytes)
            conns[c, COUNT] += 1
            native_sync.store_release(conns[c, WORDS] + 8 * shm.POSTED, conns[c, COUNT])
        i += 1
        if _wake_sleepers(row, conns, nsrc, ndst, maxsrc, ctl):
            return _stop(ctl, i, WAKE, i - 1)   # Python wakes it, then calls again from i
        if native_sync.cycles() - t0 > ctl[BUDGET] and i < plan.shape[0]:
            return _stop(ctl, i, YIELD, -1)
    return _stop(ctl, i, DONE, -1)


def _move(row, conns, ctl, inp, out):
    """One slice's data work, as executor._slice does it: the slots are ready."""
    nslots, slot_bytes, op, kind16, maxsrc = ctl[NSLOTS], ctl[SLOT_BYTES], ctl[OP], ctl[KIND16], ctl[MAXSRC]
    flags, io, oo, k, nsrc, ndst = row[FLAGS], row[IO], row[OO], row[K], row[NSRC], row[NDST]
    x = out[oo:oo + k] if flags & F_BASE_OUT else inp[io:io + k]
    if flags & F_REDUCES:
        # Reduce into the output if the step copies, else into the first outgoing slot; further
        # sources fold into that value in order.
        if flags & F_COPIES:
            value = out[oo:oo + k]
        else:
            value = _slot(conns, row[PEERS + maxsrc], nslots, slot_bytes, inp, k)
        for j in range(nsrc):                   # one call site: one copy of every op's loop
            a = x if j == 0 else value
            native_reduce(value, a, _slot(conns, row[PEERS + j], nslots, slot_bytes, inp, k), op, kind16)
        if flags & F_FINAL and ctl[AVG]:
            native_avg(value, ctl[NRANKS], kind16)
        first = 0 if flags & F_COPIES else 1    # the first slot already holds the value
    else:
        value = _slot(conns, row[PEERS], nslots, slot_bytes, inp, k) if flags & F_RECVS else x
        in_place = x.ctypes.data == out.ctypes.data + oo * out.itemsize   # copying onto itself
        if flags & F_COPIES and not (in_place and not flags & F_RECVS):
            _copy(out[oo:oo + k], value)
        first = 0
    for j in range(first, ndst):
        c = row[PEERS + maxsrc + j]
        _to_slot(conns, c, ctl, _slot(conns, c, nslots, slot_bytes, inp, k), value)


def _wake_sleepers(row, conns, nsrc, ndst, maxsrc, ctl):
    """Wake the peers asleep on a counter this row just moved (transport/futex.py), as the links'
    wake_peer; True if one sleeps where futex is missing (FUTEX_NR < 0: Python's turn). The fence
    keeps the flags' loads after the counters' stores: without it a peer that went to sleep just
    then could miss its wake-up until its sleep times out."""
    if nsrc + ndst == 0:
        return False
    native_sync.fence()
    for j in range(nsrc + ndst):
        w = conns[row[PEERS + j if j < nsrc else PEERS + maxsrc + j - nsrc], WORDS]
        flag, word = (shm.SEND_SLEEPS, shm.RELEASED) if j < nsrc else (shm.RECV_SLEEPS, shm.POSTED)
        if native_sync.load_acquire(w + 8 * flag):
            if ctl[FUTEX_NR] < 0:
                return True
            native_sync.call_c(ctl[SYSCALL_FN], ctl[FUTEX_NR], w + 8 * word, FUTEX_WAKE, 0x7FFFFFFF, 0, 0)
    return False


def _stop(ctl, i, status, c):
    ctl[NEXT], ctl[STATUS], ctl[CONN] = i, status, c
    return status


def _copy(dst, src):
    for i in range(dst.size):
        dst[i] = src[i]


def _to_slot(conns, c, ctl, dst, src):
    """dst (a slot of send connection row c) = src, streamed or with ordinary stores.

    Which is faster depends on where the machine put the two cores, and a VM moves them every few
    seconds (bench/placement.py). An ordinary store must first own its line, and the peer read
    this slot's lines the last time round. Where the cores are far apart (this VM: a cache line's
    round trip ~340 ns) every line is a slow trip and streaming stores, which skip the fetch, win
    5-8x (2-rank 1 MiB broadcast 51-56 us against 428-432). Where they are near (~90 ns),
    ordinary stores win 1.7x (33-35 us against 56-60): the line comes from the shared cache, and
    the peer then reads the slice from there, not from memory. The sender's own copy tells the
    two apart: ordinary stores cost it ~70 cycles per KiB near and ~900 far, streaming ~90-180
    either way. So each send end keeps a running average of both (cycles per KiB), stores the
    cheaper way (ordinary ones unless they cost PLAIN_FACTOR times more), and now and then
    (_trial_wait) tries the other way for a round of the slots plus TRIAL_MEASURED slices: only
    those last ones count, since the first copy after the other way finds the lines where that
    way left them (after streaming, in memory: 235-290 cycles per KiB near). A trial's figure is
    the mean of those slices alone. A new end stores plainly, and first tries streaming once its
    own figure has settled over as many slices: a figure taken cold is wrong for a while (1087
    cycles per KiB for ordinary stores near, against ~60 settled), and when a cold first trial
    decided, a 2-rank 256 KiB broadcast streamed at 18-20 us a call where ordinary stores take
    10. (New ends used to start streaming, with early trials to correct it; those trials, one
    every few ms, cost the first rows of a sweep: 2-rank all_reduce 64 KiB 16.7 against 11.5 us
    with ordinary stores forced.) Far apart, a new end pays for that start once: 12 slices of
    ordinary stores at ~900 cycles per KiB, ~1 ms at 256 KiB slices. A trial copy that costs
    TRIAL_ABORT times the usual way ends the trial at once: far apart, a whole trial of ordinary
    stores cost ~1.5 ms, and showed as a 4x slower 256 KiB row. The caller fences before it
    publishes the slot either way (streaming stores are not kept in order by x86's TSO)."""
    nbytes = dst.size * dst.itemsize
    mode = ctl[STORES]
    if nbytes < STREAM_MIN or mode == STORES_PLAIN:
        _copy(dst, src)
        return
    if mode == STORES_STREAM:
        _stream(dst, src)
        return
    t0 = native_sync.cycles()
    plain = conns[c, PLAIN] != 0
    trial = conns[c, TRIAL]
    if trial > 0:
        plain = not plain                         # trying the other way
        conns[c, TRIAL] = trial - 1
    if plain:
        _copy(dst, src)
    else:
        _stream(dst, src)
    cost = (native_sync.cycles() - t0) * 1024 // nbytes + 1
    col = PLAIN_COST if plain else STREAM_COST
    usual = conns[c, STREAM_COST if plain else PLAIN_COST]    # the way taken outside this trial
    if trial > TRIAL_MEASURED and usual and cost > TRIAL_ABORT * usual:
        conns[c, TRIAL] = 0                       # hopeless even unsettled (far apart): stop paying
        if conns[c, col] == 0:
            conns[c, col] = cost
    elif 0 < trial <= TRIAL_MEASURED:             # a trial's settled samples: their plain mean, afresh
        seen = TRIAL_MEASURED - trial             # (the last trial's figure may be another placement's)
        conns[c, col] = (seen * conns[c, col] + cost) // (seen + 1)
    elif trial == 0:                              # the usual way, every slice: a running average
        conns[c, col] = cost if conns[c, col] == 0 else (3 * conns[c, col] + cost) // 4
    if trial == 1 or (trial == 0 and conns[c, STREAM_COST] and conns[c, PLAIN_COST]):
        conns[c, PLAIN] = conns[c, PLAIN_COST] < PLAIN_FACTOR * conns[c, STREAM_COST]
    if trial != 0:
        return
    if conns[c, USUAL] < ctl[NSLOTS] + TRIAL_MEASURED:
        conns[c, USUAL] += 1                      # the usual way's figure is still settling
        return
    unmeasured = conns[c, STREAM_COST] == 0 or conns[c, PLAIN_COST] == 0
    if unmeasured or t0 - conns[c, TRIED] > _trial_wait(ctl[EXPLORE], conns[c, TRIALS], conns[c, PLAIN]):
        conns[c, TRIED] = t0                      # time (or first time) to try the other way
        conns[c, TRIAL] = ctl[NSLOTS] + TRIAL_MEASURED
        conns[c, TRIALS] += 1


def _trial_wait(explore, trials, plain):
    """Cycles between a send end's trials of the way it does not store (see _to_slot).

    Storing plainly, the end times its ordinary stores on every slice, so a move that makes them
    dear (the cores pulled apart) shows at once and switches it to streaming without a trial; the
    trials only refresh streaming's figure, and each doubles the wait, up to TRIAL_BACKOFF times.
    Streaming, ordinary stores' figure goes stale and only a trial finds that they won again:
    every EXPLORE_S, the first EARLY_TRIALS sooner, so a short job that started apart settles too.
    Measured with trials every EXPLORE_S while plain (2 ranks near, 500 calls, ordinary stores
    forced against auto): all_reduce 1 MiB 151 against 159-164 us out of place, 130 against
    137-139 in place: each trial streams a round of the slots, which the peer then reads from memory.
    """
    if plain:
        return explore << min(trials, TRIAL_BACKOFF)
    return explore >> max(0, EARLY_TRIALS - trials)


def _stream(dst, src):
    """dst (a slot, 64-byte aligned) = src with non-temporal stores: whole 8-byte words, then the
    last bytes of a 1- or 2-byte type plainly. (Not native_sync.stream_line: whole-line vector
    stores made slot copies slower, 2-rank near all_reduce 1-16 MiB 1.2-1.5x, docs/06.)"""
    nbytes = dst.size * dst.itemsize
    d, s, words = dst.ctypes.data, src.ctypes.data, nbytes // 8
    for i in range(words):
        native_sync.store_stream(d + 8 * i, native_sync.load_word(s + 8 * i))
    for i in range(words * 8 // dst.itemsize, dst.size):   # the last bytes of a 1- or 2-byte type
        dst[i] = src[i]


numba_carray = native_reduce = native_avg = None
_helpers_made = False
_kernels: dict = {}   # storage dtype -> the loop compiled for it (kernel)
_lock = threading.Lock()


def slot_stores(world_size: int) -> int:
    """RINGCOMM_SLOT_STORES: "auto" (each send end measures both ways and takes the cheaper, see
    _to_slot), "stream" (non-temporal stores) or "plain" (ordinary stores). Unset: auto, but
    plain where this host's ranks outnumber the usable cores. Stacked ranks preempt each other
    mid-copy, so a copy's time says more about the scheduler than about the stores. On the AMD
    VM these pages began on, 4 ranks on 2 cores, neither way won consistently (5 alternating runs)
    and streaming stayed; on an Intel Xeon VM ordinary stores won clearly (4 ranks, 30-40-call rows,
    alternating runs, ordinary against streamed: all_reduce 256 KiB 173-201 us against 282-595,
    1 MiB 538-696 against 900-1126, 4 MiB 1790-1841 against 2660-2785, 16 MiB 8184-8482 against
    12000-12656; reduce_scatter 16 MiB 3921 against 5629; broadcast 64 KiB 28.5 against 40.0), and
    auto lay between (all_reduce 4 MiB 2129-2179): the slot a stacked peer reads next is still in
    the cache its core shares, where a streamed one went to memory."""
    raw = os.environ.get("RINGCOMM_SLOT_STORES", "").strip().lower()
    if not raw:
        return STORES_PLAIN if oversubscribed(world_size) else STORES_AUTO
    if raw not in STORE_MODES:
        raise ValueError(f"RINGCOMM_SLOT_STORES={raw!r}: use auto, stream or plain (unset: auto, or "
                         f"plain with more ranks than cores)")
    return STORE_MODES[raw]


def kernel(dtype=None):
    """The compiled loop for ``dtype`` (a numba dispatcher), cached on disk.

    One dispatcher per storage type (see kernels/native.py: both 16-bit floats are uint16), each
    a copy of _run named after its type, so each has its own cache files: processes that start
    on a cold cache can compile different element types at the same time (one dispatcher for
    all types shares one cache index, which two writers would corrupt). Made under a lock:
    communicators may be created in several threads. Without a dtype it only makes the
    intrinsics and the jitted helpers (tests call those directly)."""
    global _helpers_made, numba_carray, native_reduce, native_avg
    import numba
    with _lock:
        if not _helpers_made:
            native_sync.intrinsics()
            numba_carray = numba.carray
            native_reduce, native_avg = native_kernels.compiled()
            jit = numba.njit(error_model="numpy")  # LLVM inlines these small helpers into the loop
            g = globals()
            for name in ("_wait_above", "_slot", "_stop", "_copy", "_stream", "_trial_wait", "_to_slot", "_move",
                         "_yield_until", "_wait", "_wake_sleepers"):
                g[name] = jit(g[name])
            _helpers_made = True
        if dtype is None:
            return None
        kind = native_kernels.storage(dtype)
        k = _kernels.get(kind)
        if k is None:
            name = f"_run_{kind.name}"
            loop = types.FunctionType(_run.__code__, globals(), name)
            loop.__qualname__ = name                   # numba names the cache files after it
            _drop_stale_cache(name)
            k = _kernels[kind] = numba.njit(nogil=True, cache=True, error_model="numpy",
                                            boundscheck=False)(loop)
    return k


def _drop_stale_cache(name: str) -> None:
    """numba's disk cache is keyed on this file alone, but the compiled loop also holds code from
    kernels/native.py, kernels/host.py and native_sync.py, transport/shm.py's word offsets and
    transport/futex.py's numbers: after an edit there, drop it."""
    import pathlib

    native_sync.drop_stale_cache(__file__, name, [pathlib.Path(native_kernels.__file__),
                                                  pathlib.Path(native_kernels.host.__file__),
                                                  pathlib.Path(shm.__file__), pathlib.Path(futex.__file__)])


class NativePlan:
    """A slice plan as the compiled loop reads it, beside the reference plan's entries (for
    waits and messages: step, peer, slice number) and the send links still to settle."""

    __slots__ = ("table", "entries", "maxsrc", "unsettled", "ctls")

    def __init__(self, table, entries, maxsrc, unsettled):
        self.table, self.entries, self.maxsrc, self.unsettled = table, entries, maxsrc, unsettled
        # (dtype, op) -> (the control block, the loop's entry, kind16), or None: a dtype this engine leaves alone
        self.ctls: dict = {}


class Lane:
    """The shortest way into the loop, for a call repeated on the same arrays (known_calls.py).

    A known call's checks, algorithm, schedule and plan are settled; what is left of the way in
    (the executor's plan look-up, run()'s control block look-up and preparations) is found once
    and held here. comm._run_known hands the call to run() as to an engine: the loop, and where it
    stops at a wait, go_on (the same waits, the same errors); where run()'s preparations are due
    (the reference engine held the counters, a send link has not settled its stores), the
    executor's whole way."""

    __slots__ = ("engine", "plan", "table", "ctl", "loop", "nsteps")

    def __init__(self, engine: NativeEngine, plan: NativePlan, ctl, loop, nsteps: int):
        self.engine, self.plan, self.table, self.ctl, self.loop = engine, plan, plan.table, ctl, loop
        self.nsteps = nsteps

    def run(self, sched, call) -> None:
        e = self.engine
        if not e.owned or self.plan.unsettled:
            e.x.run(sched, call)
            return
        spin = e.short if e.stacked else e.first
        if self.loop(self.table, e.conns, self.ctl, call.inp, call.out, 0, spin) != DONE:
            e.go_on(self.plan, self.ctl, self.loop, call, call.inp, call.out)


class NativeEngine:
    """Runs an executor's plans through the compiled loop when every link of the plan is shm.

    The connection table's COUNT column is the truth about the FIFO counters while this engine
    runs calls; the connections' own attributes (ShmSend.posted, ShmRecv.released) are brought
    up to date before Python waits on a connection and before the reference engine runs.
    """

    def __init__(self, executor, spin_s: float, budget_s: float):
        self.x = executor
        self.conns = np.zeros((8, CONN_COLUMNS), np.int64)
        self.objs: list = []          # row -> connection
        self.rows: dict = {}          # id(connection) -> row
        self.owned = False            # COUNT is ahead of the connections' attributes
        self.ctl = np.zeros(CTL_SIZE, np.int64)
        self.spin_s, self.budget_s = spin_s, budget_s
        self.stacked = False  # the last look found the peer waiting for this CPU: start short
        self.started = False  # numba and the intrinsics load at the first plan over shm links (_start)

    def _start(self) -> None:
        """Load the compiled loop and turn the polling times into cycle-counter ticks. Not in
        __init__: a communicator whose links are all tcp or ibverbs never runs the loop, and need
        not pay numba's start-up (~0.5 s; minutes under the Soft-RoCE guest's emulated CPU)."""
        hz, spin_s = native_sync.cycles_per_second(), self.spin_s
        self.budget = int(self.budget_s * hz)
        # A blocked wait polls in rounds of SPIN_ROUND_S, os.sched_yield() between rounds, for
        # spin_s in all; then it is the transport's wait (deadline, abort, liveness, back-off).
        self.spin = int(min(spin_s, SPIN_ROUND_S) * hz)
        self.rounds = int(spin_s / SPIN_ROUND_S)
        self.first, self.short = int(min(spin_s, FIRST_ROUND_S) * hz), int(min(spin_s, STACKED_ROUND_S) * hz)
        self.stores, self.explore = slot_stores(self.x.world_size), int(EXPLORE_S * hz)
        kernel()
        self.started = True

    def plan(self, entries) -> NativePlan | None:
        """The table for a reference plan's entries; None if a link is not shm."""
        conns = {c for e in entries for _, c in e[6] + e[7]}
        if not all(isinstance(c, (shm.ShmSend, shm.ShmRecv)) for c in conns):
            return None
        if not self.started:
            self._start()
        maxsrc = max((len(e[6]) for e in entries), default=0)
        maxdst = max((len(e[7]) for e in entries), default=0)
        table = np.zeros((len(entries), PEERS + maxsrc + maxdst), np.int64)
        for n, (_, step, io, oo, k, nbytes, recvs, sends, _) in enumerate(entries):
            flags = (F_RECVS * step.recvs | F_REDUCES * step.reduces | F_COPIES * step.copies
                     | F_FINAL * step.final | F_BASE_OUT * (step.base == "out"))
            table[n, :PEERS] = flags, io, oo, k, nbytes, len(recvs), len(sends)
            for j, (_, c) in enumerate(recvs):
                table[n, PEERS + j] = self._row(c)
            for j, (_, c) in enumerate(sends):
                table[n, PEERS + maxsrc + j] = self._row(c)
        unsettled = [c for c in conns if isinstance(c, shm.ShmSend)]
        return NativePlan(table, entries, maxsrc, unsettled)

    def _row(self, conn) -> int:
        row = self.rows.get(id(conn))
        if row is None:
            row = self.rows[id(conn)] = len(self.objs)
            self.objs.append(conn)
            if row == len(self.conns):
                self.conns = np.concatenate([self.conns, np.zeros_like(self.conns)])
            self.conns[row, WORDS], self.conns[row, SLOTS] = conn.addresses()
            self.conns[row, COUNT] = conn.count
            self.conns[row, PLAIN] = 1   # auto stores start plainly (see _to_slot)
        return row

    def release(self) -> None:
        """Hand the counters back to the connections (the reference engine is about to run)."""
        if self.owned:
            for conn, count in zip(self.objs, self.conns[:len(self.objs), COUNT].tolist()):
                conn.count = count
            self.owned = False

    def _control(self, plan: NativePlan, dtype, op):
        """(the call's control block, the loop to call, whether it moves 16-bit floats as uint16),
        made once per (plan, dtype, op) and reused as it is: where a call starts and how long it
        polls are the loop's arguments. None where the native arithmetic would not give host.py's
        bits (float16 without F16C)."""
        if not native_kernels.supported(dtype):
            entry = None
        else:
            x, kind16 = self.x, native_kernels.kind16(dtype)
            ctl = np.array((0, 0, -1, x.nslots, x.slot_bytes, native_kernels.OPCODES[op],
                            kind16, x.world_size, op == "avg", self.budget,
                            plan.maxsrc, self.stores, self.explore, *_yields_and_wakes(self.spin_s)), np.int64)
            entry = ctl, compiled_entry(warm_once(dtype)), bool(kind16)
        plan.ctls[(dtype, op)] = entry
        return entry

    def run(self, plan: NativePlan, call) -> bool:
        """Run one call; False (nothing done) if its dtype is not for this engine."""
        inp, out = call.inp, call.out
        entry = plan.ctls.get((inp.dtype, call.op), False)
        if entry is False:
            entry = self._control(plan, inp.dtype, call.op)
        if entry is None:
            return False
        ctl, loop, kind16 = entry
        if not self.owned:
            for row, conn in enumerate(self.objs):
                self.conns[row, COUNT] = conn.count
            self.owned = True
        if plan.unsettled:
            plan.unsettled = [c for c in plan.unsettled if not c.settle()]
        if kind16:
            inp, out = inp.view(np.uint16), out.view(np.uint16)
        if loop(plan.table, self.conns, ctl, inp, out, 0, self.short if self.stacked else self.first) != DONE:
            self.go_on(plan, ctl, loop, call, inp, out)
        return True

    def go_on(self, plan: NativePlan, ctl, loop, call, inp, out) -> None:
        """The rest of a call whose loop returned before its end (ctl says where and why): poll on
        in rounds while the peer may be about to move, then wait the reference engine's way."""
        spin = self.short if self.stacked else self.first
        rounds, where = 0, -1
        while True:
            status, i = ctl[STATUS], int(ctl[NEXT])
            if status == WAKE:
                self._wake(plan.table[ctl[CONN]], plan.maxsrc)
            elif status != YIELD and status != BAD_SIZE and rounds < self.rounds:
                if i != where:                  # progress since the last round: a new wait
                    rounds, where = 0, i
                long_round = spin == self.spin
                rounds += 1
                self.stacked = self.objs[ctl[CONN]].peer_waits_for_my_cpu()
                spin = self.short if self.stacked else self.spin
                if self.stacked or long_round:  # after a short first round, a free peer: poll on
                    os.sched_yield()
            elif status != YIELD:
                rounds = 0
                spin = self.short if self.stacked else self.first
                entry = plan.entries[i]
                x = self.x
                x._step = entry[0]
                conn = self.objs[ctl[CONN]]
                conn.count = int(self.conns[ctl[CONN], COUNT])
                if status == BLOCKED_SEND:
                    x._acquire(conn.peer, conn, call, entry[8])
                else:  # BLOCKED_RECV, or BAD_SIZE: _wait raises the reference engine's error for it
                    x._wait(conn.peer, conn, call, entry[5], entry[8])
            if loop(plan.table, self.conns, ctl, inp, out, i, spin) == DONE:
                return

    def lane(self, plan: NativePlan, dtype, op, nsteps: int) -> Lane | None:
        """A known call's lane into this plan's loop (see Lane), where it has one: its control block
        made by an earlier call, for a dtype the loop takes as it is (not a 16-bit float)."""
        entry = plan.ctls.get((dtype, op))
        if not entry or entry[2]:
            return None
        return Lane(self, plan, entry[0], entry[1], nsteps)

    def _wake(self, row, maxsrc) -> None:
        """Wake the peers of a finished row that sleep on the counters it moved."""
        for j in range(row[NSRC]):
            self.objs[row[PEERS + j]].wake_peer()
        for j in range(row[NDST]):
            self.objs[row[PEERS + maxsrc + j]].wake_peer()


def _yields_and_wakes(spin_s: float) -> tuple:
    """The control block's YIELDS, YIELD_FN, SYSCALL_FN, FUTEX_NR: where ranks outnumber cores
    (no spinning: spin_s == 0) a wait yields in the loop as Backoff would in Python; the loop
    wakes sleeping peers itself where futex is there (else FUTEX_NR < 0: Python does)."""
    return (Backoff.compiled_yields(spin_s > 0), native_sync.libc_address("sched_yield"),
            native_sync.libc_address("syscall"), -1 if futex.SYS_FUTEX is None else futex.SYS_FUTEX)


_warmed: dict = {}   # dtype -> its loop, compiled or loaded by this process (warm_once)
COMPILE_LOCK_WAIT_S = 300.0   # a cold compile takes ~4 s a dtype here; minutes under an emulated CPU


def warm_once(dtype):
    """The loop for ``dtype``, compiled (or loaded from numba's disk cache) once per process and
    by one process at a time per machine and element type: ranks that start together on a cold
    cache would otherwise each compile the same loop (2 ranks, 9 dtypes: 44 s cold, where the
    second process then loads in ~0.1 s). The lock is a file per element type beside numba's
    cache, held only while compiling, never during a collective; a holder that dies releases it.
    After COMPILE_LOCK_WAIT_S this process compiles without it."""
    dtype = np.dtype(dtype)
    loop = _warmed.get(dtype)
    if loop is not None:
        return loop
    import fcntl
    import tempfile
    kind = native_kernels.storage(dtype)
    loop = kernel(kind)
    where = getattr(getattr(loop, "_cache", None), "_cache_path", None) or tempfile.gettempdir()
    path = os.path.join(where, f"ringcomm-engine-compile-{os.getuid()}-{kind.name}.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = None   # a read-only cache directory: compile unlocked
    try:
        deadline = time.monotonic() + COMPILE_LOCK_WAIT_S
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        empty_plan, conns = np.zeros((0, PEERS), np.int64), np.zeros((1, CONN_COLUMNS), np.int64)
        a, out = np.zeros(1, kind), np.zeros(1, kind)
        a.flags.writeable = False
        loop(empty_plan, conns, np.zeros(CTL_SIZE, np.int64), a, out, 0, 0)   # compiles, or loads from disk
        # One version per type: its input is typed read-only, which a writable input converts to
        # at call time once no new version may be compiled. (Before, the first read-only input a
        # process met compiled a second copy of the loop, ~5 s.) Unaligned buffers convert too;
        # the API lets through only native-order 1-D contiguous arrays of the supported types.
        loop.disable_compile()
    finally:
        if fd is not None:
            os.close(fd)   # releases the lock
    _warmed[dtype] = loop
    return loop


def compiled_entry(loop):
    """The loop's one compiled version (warm_once), called without the dispatcher's look at the
    arguments' types (~0.1 us of an 8-byte all_reduce's ~3). Sound because a call passes nothing
    the dispatcher would route elsewhere: the dtype is the loop's by construction (ctls is keyed
    by it), and a read-only or unaligned input converts to this very version anyway. The
    dispatcher itself where numba does not expose the version."""
    try:
        (signature,) = loop.signatures
        return loop.overloads[signature].entry_point
    except (AttributeError, KeyError, ValueError):
        return loop


def warm(dtypes=None) -> None:
    """Compile (or load from numba's disk cache) the loop for these dtypes, in this order, default
    every one the engine takes: what a process pays before its first call on each dtype. Two
    processes that warm the same types in opposite orders compile them side by side (each type
    under its own lock, warm_once): the test suite's two workers do that on a fresh checkout."""
    from ringcomm.kernels import host
    for dt in host.SUPPORTED_DTYPES if dtypes is None else dtypes:
        if native_kernels.supported(dt):
            warm_once(dt)
