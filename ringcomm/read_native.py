"""The read engine's calls on plain buffers, compiled: one call into numba per collective (two or more
for a reduction).

A 2-rank broadcast of 256 KiB by CMA reads 128 KiB (its root writes the other half); the system
call takes ~5.5 us from compiled code, yet the whole call took ~18 us: the rest was Python, about
a microsecond for each descriptor store, address, wait check, Remote and ctypes call of
read_engine.py. MPICH reads by CMA too, from 64 KiB, and does the call in ~11 us. So for the
schedules that only copy (broadcast, all_gather: schedule/onecopy.py) this module runs the whole
call in one compiled function over a plan of rows, one per copy, read, write or sync:

    publish the descriptor and CALLS            (as ReadEngine.run, then wake sleeping peers)
    copy      out[oo:oo+k] = inp[io:io+k]       (memmove, streamed as stream_copy's; none in place)
    read      out[oo:oo+k] = peer's in/out      (process_vm_readv, once the peer has entered; a
                                                memmove from the peer's registered buffer mapped here)
    write     peer's out[oo:oo+k] = inp[io:io+k] (process_vm_writev; a memmove into a registered one)
    sync      arrive at each pair's count, then wait for the peers' (as ReadEngine._sync)

A reducing call (all_reduce, reduce_scatter) runs here too, up to its reducing step: its row
waits for the peers that step reads (and writes into: all_reduce's write_out_copy goes with it),
checks that their buffers are plain and of this call's sizes (or registered and mapped here), and
returns REDUCE; Python runs the step in fetch_reduce's compiled loop (ReadEngine._fetch_step:
~50 us less a call than Python's steps) and calls again from the step after it. A peer's
registered buffer is read or written through the table of the peers' allocations as this process
maps them (peer_maps.py): a memmove, or an operand reduced where it lies.

The protocol is read_engine.py's, word for word, so a compiled rank and a Python one (the
reference engine, RINGCOMM_ENGINE=python) work together. What the compiled function does not do
it hands back to Python at the step where it stands, and ReadEngine._steps goes on from there:
a wait that lasts longer than its spin budget (Python's waits yield, sleep on a futex, watch the
deadline, abort() and liveness), a failed system call (Python does the step again and explains
the error: a dead peer, a refused read), a peer whose buffer is of another size or does not fit
its allocation, or one this process has not mapped (Python's error names it), a plain buffer
where CMA is off.

libc's functions are called through their addresses (native_sync.call_c), passed in at run time,
so the compiled code is cached on disk like the native engine's.
"""
from __future__ import annotations

import threading

import numpy as np

from ringcomm.transport import futex
from ringcomm.transport.futex import FUTEX_WAKE, SYS_FUTEX

from . import ctl_layout, native_sync, peer_maps, stream_copy
from .ctl_layout import CALLS, DESC, PID, SYNC

# What the compiled call returns; res = (step, arrived) for the last three. REDUCE: it stands at
# a reducing step whose peers have all entered the call with plain buffers of this call's sizes;
# Python runs that step (read_engine.ReadEngine._fetch_step: fetch_reduce's compiled loop) and
# calls again from the step after it.
DONE, WAIT, HAND_BACK, REDUCE = 0, 1, 2, 3
# The compiled call's one argument, an int64 block (arguments(), _enter()): a numba entry point
# unboxes every argument it is given, and _run_call's fifteen (eight arrays) cost 0.54 us a call
# where one array costs 0.09 (Intel VM; docs/06 "The copy-only read calls, compiled"). The block
# names the call (its plan's rows and sync peers, where it starts, its buffers) and the engine's
# arrays by address; whoever fills it keeps those arrays alive.
# A call's part ends with its descriptor (A_KIN .. A_DOUT: DESC's first four words, the allocation
# index and offset of a registered buffer, or -1 and the address of a plain one).
A_ROWS, A_NROWS, A_SPEERS, A_NSPEERS, A_START, A_ARRIVED, A_CALLS, A_AIN, A_AOUT, A_NIN, A_NOUT, \
    A_KIN, A_DIN, A_KOUT, A_DOUT, A_WORDS, A_NWORDS, A_PEERS, A_SYNCS, A_CONSTS, A_IOV, A_MAPS, A_RES = range(23)
ARGS = 23
CALL_WORDS = slice(A_ROWS, A_DOUT + 1)   # what call_words() fills
COPY, READ, WRITE, SYNC_STEP, REDUCE_STEP = 0, 1, 2, 3, 4
# A plan row: the schedule's step index, the kind, the peer, which buffer of the peer (0 its
# input, 1 its output), the byte offset there (or in this rank's input for copy and write), the
# byte offset here (this rank's output; its input for a write), the bytes, and a sync or reducing
# step's peers as (start, count) in the plan's peer list, and the bytes a local copy's streaming is
# decided on (WHOLE: the whole block for a piece of one, as stream_copy.copy's ``whole``; else
# NBYTES). A reducing step's row (REDUCE_STEP) has WHICH 1 where the write_out_copy after it (of the
# same chunk) goes with it: it has no row.
STEP, KIND, PEER, WHICH, THERE, HERE, NBYTES, SPEERS, NSPEERS, WHOLE = range(10)
ROW = 10
READV, WRITEV, SYSCALL, MEMMOVE, YIELD_FN, FUTEX, NRANKS, ME, BUDGET, YIELDS, YIELD_BUDGET, STREAM_MIN, \
    CMA = range(13)  # constants()
NCONSTS = 13
# all_gather writes its block to each peer and copies it here a piece at a time (write_then_copy): the
# copy reads the piece from cache. Two processes each moving their half of an all_gather's output,
# numpy and CMA only: 16 MiB 1243 us reading the peer's block by CMA, then copying its own;
# writing its own by CMA and copying it in 1 MiB pieces 1111, in 256 KiB pieces 1162 (a system
# call per piece); 64 MiB 6654 against 6050 and 6541 (docs/06, "The ceiling").
# In the engine, pieces written by process_vm_writev do best at 512 KiB: the kernel's copy brings
# the piece and the peer's lines into L2 too, and 1 MiB of each with the local copy's output no
# longer fits in 2 MiB (Intel VM, ringcomm-bench all_gather out of place, 30-call rows
# alternating with MPICH, three runs each, 512 KiB against 1 MiB pieces: 2 ranks 4 MiB 248-267
# against 282-305 us, 8 MiB 581-620 against 649-652; 4 ranks on 2 cores 4 MiB 593-610 against
# 710-780, 16 MiB 2404-2460 against 2776-2918; 256 KiB was level with 512 KiB at 4 MiB and slower
# at 8). Into a peer's registered buffer a piece is a memcpy, and 1 MiB stays a little ahead (2
# ranks, 16 MiB 1083-1091 against 1102-1109 us, 64 MiB 4310-4334 against 4396-4401).
CMA_PIECE_BYTES = 512 << 10
WRITE_PIECE_BYTES = 1 << 20
# Where a block's CMA writes move this much in all (the block times its peers), they go whole,
# one process_vm_writev per peer, then the copy: there the pieces measured slower, by more than
# the copy gains from finding each piece in L2 (not traced; the kernel's work per call, finding
# and pinning the peer's pages, is the likely cost). Intel VM, 2026-12-03, ringcomm-bench
# all_gather out of place, 30-call rows alternating with MPICH, two rounds each way (us, 512 KiB
# pieces against this rule): 2 ranks 16 MiB 1735, 1634 against 1419, 1489; 32 MiB 3697, 3695
# against 2826, 3420; 64 MiB 9739, 9470 against 7625, 7893 (MPICH 9619-10789); 3 ranks 12 MiB
# 3232, 3245 against 2877, 2758; 4 ranks on 2 cores 16 MiB 5653, 6036 against 4513, 4578 (MPICH
# 3811-4624). Below it the pieces won or tied: 2 ranks 8 MiB (4 MiB blocks) 618-842 us in pieces
# against 785-793 whole; 4 ranks 8 MiB (2 MiB blocks) level.
CMA_WHOLE_BYTES = 8 << 20
# A block this big goes whole too, however few its peers: the 2-rank 8 MiB row (4 MiB blocks,
# one write) measured mixed above, then in five alternating rounds of the next session whole
# blocks won every one: 787-832 us against 805-1013 in 512 KiB pieces (MPICH 667-763); 1 and
# 2 MiB pieces lost too (822-949). Smaller blocks keep the pieces: 2 ranks 4 MiB (2 MiB blocks)
# 315-334 against 403-406 whole, 3 ranks 6 MiB (2 MiB blocks, two writes) 1020-1183 against
# 1307-1465; 4 ranks 8 MiB (2 MiB blocks, three writes) level (2226-2348 against 2187-2352).
CMA_WHOLE_BLOCK_BYTES = 4 << 20
YIELD_S = 1e-3    # where ranks outnumber cores, a wait yields (YIELDS times) for at most this long in compiled code
SPIN_S = 200e-6   # a wait polls this long in compiled code before Python's waits take it over

_sleep_flag = ctl_layout.sleep_flag   # compiled with the call (kernel())
_lock = threading.Lock()
_kernel = None


def plan(sched, spans, size: int, me: int, pieces: bool = True, by_cma: bool = True):
    """The rows of a read schedule, from its steps' element spans (read_engine.step_spans: input
    offset, length, output offset) and the element size. A reducing step is a REDUCE_STEP row that
    waits for its peers and hands the step to Python (with the write_out_copy of its chunk that
    follows it, where one does); None where a step reduces what it reads from outputs, or writes
    this rank's output chunk elsewhere (those stay in read_engine.py). ``pieces``: take a block's
    writes and its copy a piece at a time (write_then_copy); not for a call in place, whose copy is
    none. ``by_cma``: the pieces' sizes for writes by process_vm_writev (plain buffers), else for
    memmoves into registered ones (piece_bytes)."""
    rows, peers, steps, i = [], [], sched.steps, 0
    while i < len(steps):
        j = write_then_copy(steps, spans, i) if pieces else 0
        if j:
            rows.extend(_pieces(steps, spans, i, j, size, by_cma))
            i = j + 1
            continue
        if steps[i].reduces and steps[i].reads != "out":
            pushed = pushes(steps, spans, i)
            both = set(steps[i].remote) | (set(steps[i + 1].remote) if pushed else set())
            others = sorted(both - {me})
            peers.extend(others)
            rows.append((i, REDUCE_STEP, -1, int(pushed), 0, 0, 0, len(peers) - len(others), len(others), 0))
            i += 2 if pushed else 1
            continue
        if steps[i].reduces or steps[i].kind == "write_out_copy":   # (a row's HERE is its input, for a write)
            return None
        rows.extend(_step_rows(steps[i], i, spans[i], size, me, peers))
        i += 1
    return np.array(rows, np.int64).reshape(-1, ROW), np.array(peers or [0], np.int64)


def pushes(steps, spans, i: int) -> bool:
    """Whether reducing step i is followed by a write_out_copy of its chunk (all_reduce's read
    schedule): the two go together, each piece sent to the peers as it is built
    (read_engine.ReadEngine._push)."""
    return (i + 1 < len(steps) and steps[i + 1].kind == "write_out_copy"
            and tuple(spans[i + 1][1:]) == tuple(spans[i][1:]))


def _step_rows(step, i: int, span, size: int, me: int, peers: list) -> list:
    """Step i's rows (a sync's peers go on ``peers``)."""
    if step.kind == "sync":
        peers.extend(step.remote)
        return [(i, SYNC_STEP, -1, 0, 0, 0, 0, len(peers) - len(step.remote), len(step.remote), 0)]
    io, nbytes, oo = (v * size for v in span)   # in bytes
    if step.kind == "copy" or (not step.writes and step.reads != "out" and step.remote[0] == me):
        return [(i, COPY, -1, 0, io, oo, nbytes, 0, 0, nbytes)]   # (a "read" of this rank's own input: a copy)
    if step.writes:
        return [(i, WRITE, q, 1, oo, io, nbytes, 0, 0, nbytes) for q in step.remote]
    if step.reads == "out":
        return [(i, READ, step.remote[0], 1, oo, oo, nbytes, 0, 0, nbytes)]
    return [(i, READ, step.remote[0], 0, io, oo, nbytes, 0, 0, nbytes)]


def _pieces(steps, spans, i: int, j: int, size: int, by_cma: bool) -> list:
    """The rows of a write_then_copy run (steps i .. j - 1 write the block, step j copies it),
    piece by piece, all numbered step i."""
    io, nbytes, oo = (v * size for v in spans[j])
    rows = []
    writes = sum(len(steps[w].remote) for w in range(i, j))
    piece = piece_bytes(by_cma, nbytes, writes)
    for a in range(0, nbytes, piece):
        k = min(piece, nbytes - a)
        rows.extend((i, WRITE, q, 1, spans[w][2] * size + a, io + a, k, 0, 0, nbytes)
                    for w in range(i, j) for q in steps[w].remote)
        rows.append((i, COPY, -1, 0, io + a, oo + a, k, 0, 0, nbytes))
    return rows


def piece_bytes(by_cma: bool, block: int, writes: int) -> int:
    """How much of a write_then_copy run (a ``block``-byte block written to ``writes`` peers, then
    copied here) either engine takes at a time: where the writes are process_vm_writev
    (``by_cma``), CMA_PIECE_BYTES, or the whole block once it holds CMA_WHOLE_BLOCK_BYTES or its
    writes move CMA_WHOLE_BYTES in all; else WRITE_PIECE_BYTES (memcpys into registered buffers)."""
    if by_cma:
        whole = block >= CMA_WHOLE_BLOCK_BYTES or block * writes >= CMA_WHOLE_BYTES
        return block if whole else CMA_PIECE_BYTES
    return WRITE_PIECE_BYTES


class Prepared:
    """A plan's rows and sync peers (plan()), with the addresses the argument block names them by."""

    __slots__ = ("rows", "speers", "head")

    def __init__(self, rows: np.ndarray, speers: np.ndarray):
        self.rows, self.speers = rows, speers
        self.head = (rows.ctypes.data, rows.shape[0], speers.ctypes.data, speers.size)   # A_ROWS .. A_NSPEERS


def arguments(words: np.ndarray, peers: np.ndarray, syncs: np.ndarray, consts: np.ndarray, iov: np.ndarray,
              maps: np.ndarray, res: np.ndarray) -> np.ndarray:
    """An argument block with the engine's part filled in (A_WORDS ...): this rank's control words,
    the peers' words' addresses, the sync counts, constants(), the system call's scratch, the
    peers' mapped allocations (peer_maps) and the result's scratch. A call fills CALL_WORDS."""
    a = np.zeros(ARGS, np.int64)
    a[A_WORDS:] = (words.ctypes.data, words.size, peers.ctypes.data, syncs.ctypes.data, consts.ctypes.data,
                   iov.ctypes.data, maps.ctypes.data, res.ctypes.data)
    return a


def call_words(prepared: Prepared, calls: int, ain: int, aout: int, nin: int, nout: int,
               desc: tuple | None = None) -> tuple:
    """A call's part of the argument block, CALL_WORDS, for a call from its start: its plan, its
    number (CALLS), its buffers' addresses and byte counts, and its descriptor (DESC's first four
    words: (allocation, offset) of each registered buffer; by default, both plain)."""
    return (*prepared.head, -1, 0, calls, ain, aout, nin, nout, *(desc or (-1, ain, -1, aout)))


def write_then_copy(steps, spans, i: int) -> int:
    """Where steps i, i+1, ... write one input block to a peer each and the next step copies that
    block here (all_gather's read schedule), that copy step's index; else 0. Both engines take
    such a run a piece at a time (piece_bytes()): write the piece to each peer, then copy it
    here while it is in cache (here, and read_engine.ReadEngine._write_then_copy). Every piece
    is numbered the run's first step, so a call handed back to Python mid-run goes on from there
    (the run's writes and copy again: the same bytes to the same places)."""
    j = i
    while j < len(steps) and steps[j].kind == "write_copy" and spans[j][:2] == spans[i][:2]:
        j += 1
    if i < j < len(steps) and steps[j].kind == "copy" and spans[j][:2] == spans[i][:2]:
        return j
    return 0


def constants(n: int, me: int, budget: int, yields: int = 0) -> np.ndarray:
    """What the compiled call needs to know besides the call (indexed by READV ... CMA):
    the addresses of process_vm_readv, process_vm_writev, syscall, memmove and sched_yield,
    futex's system call number, then the ranks, this rank, the spin budget (cycles), how many
    sched_yield()s a wait makes after it (ranks outnumbering cores: 0 spin, some yields) within
    YIELD_S, the local copies it streams past the caches (from stream_copy.STREAM_MIN_BYTES, as
    Python's path does; 0: none, where streaming is off), and whether plain buffers go by CMA (0
    here: the engine sets it once the probe has said yes, plain_read.setup)."""
    fns = [native_sync.libc_address(f) for f in ("process_vm_readv", "process_vm_writev", "syscall", "memmove",
                                                  "sched_yield")]
    yield_budget = int(YIELD_S * native_sync.cycles_per_second()) if yields else 0
    stream_min = stream_copy.STREAM_MIN_BYTES if stream_copy.enabled() else 0
    return np.array(fns + [-1 if SYS_FUTEX is None else SYS_FUTEX, n, me, budget, yields, yield_budget, stream_min,
                           0], np.int64)


def kernel():
    """The compiled call (numba, cached on disk): ``kernel()(block)`` runs _run_call over the
    argument block (arguments()), through its one version's entry point: no dispatcher, and one
    argument to unbox."""
    global _kernel
    if _kernel is None:
        with _lock:
            if _kernel is None:
                import numba
                from numba import types
                native_sync.intrinsics()
                # the control words' layout and futex's numbers are compiled in: an edit there is one here
                native_sync.drop_stale_cache(__file__, "_enter", deps=(ctl_layout.__file__, futex.__file__,
                                                                       peer_maps.__file__))
                jit = numba.njit(nogil=True)
                g = globals()
                g["_carray"] = numba.carray
                for name in ("_yield_until", "_wait_at_least", "_transfer", "_stream_bytes", "_copy", "_wake",
                             "_sleep_flag", "_mapped", "_reach", "_run_call"):
                    g[name] = jit(g[name])
                compiled = numba.njit(types.int64(types.int64[::1]), nogil=True, cache=True)(_enter)
                compiled.disable_compile()
                from .engine_native import compiled_entry
                _kernel = compiled_entry(compiled)
    return _kernel


def _wait_at_least(addr, want, consts):
    """Poll the int64 at ``addr`` until it reaches ``want``: True, or False after the spin budget
    and then up to consts[YIELDS] sched_yield()s (within YIELD_BUDGET cycles)."""
    t0 = native_sync.cycles()
    while native_sync.load_acquire(addr) < want:
        if native_sync.cycles() - t0 > consts[BUDGET]:
            return _yield_until(addr, want, consts[YIELD_FN], consts[YIELDS], native_sync.cycles(),
                                consts[YIELD_BUDGET])
        native_sync.cpu_pause()
    return True


_yield_until = native_sync.yield_until   # compiled with the other helpers (kernel())


_transfer = native_sync.transfer           # compiled with the other helpers (kernel())
_stream_bytes = native_sync.stream_bytes   # likewise


def _copy(dst, src, nbytes, whole, consts):
    """A local copy of ``nbytes``: memmove, or where ``whole`` (the copy's, or the whole block's of
    which it is a piece) holds STREAM_MIN bytes and they do not overlap, streamed past the caches
    (native_sync.stream_bytes), then a fence."""
    if whole < consts[STREAM_MIN] or consts[STREAM_MIN] == 0 or (dst < src + nbytes and src < dst + nbytes):
        native_sync.call_c(consts[MEMMOVE], dst, src, nbytes, 0, 0, 0)
        return
    _stream_bytes(dst, src, nbytes, consts[MEMMOVE])
    native_sync.stream_fence()


def _wake(base, word, peers, n, me, consts):
    """Wake the peers asleep on this rank's words (their flag for this rank is set), as
    Registry.publish; the fence keeps the flag's load after the store that announced the word."""
    native_sync.fence()
    flag = _sleep_flag(n, me)
    for p in range(n):
        if p != me and native_sync.load_acquire(peers[p] + 8 * flag) != 0:
            native_sync.call_c(consts[SYSCALL], consts[FUTEX], base + 8 * word, FUTEX_WAKE, 0x7FFFFFFF, 0, 0)
            return


_mapped = peer_maps.mapped   # compiled with the other helpers (kernel())


BY_CMA = -1   # _reach: a plain buffer of the peer's, reached by CMA


def _reach(there, q, which, nbytes, table, consts):
    """How compiled code reaches peer q's input (``which`` 0) or output (1), of this call's
    ``nbytes`` here: its address as mapped here where it is registered and mapped whole, BY_CMA
    where it is plain and CMA is on, 0 where compiled code cannot (another size, not mapped here,
    no CMA: Python's path says why)."""
    if native_sync.load_acquire(there + 8 * (DESC + 4 + which)) != nbytes:
        return 0
    k = native_sync.load_acquire(there + 8 * (DESC + 2 * which))
    if k != -1:
        return _mapped(table, q, k, native_sync.load_acquire(there + 8 * (DESC + 2 * which + 1)), nbytes)
    return BY_CMA if consts[CMA] != 0 else 0


_carray = None   # numba.carray, set by kernel()


def _enter(a):
    """_run_call over the arrays and values that argument block ``a`` names (arguments())."""
    consts = _carray(native_sync.typed_ptr(a[A_CONSTS], a), NCONSTS)
    n = consts[NRANKS]
    rows = _carray(native_sync.typed_ptr(a[A_ROWS], a), (a[A_NROWS], ROW))
    speers = _carray(native_sync.typed_ptr(a[A_SPEERS], a), a[A_NSPEERS])
    words = _carray(native_sync.typed_ptr(a[A_WORDS], a), a[A_NWORDS])
    peers = _carray(native_sync.typed_ptr(a[A_PEERS], a), n)
    syncs = _carray(native_sync.typed_ptr(a[A_SYNCS], a), n)
    iov = _carray(native_sync.typed_ptr(a[A_IOV], a), 4)
    res = _carray(native_sync.typed_ptr(a[A_RES], a), 2)
    table = _carray(native_sync.typed_ptr(a[A_MAPS], a), 1 + 2 * n * peer_maps.MAP_CAP)
    return _run_call(rows, speers, a[A_START], a[A_ARRIVED] != 0, words, peers, a[A_CALLS], syncs, a[A_AIN],
                     a[A_AOUT], a[A_NIN], a[A_NOUT], a[A_KIN:A_DOUT + 1], consts, iov, table, res)


def _run_call(rows, speers, start, arrived, words, peers, calls, syncs, ain, aout, nin, nout, desc, consts, iov,
              table, res):
    """One call from step ``start`` (-1: publish the descriptor ``desc`` first); DONE, or WAIT /
    HAND_BACK / REDUCE with res = (the step to go on from, whether its sync arrivals are
    published). ``consts``: constants(); ``table``: peer_maps.table()."""
    base = words.ctypes.data
    n, me = consts[NRANKS], consts[ME]
    if start < 0:
        words[DESC], words[DESC + 1], words[DESC + 2], words[DESC + 3] = desc[0], desc[1], desc[2], desc[3]
        words[DESC + 4], words[DESC + 5] = nin, nout
        native_sync.store_release(base + 8 * CALLS, calls)   # after the descriptor: peers may read it
        _wake(base, CALLS, peers, n, me, consts)
        start = 0
    mine = (nin, nout)
    for r in range(rows.shape[0]):
        step, kind = rows[r, STEP], rows[r, KIND]
        if step < start:
            continue
        res[0], res[1] = step, 0
        nbytes = rows[r, NBYTES]
        if kind == COPY:
            src, dst = ain + rows[r, THERE], aout + rows[r, HERE]
            if nbytes > 0 and src != dst:
                _copy(dst, src, nbytes, rows[r, WHOLE], consts)
        elif kind == SYNC_STEP:
            first, count = rows[r, SPEERS], rows[r, NSPEERS]
            if not (arrived and step == start):
                for j in range(first, first + count):
                    p = speers[j]
                    syncs[p] += 1
                    native_sync.store_release(base + 8 * (SYNC + p), syncs[p])
                    _wake(base, SYNC + p, peers, n, me, consts)
            res[1] = 1
            for j in range(first, first + count):
                p = speers[j]
                if not _wait_at_least(peers[p] + 8 * (SYNC + me), syncs[p], consts):
                    return WAIT
        elif kind == REDUCE_STEP:   # every peer in, with buffers fetch_reduce can take (_reach)
            for j in range(rows[r, SPEERS], rows[r, SPEERS] + rows[r, NSPEERS]):
                q = speers[j]
                there = peers[q]
                if not _wait_at_least(there + 8 * CALLS, calls, consts):
                    return WAIT
                for which in range(2):
                    if _reach(there, q, which, mine[which], table, consts) == 0:
                        return HAND_BACK
            return REDUCE
        else:
            q, which = rows[r, PEER], rows[r, WHICH]
            there = peers[q]
            if not _wait_at_least(there + 8 * CALLS, calls, consts):
                return WAIT
            mapped = _reach(there, q, which, mine[which], table, consts)
            if mapped == 0:
                return HAND_BACK          # Python's path says why
            if mapped != BY_CMA:          # registered: a memmove through this process's mapping of it
                if kind == READ:
                    _copy(aout + rows[r, HERE], mapped + rows[r, THERE], nbytes, rows[r, WHOLE], consts)
                else:
                    _copy(mapped + rows[r, THERE], ain + rows[r, HERE], nbytes, rows[r, WHOLE], consts)
                continue
            pid = native_sync.load_acquire(there + 8 * PID)
            remote = native_sync.load_acquire(there + 8 * (DESC + 2 * which + 1)) + rows[r, THERE]
            if kind == READ:
                ok = _transfer(consts[READV], pid, aout + rows[r, HERE], remote, nbytes, iov)
            else:
                ok = _transfer(consts[WRITEV], pid, ain + rows[r, HERE], remote, nbytes, iov)
            if not ok:
                return HAND_BACK
    return DONE
