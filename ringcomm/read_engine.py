"""The one-copy engine: runs the read steps of schedule/onecopy.py on registered buffers (comm.alloc).

ringcomm/registered.py maps the segments; this module is the protocol over them, over the
words of each rank's control segment (ctl_layout.py).

A read of peer q's buffer waits until q's CALLS reaches this call (q has entered it and its
descriptor is valid). A sync with p first counts this rank's arrival, then waits until p's count
for this rank catches up. Every schedule ends with a sync with each peer it read (the simulator
checks it), so no rank returns, and lets its caller overwrite the buffer, while a peer still
reads it. All ranks make the same registered calls in the same order, so call numbers agree.

One call is one round over the whole buffer (no slicing: nothing is staged). Reductions run in
cache-sized pieces, so the n - 1 passes over an output piece stay in L2. numpy, whichever engine
the communicator runs: the executor sends read schedules here before the native engine sees them;
on the native engine, calls on plain buffers by CMA run compiled (read_native.py), a reducing
step's fetches and folds in fetch_reduce.py's loop (_fetch_step).
"""
from __future__ import annotations

import errno
import time

import numpy as np

from ringcomm.kernels import host as kernels

from ringcomm.transport.base import Backoff, PeerGone, PeerTimeout
from ringcomm.transport.cma import CmaError

from . import fetch_reduce, native_sync, peer_maps, read_native, stream_copy
from .buffers import address
from .ctl_layout import CALLS, DESC, PID, SYNC
from .errors import RingcommError
from .plain_read import Remote
from .schedule.step import WRITES, chunk_span

PIECE_BYTES = 256 * 1024  # a reduction works on pieces this big, so repeated passes stay in L2
# ...but one pass (two operands, straight into the output) reuses nothing: bigger pieces, fewer
# numpy calls. 2-rank registered reduce_scatter, alternating in one run: 4 MiB 164-170 us with
# 256 KiB pieces, 146-147 with 1 MiB; 16 MiB 1469-1585 against 1320-1423; 64 MiB the same.
ONE_PASS_PIECE_BYTES = 1024 * 1024
# A peer's plain buffer is reduced from a copy fetched by CMA, a piece at a time (_reduce).
# 2-rank reduce_scatter and all_reduce, 1-64 MiB, alternating with MPICH: 256 KiB pieces were the
# best or within noise of it; 64 KiB ones 1.2-1.4x slower (a system call and its pinning per
# piece), 1 MiB ones no faster.
FETCH_PIECE_BYTES = 256 * 1024
# From this much output, a reducing step out of place on the native engine builds each piece in L2
# and streams it out (fetch_reduce.STREAM): the output's lines are written without being read
# first. Intel VM, 2 ranks, 30-call rows alternating with MPICH, three runs, two rounds each way,
# streamed against fetched into the output and reduced there (us; the step's output is half the
# reduce_scatter's input and all_reduce's chunk): reduce_scatter 4 MiB 512, 492 against 559, 567,
# 16 MiB 1558, 1465 against 1655, 1721, 64 MiB 9159, 8657 against 13110, 12909; all_reduce 4 MiB
# 897, 906 against 812, 874 (its second phase read the chunk back from memory then: slower), 16 MiB
# 2730, 2718 against 2723, 2882, 64 MiB 15258, 15331 against 18076, 18935. So from
# stream_copy's threshold, where both gain or tie, for a step whose output a later step reads.
STREAM_OUT_MIN_BYTES = stream_copy.STREAM_MIN_BYTES
# ...and from this much where no step of the schedule reads an output back (reduce_scatter, reduce:
# the call's last touch of it is this write; all_reduce, whose write_out_copy goes with the pieces:
# _push). Same VM, rows as above, streamed from here against from 8 MiB, reduce_scatter 2 ranks
# (the step's output is half the row): 2 MiB 233, 251 against 256, 261 us; 4 MiB 413, 423 against
# 449, 468; 8 MiB 751, 764 against 797, 807; 1 MiB and 512 KiB level. Alone in one process
# (docs/06 "Reductions from fetched pieces"), streaming beats fetching into the output from 1 MiB
# (169 against 180 us) and ties at 512 KiB.
STREAM_FINAL_OUT_MIN_BYTES = 1024 * 1024


def step_spans(sched, m: int) -> list:
    """Each step's (input offset, length, output offset) in elements, for a call of ``m``: one
    round over the whole buffer."""
    spans = []
    for step in sched.steps:
        io, k = chunk_span(sched.in_layout, sched.nchunks, step.chunk, 0, m, m)
        oo, _ = chunk_span(sched.out_layout, sched.nchunks, step.chunk, 0, m, m)
        spans.append((io, k, oo))
    return spans


class _Plan:
    """A schedule for one call shape (element count, element size), worked out once: whether any
    step reduces, each step's spans, and read_native's rows (made at the first call that can run
    compiled; None where a step reduces; False until then). A call then costs no chunk arithmetic.
    ``stream_out_min``: the output bytes from which a reducing step out of place streams its output
    (fetch_reduce.STREAM): sooner where no step reads an output back (a write_out_copy that goes
    with its reducing step's pieces does not: _push)."""

    __slots__ = ("sched", "reduces", "spans", "native", "in_place", "registered", "stream_out_min", "fetch")

    def __init__(self, sched, m: int, in_place: bool, registered: bool = False):
        self.sched, self.reduces = sched, any(step.reduces for step in sched.steps)
        self.spans, self.native, self.in_place = step_spans(sched, m), False, in_place
        self.registered = registered
        self.fetch: dict = {}   # step index -> _FetchStep, made at its first compiled call
        reread = any(step.reads == "out" or step.kind == "write_out_copy" for step in sched.steps)
        self.stream_out_min = STREAM_OUT_MIN_BYTES if reread else STREAM_FINAL_OUT_MIN_BYTES


def _build(first_remote: int, overlaps: bool, via_scratch: bool, nbytes: int, stream_out_min: int):
    """fetch_reduce's ``into`` and ``build`` for a step: the first remote operand fetched straight
    into the output where the output overlaps no local operand, then reduced there (INTO_OUT), or
    streamed out from ``stream_out_min`` bytes (STREAM); SCRATCH where this rank's input is a later
    operand the output overlaps."""
    if via_scratch:
        return -1, fetch_reduce.SCRATCH
    if overlaps:
        return -1, fetch_reduce.INTO_OUT
    if nbytes >= stream_out_min and stream_copy.enabled():
        return -1, fetch_reduce.STREAM
    return first_remote, fetch_reduce.INTO_OUT


class _FetchStep:
    """A reducing step as the compiled path runs it (ReadEngine._fetch_step), worked out once: which
    operand is this rank's input (``own_j``; -1: none), the others as (operand, rank), whether the
    write_out_copy after it goes with it (``paired``: read_native.pushes) and into which ranks
    (``push``), and fetch_reduce's argument block per (dtype, op) of its calls (None: a dtype the
    compiled loop does not take)."""

    __slots__ = ("own_j", "remote", "paired", "push", "blocks")

    def __init__(self, steps, spans, i: int, me: int):
        ranks = steps[i].remote
        self.own_j = ranks.index(me) if me in ranks else -1
        self.remote = [(j, q) for j, q in enumerate(ranks) if q != me]
        self.paired = read_native.pushes(steps, spans, i)
        self.push = tuple(steps[i + 1].remote) if self.paired else ()
        self.blocks: dict = {}

    def pushed_into(self, op: str) -> tuple:
        """The ranks each built piece goes to as it is built: none for AVG, which divides after
        the whole step (its write_out_copy follows then)."""
        return self.push if op != "avg" else ()


class ReadLane:
    """A known call's shortest way into read_native's compiled call (comm._run_known; the FIFO
    engine's twin is engine_native.Lane): ReadEngine.run's look-ups (its plan, whether the compiled
    path applies, the call's descriptor), done once. run() is the engine comm._execute_now calls:
    the compiled call, then Python's steps from where it handed back. (A known call's arrays are
    the same objects each time: registered or plain for good.)"""

    __slots__ = ("engine", "ex", "plan", "nsteps", "args")

    def __init__(self, engine: ReadEngine, ex, plan: _Plan, nsteps: int, args: np.ndarray):
        self.engine, self.ex, self.plan, self.nsteps = engine, ex, plan, nsteps
        self.args = args   # the compiled call's argument block, filled but for the call's number

    def run(self, sched, call) -> None:
        e, a = self.engine, self.args
        e.calls = a[read_native.A_CALLS] = e.calls + 1
        # A copy-only call ends in its one compiled call: _resume is for the rest (a reducing step
        # for Python, or a wait handed back). 0.09 us of a 64 KiB broadcast's ~1.2 us of Python.
        got = e.run_call(a)
        if got == read_native.DONE:
            return
        ain, aout = call.addrs
        went = e._resume(self.ex, sched, call, self.plan, ain, aout, a, got)
        if went is not None:
            e.go_on(self.ex, sched, call, self.plan, ain, aout, *went)


def _never_entered(e, registered: bool):
    """A peer that never enters a read call may be late, or in another call, or in this one by
    another algorithm: where this rank passed registered memory, because the peer passed plain
    memory (registered.settle chose for each). Say the last in the timeout's message
    (PeerTimeout.detail, which the executor appends): it is the one a program can get wrong."""
    if registered and isinstance(e, PeerTimeout) and not getattr(e, "detail", ""):
        e.detail = (f"if rank {e.peer} passed plain memory to this call where this rank passed comm.alloc "
                    f"memory, it runs another algorithm and never enters this one: every rank must pass "
                    f"registered buffers to the same calls (RINGCOMM_DEBUG=check names such a rank at once)")
    return e


class ReadEngine:
    """One communicator's engine for read steps, over its Registry's mappings."""

    def __init__(self, reg):
        self.reg = reg
        self.calls = 0                       # registered calls entered, as published in CALLS
        self.syncs = np.zeros(reg.n, np.int64)   # syncs reached with each peer, as published in SYNC + p
        self.scratch: dict = {}              # dtype -> a piece-sized buffer (see _reduce)
        self.plans: dict = {}                # (id(schedule), m, itemsize) -> _Plan
        self.maps = peer_maps.table(reg.n)   # the peers' allocations as mapped here (Registry.alloc fills it)
        self.peer_words = None               # the peers' control words' addresses (read_native)...
        # ...and the rest it needs (constants, scratch, the compiled call and its argument block,
        # read_native.arguments), made at first use
        self.consts = self.iov = self.res = self.run_call = self.args = None
        self.handed_back = 0                 # compiled calls that Python finished (a long wait, an error)

    def run(self, ex, sched, call) -> None:
        """Run a "read" schedule (one round: the whole buffer) on registered buffers, or on plain ones
        that the peers read by CMA (plain_read.py)."""
        ex._call, ex._nsteps = call, len(sched.steps)   # first: from the CALLS store on, peers may read
        # Each address once per call (address() costs ~1 us of Python: a 16 KiB call's CMA read is
        # ~7), or none: a known call (known_calls.py) carries them.
        if call.addrs is not None:
            ain, aout = call.addrs
        else:
            ain = address(call.inp)
            aout = ain if call.out is call.inp else address(call.out)
        self.calls += 1
        start, arrived = 0, False
        desc = self._descriptor(call, ain, aout)
        plan = self._plan(sched, call, ain, aout, desc)
        compiled = self._compiled(ex, plan, call, desc)
        if compiled is not None:   # the whole call in compiled code, or up to where Python goes on
            start, arrived = self._run_compiled(ex, compiled, ain, aout, call, sched, plan, desc)
            if start is None:
                return
        else:
            words = self.reg.ctl.words
            words[DESC:DESC + 6] = (*(desc or (-1, ain, -1, aout)), call.inp.nbytes, call.out.nbytes)
            self.reg.publish(CALLS, self.calls)  # after the descriptor (x86 store order): peers may read it now
        self.go_on(ex, sched, call, plan, ain, aout, start, arrived)

    def go_on(self, ex, sched, call, plan: _Plan, ain: int, aout: int, start: int, arrived: bool) -> None:
        """The steps from ``start`` in Python (a call the compiled path did not take, or handed back)."""
        views: dict = {}
        if not plan.reduces:   # copy-only: no kernel, no errstate
            self._steps(ex, sched, call, None, views, ain, aout, plan, start, arrived)
            return
        with np.errstate(all="ignore"):
            self._steps(ex, sched, call, kernels.elementwise(call.op, call.inp.dtype), views, ain, aout, plan,
                        start, arrived)

    def lane(self, ex, sched, call) -> ReadLane | None:
        """A known call's lane into the compiled path (see ReadLane), where it has one: a call like
        this one ran there before."""
        ain = address(call.inp)
        aout = ain if call.out is call.inp else address(call.out)
        desc = self._descriptor(call, ain, aout)
        plan = self._plan(sched, call, ain, aout, desc)
        prepared = None if self.run_call is None else self._compiled(ex, plan, call, desc)
        if prepared is None:
            return None
        args = self.args.copy()   # the engine's arrays, and this call's plan and buffers, for good
        args[read_native.CALL_WORDS] = read_native.call_words(
            prepared, 0, ain, aout, call.inp.nbytes, call.out.nbytes, desc)   # the number: at each call (ReadLane.run)
        return ReadLane(self, ex, plan, len(sched.steps), args)

    def _descriptor(self, call, ain: int, aout: int) -> tuple | None:
        """The call's descriptor words (DESC's first four: _where of its input and output), or None
        where no allocation of this rank's is registered (then both are plain)."""
        if not self.reg.mine:
            return None
        return (*self._where(call.inp, ain), *self._where(call.out, aout))

    def _compiled(self, ex, plan: _Plan, call, desc: tuple | None):
        """read_native's plan for this call, where the compiled path applies: the native engine, the
        control segments exchanged (CMA's probe or an allocation), and a schedule whose steps copy
        (its large local copies stream past the caches there too: read_native._copy), from and into
        plain buffers by CMA or registered ones through their mappings, or reduce what they read
        from inputs (each such step handed to _fetch_step)."""
        reg = self.reg
        if ex.native is None or not reg.exchanged():
            return None
        if plan.native is False:
            made = read_native.plan(plan.sched, plan.spans, call.inp.itemsize, reg.rank, pieces=not plan.in_place,
                                    by_cma=not plan.registered)
            plan.native = None if made is None else read_native.Prepared(*made)
        return plan.native

    def _run_compiled(self, ex, prepared, ain: int, aout: int, call, sched, plan: _Plan, desc: tuple | None):
        """Run the call in read_native's compiled function (_drive): (None, None) when it finished,
        else the step (and whether its sync arrivals are published) from which Python goes on."""
        reg = self.reg
        if self.peer_words is None:
            self.peer_words = np.array([0 if p == reg.rank else reg.peers[p, "ctl"].base for p in range(reg.n)],
                                       np.int64)
            budget = int(min(ex._spin_s, read_native.SPIN_S) * native_sync.cycles_per_second())
            self.consts = read_native.constants(reg.n, reg.rank, budget, Backoff.compiled_yields(ex._spin_s > 0))
            self.iov, self.res = np.empty(4, np.int64), np.zeros(2, np.int64)
            self.args = read_native.arguments(reg.ctl.words, self.peer_words, self.syncs, self.consts, self.iov,
                                              self.maps, self.res)
            self.run_call = read_native.kernel()
        self.consts[read_native.CMA] = bool(reg.cma)   # (probed once; its lanes share the array)
        a = self.args
        a[read_native.CALL_WORDS] = read_native.call_words(
            prepared, self.calls, ain, aout, call.inp.nbytes, call.out.nbytes, desc)
        went = self._drive(ex, sched, call, plan, ain, aout, a)
        return (None, None) if went is None else went

    def _drive(self, ex, sched, call, plan: _Plan, ain: int, aout: int, a: np.ndarray):
        """The compiled call over argument block ``a`` (filled for a call from its start), with each
        reducing step it stops at (read_native.REDUCE) run here by _fetch_step and the compiled
        call resumed after it: None when the call finished, else (step, whether its sync arrivals
        are published) from which Python's steps go on."""
        got = self.run_call(a)
        return None if got == read_native.DONE else self._resume(ex, sched, call, plan, ain, aout, a, got)

    def _resume(self, ex, sched, call, plan: _Plan, ain: int, aout: int, a: np.ndarray, got: int):
        """_drive after a compiled call that returned ``got``, not DONE: each reducing step run here
        and the compiled call resumed after it, until it finishes or hands the call back."""
        try:
            while got == read_native.REDUCE:
                nxt = self._fetch_step(ex, sched, call, plan, ain, aout, int(self.res[0]))
                if nxt is None:   # Python's steps took the rest of the call
                    return None
                a[read_native.A_START], a[read_native.A_ARRIVED] = nxt, 0
                got = self.run_call(a)
        finally:
            a[read_native.A_START] = -1   # (a lane's block serves its next call from the start)
        return None if got == read_native.DONE else self._handed_back()

    def _fetch_step(self, ex, sched, call, plan: _Plan, ain: int, aout: int, i: int):
        """Reducing step i, where the compiled call stopped (every peer it reads, or writes into,
        has entered the call with buffers it can take: plain and of this call's sizes, or
        registered and mapped here): fetch_reduce's loop, as _reduce would run it (the same build,
        the same write of each piece into the peers with the write_out_copy that follows: _push),
        without the views and Remotes, whose Python cost ~50 us a call. The step to go on from in
        compiled code; None where Python's steps took the rest of the call (a dtype the compiled
        loop does not take)."""
        steps, (io, k, oo) = sched.steps, plan.spans[i]
        fs = plan.fetch.get(i)
        if fs is None:
            fs = plan.fetch[i] = _FetchStep(steps, plan.spans, i, self.reg.rank)
        dtype, size, op = call.out.dtype, call.out.itemsize, call.op
        got = fs.blocks.get((dtype, op), False)
        if got is False:
            got = fs.blocks[dtype, op] = self._fetch_block(fs, dtype, op, io, k, oo)
        if got is None:   # a dtype the compiled loop does not take: Python's steps from here
            self.go_on(ex, sched, call, plan, ain, aout, i, False)
            return None
        ex._step = i
        here, mine, nbytes = aout + oo * size, ain + io * size, k * size
        overlaps = fs.own_j >= 0 and here < mine + nbytes and mine < here + nbytes
        via_scratch = fs.own_j >= 2 and overlaps   # as _step: the first operation would overwrite it
        w = got.words
        w[fetch_reduce.B_OUT], w[fetch_reduce.B_OWN] = here, (mine if fs.own_j >= 0 else 0)
        w[fetch_reduce.B_INTO], w[fetch_reduce.B_BUILD] = _build(
            fs.remote[0][0], overlaps, via_scratch, nbytes,
            STREAM_FINAL_OUT_MIN_BYTES if w[fetch_reduce.B_NPUSH] else plan.stream_out_min)
        ex._waiting = (fs.remote[0][1], "read", 0, time.monotonic())
        try:
            failed = fetch_reduce.enter(got)
        finally:
            ex._waiting = None
        push = fs.pushed_into(op)
        out = call.out[oo:oo + k]
        views: dict = {}
        if failed != -1:   # a read or a write failed: Python's loop goes on with Remotes (and says why)
            srcs = [call.inp[io:io + k] if j == fs.own_j else self._view(ex, call, q, "in", views)[io:io + k]
                    for j, q in enumerate(steps[i].remote)]
            targets = [self._view(ex, call, q, "out", views, "write into")[oo:oo + k] for q in push]
            with np.errstate(all="ignore"):
                self._after_compiled(ex, call, out, srcs, kernels.elementwise(call.op, dtype), via_scratch,
                                     targets or None, failed)
        if steps[i].final and call.op == "avg":   # (host.postprocess: AVG only)
            with np.errstate(all="ignore"):
                kernels.postprocess(out, call.op, self.reg.n)
        if fs.paired and not push:   # AVG's write_out_copy, after the division
            ex._step = i + 1
            self._step(ex, call, steps[i + 1], None, views, ain, aout, *plan.spans[i + 1], plan.stream_out_min)
        return i + 2 if fs.paired else i + 1

    def _fetch_block(self, fs: _FetchStep, dtype, op: str, io: int, k: int, oo: int):
        """fetch_reduce's block for step ``fs`` of ``k`` elements at input offset ``io`` and output
        offset ``oo`` (the peers' too), for calls of ``dtype`` and ``op``; None where the compiled
        loop does not take the dtype."""
        if fetch_reduce.loop(dtype) is None:
            return None
        m, size = len(fs.remote) + (fs.own_j >= 0), np.dtype(dtype).itemsize
        piece = max(1, FETCH_PIECE_BYTES // size)
        rows = self._scratch(dtype, (m + 1) * piece, "fetch")[:(m + 1) * piece].reshape(m + 1, piece)
        ctl = [0] * m
        for j, q in fs.remote:
            ctl[j] = int(self.peer_words[q])
        push = fs.pushed_into(op)
        ranks = [0] * m
        for j, q in fs.remote:
            ranks[j] = q
        return fetch_reduce.Block(dtype, op, k, fs.own_j, ctl, [int(self.peer_words[q]) for q in push],
                                  io * size, oo * size, rows, self.iov, (*ranks, *push), self.maps)

    def _handed_back(self) -> tuple[int, bool]:
        """Where Python goes on from a compiled call that did not finish: the step, and whether its
        sync arrivals are published."""
        self.handed_back += 1
        return int(self.res[0]), bool(self.res[1])

    def _plan(self, sched, call, ain: int, aout: int, desc: tuple | None) -> _Plan:
        """This schedule's _Plan for the call's shape, whether its input lies in its output (in
        place) and whether its output is registered (its peers' then are too, in a correct program:
        the compiled writes' pieces are memmoves), from the cache (keyed by identity, and checked:
        a recycled id never returns another schedule's plan)."""
        in_place = aout <= ain < aout + call.out.nbytes
        registered = desc is not None and desc[2] != -1
        key = (id(sched), call.m, call.inp.itemsize, in_place, registered)
        got = self.plans.get(key)
        if got is None or got.sched is not sched:
            if len(self.plans) >= 64:
                self.plans.clear()
            got = self.plans[key] = _Plan(sched, call.m, in_place, registered)
        return got

    def _steps(self, ex, sched, call, fn, views, ain: int, aout: int, plan: _Plan, start: int = 0,
               arrived: bool = False) -> None:
        """The steps from ``start`` (where the compiled path handed over; ``arrived``: that step is a
        sync whose arrivals it published)."""
        steps, spans, i = sched.steps, plan.spans, start
        while i < len(steps):
            step = steps[i]
            ex._step = i
            if step.kind == "sync":
                self._sync(ex, call, step.remote, arrived and i == start)
            elif step.writes and (j := read_native.write_then_copy(steps, spans, i)):
                self._write_then_copy(ex, call, [q for s in steps[i:j] for q in s.remote], views, ain, aout,
                                      spans[i][0], spans[i][1], [spans[w][2] for w in range(i, j)], spans[j][2])
                i = j
            elif step.reduces and (push := self._push(ex, call, steps, spans, i, views)):
                if self._step(ex, call, step, fn, views, ain, aout, *spans[i], STREAM_FINAL_OUT_MIN_BYTES, push):
                    i += 1   # the write_out_copy step went with the pieces
            else:
                self._step(ex, call, step, fn, views, ain, aout, *spans[i], plan.stream_out_min)
            i += 1

    def _write_then_copy(self, ex, call, peers, views, ain: int, aout: int, io: int, k: int, there, oo: int):
        """All_gather's writes of this rank's input block [io, io+k) to each of ``peers`` (at
        their output offsets ``there``), then its copy to this output at ``oo``, taken a piece at
        a time (read_native.write_then_copy, piece_bytes): the copy reads each piece from cache.
        In place there is no copy, and the block goes in one write (a system call per piece cost
        5-9%); so does a CMA-written block of CMA_WHOLE_BLOCK_BYTES, or whose writes move
        CMA_WHOLE_BYTES in all."""
        size = call.inp.itemsize
        dsts = [self._view(ex, call, q, "out", views, "write into") for q in peers]
        onto_itself = aout + oo * size == ain + io * size
        cut = read_native.piece_bytes(any(isinstance(d, Remote) for d in dsts), k * size, len(dsts))
        piece = k if onto_itself else max(1, cut // size)
        whole = k * size
        for a in range(0, k, piece):
            b = min(k, a + piece)
            src = call.inp[io + a:io + b]
            for dst, t in zip(dsts, there):
                if isinstance(dst, Remote):
                    self._cma(ex, call, dst[t + a:t + b], src, writing=True)
                else:
                    stream_copy.copy(dst[t + a:t + b], src, whole)
            if not onto_itself:
                stream_copy.copy(call.out[oo + a:oo + b], src, whole)

    def _where(self, arr, addr: int) -> tuple[int, int]:
        """(allocation index, offset) of a registered buffer; (-1, address) of a plain one at ``addr``."""
        return (self.reg.locate(arr) if self.reg.mine else None) or (-1, addr)

    def _push(self, ex, call, steps, spans, i: int, views) -> list | None:
        """Where reducing step i is followed by a write_out_copy of its chunk, on the native engine:
        the peers' output chunks (Remotes of plain buffers, views of registered ones), into which
        each piece is written as soon as it is built, while it is in this core's cache (by
        fetch_reduce, or _reduce_pieces); else None (the steps go one after the other, as on the
        reference engine). Not for AVG, whose division comes after the whole step (_step's
        postprocess), before the write."""
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if (nxt is None or nxt.kind != "write_out_copy" or spans[i + 1][1:] != spans[i][1:]
                or ex.native is None or call.op == "avg"):   # (host.postprocess: AVG only)
            return None
        me, oo, k = self.reg.rank, spans[i][2], spans[i][1]
        for q in steps[i].remote:   # the reads' waits first (their messages say "read")
            if q != me:
                self._view(ex, call, q, "in", views)
        return [self._view(ex, call, q, "out", views, "write into")[oo:oo + k] for q in nxt.remote]

    def _step(self, ex, call, step, fn, views, ain: int, aout: int, io: int, k: int, oo: int,
              stream_out_min: int, push: list | None = None) -> bool:
        """One step; True where ``push`` (_push) went with a reducing step's pieces."""
        me = self.reg.rank
        out = call.out[oo:oo + k]
        if step.kind == "copy":
            size = call.inp.itemsize
            if aout + oo * size != ain + io * size:   # not a copy onto itself
                stream_copy.copy(out, call.inp[io:io + k])
            return False
        if step.writes:  # this rank's input (write_copy) or output chunk straight into each peer's output chunk
            src = out if WRITES[step.kind] == "out" else call.inp[io:io + k]
            for q in step.remote:
                dst = self._view(ex, call, q, "out", views, "write into")[oo:oo + k]
                if isinstance(dst, Remote):
                    self._cma(ex, call, dst, src, writing=True)
                else:
                    stream_copy.copy(dst, src)
            return False
        if step.reads == "out":
            srcs = [self._view(ex, call, step.remote[0], "out", views)[oo:oo + k]]
        else:
            srcs = [call.inp[io:io + k] if q == me else self._view(ex, call, q, "in", views)[io:io + k]
                    for q in step.remote]
        if not step.reduces:
            if isinstance(srcs[0], Remote):
                self._cma(ex, call, srcs[0], out)
            else:
                stream_copy.copy(out, srcs[0])
            return False
        mine = [i for i, q in enumerate(step.remote) if q == me]
        via_scratch = bool(mine) and mine[0] >= 2 and np.shares_memory(out, srcs[mine[0]])
        pushed = self._reduce(ex, call, out, srcs, fn, via_scratch, stream_out_min, push)
        if step.final:
            kernels.postprocess(out, call.op, self.reg.n)
        return pushed

    def _reduce(self, ex, call, out, srcs, fn, via_scratch: bool, stream_out_min: int, push=None) -> bool:
        """out = srcs[0] op srcs[1] op ..., in that order (_reduce_pieces); where peers' plain
        buffers are among them and the engine is the native one, in fetch_reduce's compiled loop,
        whose pieces are these (an output of ``stream_out_min`` bytes out of place streamed, each
        piece written into ``push``'s peer chunks too), and Python's loop only from a piece whose
        read failed (it reads it again, and says why); where a write failed, the reduction is
        whole and Python writes from that piece on (and says why if it fails again). True where
        the chunk went to ``push`` (else the write step that follows writes it)."""
        remote = [j for j, s in enumerate(srcs) if isinstance(s, Remote)]
        if (remote and ex.native is not None and len(srcs) >= 2 and len(srcs) - len(remote) <= 1
                and fetch_reduce.loop(out.dtype) is not None
                and all(isinstance(t, Remote) for t in push or ())):
            failed = self._reduce_compiled(ex, call, out, srcs, remote, via_scratch, stream_out_min, push)
            return self._after_compiled(ex, call, out, srcs, fn, via_scratch, push, failed)
        self._reduce_pieces(ex, call, out, srcs, fn, via_scratch, push)
        return bool(push)

    def _after_compiled(self, ex, call, out, srcs, fn, via_scratch: bool, push, failed: int) -> bool:
        """After fetch_reduce.run returned ``failed``: nothing left (-1); the writes into ``push``
        that stopped at a piece (-2 - its offset: the reduction is whole), made here by CMA; or
        the piece whose read failed, from which Python's loop reduces (its reads say why they
        fail). True where the chunk went to ``push``."""
        if failed == -1:
            return bool(push)
        if failed < -1:
            w = -2 - failed
            for t in push:
                self._cma(ex, call, t[w:], out[w:], writing=True)
            return True
        out, srcs = out[failed:], [s[failed:] for s in srcs]
        push = push and [t[failed:] for t in push]
        self._reduce_pieces(ex, call, out, srcs, fn, via_scratch, push)
        return bool(push)

    def _reduce_compiled(self, ex, call, out, srcs, remote: list, via_scratch: bool, stream_out_min: int,
                         push=None) -> int:
        """fetch_reduce.run over this step (writing each piece into ``push``'s Remotes too): -1 when
        done, the piece where a read failed, or -2 - the piece where a write failed."""
        own_j = next((j for j, s in enumerate(srcs) if not isinstance(s, Remote)), -1)
        own = None if own_j < 0 else srcs[own_j]
        overlaps = via_scratch or (own is not None and np.may_share_memory(out, own))
        into, build = _build(remote[0], overlaps, via_scratch, out.nbytes, stream_out_min)
        piece = max(1, FETCH_PIECE_BYTES // out.itemsize)
        pids = np.array([0 if j == own_j else s.pid for j, s in enumerate(srcs)], np.int64)
        addrs = np.array([0 if j == own_j else s.addr for j, s in enumerate(srcs)], np.int64)
        scratch = self._scratch(out.dtype, (len(srcs) + 1) * piece, "fetch")[:(len(srcs) + 1) * piece]
        if self.iov is None:
            self.iov = np.empty(4, np.int64)
        push_pids, push_addrs = ((np.array([t.pid for t in push], np.int64), np.array([t.addr for t in push], np.int64))
                                 if push else (fetch_reduce.NO_PUSH, fetch_reduce.NO_PUSH))
        ex._waiting = (srcs[remote[0]].peer, "read", 0, time.monotonic())
        try:
            return fetch_reduce.run(out, own, own_j, pids, addrs, scratch.reshape(len(srcs) + 1, piece), piece,
                                    call.op, into, build, self.iov, push_pids, push_addrs)
        finally:
            ex._waiting = None

    def _reduce_pieces(self, ex, call, out, srcs, fn, via_scratch: bool, push=None) -> None:
        """out = srcs[0] op srcs[1] op ..., in that order, piece by piece, each piece written into
        ``push``'s peer chunks too once built (_push). Where out is this rank's own
        input (in place) and that input is not among the first two operands, the first operation
        would overwrite it before it is read: those pieces are built in a scratch buffer.

        A peer's plain buffer (a Remote) cannot be reduced from where it is: each piece of it is
        first copied by CMA into a piece-sized buffer of this rank's, then reduced from there while
        it is in L2; a remote byte is copied once, into this cache, where the FIFO path copies it
        twice (into a slot by its owner, out of it here). Where the output overlaps no local
        operand, the first remote one (in rank order always among the first two: only this rank's
        own input is local) is fetched into the output piece itself, and the reduction runs in place
        on lines the fetch just brought into the cache; reduced into a third buffer, each output
        line was read from memory before it was written (2 ranks, out of place: reduce_scatter
        16 MiB 1194-1340 us against 1440-1512, 64 MiB 9326-9623 against 11160-12301; all_reduce
        16 MiB 1910-1925 against 2060-2102)."""
        remote = [j for j, s in enumerate(srcs) if isinstance(s, Remote)]
        if remote:
            piece_bytes = FETCH_PIECE_BYTES
        else:
            piece_bytes = ONE_PASS_PIECE_BYTES if len(srcs) == 2 and not via_scratch else PIECE_BYTES
        piece = max(1, piece_bytes // out.itemsize)
        in_place = any(np.may_share_memory(out, s) for s in srcs if not isinstance(s, Remote))
        into_out = bool(remote) and not via_scratch and not in_place
        # A piece written into a peer's mapping is streamed where the chunk is big and out of place:
        # in place the peer's chunk is its input, whose lines this rank has just read (an ordinary
        # store finds them in its cache; streamed, they would be evicted first).
        whole = 0 if in_place else out.nbytes
        fetched = [(j, None if into_out and j == remote[0] else self._scratch(out.dtype, piece, 1 + j))
                   for j in remote]
        scratch = self._scratch(out.dtype, piece) if via_scratch else None
        for a in range(0, out.size, piece):
            b = min(a + piece, out.size)
            ops = [s if isinstance(s, Remote) else s[a:b] for s in srcs]
            for j, buf in fetched:
                ops[j] = out[a:b] if buf is None else buf[:b - a]
                self._cma(ex, call, srcs[j][a:b], ops[j])
            acc = scratch[:b - a] if via_scratch else out[a:b]
            fn(ops[0], ops[1], out=acc)
            for s in ops[2:]:
                fn(acc, s, out=acc)
            for t in push or ():
                if isinstance(t, Remote):
                    self._cma(ex, call, t[a:b], acc, writing=True)
                else:
                    stream_copy.copy(t[a:b], acc, whole)
            if via_scratch:
                out[a:b] = acc

    def _scratch(self, dtype, size, which: int = 0) -> np.ndarray:
        """A reusable buffer of at least ``size`` elements: 0 for in-place pieces, 1 + j for the
        fetched pieces of operand j, "fetch" for fetch_reduce's rows."""
        buf = self.scratch.get((dtype, which))
        if buf is None or buf.size < size:
            buf = self.scratch[dtype, which] = np.empty(size, dtype)
        return buf

    def _view(self, ex, call, q: int, which: str, views: dict, verb: str = "read") -> np.ndarray:
        """Peer q's input or output of this call, once q has entered it."""
        got = views.get((q, which))
        if got is not None:
            return got
        words = self.reg.peers[q, "ctl"].words
        if words[CALLS] < self.calls:  # (the message is made only if it is needed)
            self.reg.wait(q, lambda: words[CALLS] >= self.calls, lambda e: ex._explain(
                _never_entered(e, self.reg.holds(call.inp, call.out)),
                f"waiting for {call.name} #{call.seq} to start so as to {verb} the registered buffer of"),
                ex, CALLS)
        at = DESC if which == "in" else DESC + 2
        k, off = int(words[at]), int(words[at + 1])
        arr = call.inp if which == "in" else call.out
        nbytes = int(words[DESC + 4 + (which == "out")])
        if nbytes != arr.nbytes:   # (registered too: a bigger write would land past the peer's buffer)
            raise RingcommError(f"rank {self.reg.rank} (this process): rank {q}'s {which}put of {call.name} "
                                f"#{call.seq} has {nbytes} bytes, this rank's {arr.nbytes}: the ranks "
                                f"passed different sizes")
        if k == -1:  # a plain buffer in q's own memory: read by CMA, straight into this rank's output
            got = views[q, which] = Remote(int(words[PID]), off, nbytes // arr.itemsize, arr.dtype, q)
            return got
        seg = self.reg.peers.get((q, k))
        if seg is None or off + arr.nbytes > seg.size:
            raise RingcommError(f"rank {self.reg.rank} (this process): rank {q}'s {which}put of {call.name} "
                                f"#{call.seq} does not fit its allocation #{k}: the ranks passed different sizes")
        got = views[q, which] = seg.bytes[off:off + arr.nbytes].view(arr.dtype)
        return got

    def _cma(self, ex, call, remote: Remote, local, writing: bool = False) -> None:
        """Copy between a peer's plain buffer and this rank's ``local`` array by CMA: out of
        ``remote`` into ``local`` for a read step, the other way for a write step."""
        t0 = time.monotonic()
        ex._waiting = (remote.peer, "write" if writing else "read", 0, t0)
        try:
            if writing:
                remote.copy_from(local)
            else:
                remote.copy_to(local)
        except CmaError as e:
            doing = (f"writing (CMA) into its buffer in {call.name} #{call.seq} of" if writing else
                     f"reading (CMA) its buffer in {call.name} #{call.seq} from")
            if e.errno == errno.ESRCH:  # the peer died: explained like any dead peer
                raise ex._explain(PeerGone(f"rank {remote.peer} (pid {remote.pid}) died", peer=remote.peer,
                                           transport="shm"), doing) from None
            raise RingcommError(f"rank {self.reg.rank} (this process) failed {doing} rank {remote.peer}: "
                                f"{e}") from None
        ex._waiting = None

    def _sync(self, ex, call, peers, arrived: bool = False) -> None:
        me = self.reg.rank
        if not arrived:
            for p in peers:  # arrive at every pair's barrier first, then wait: no order can deadlock
                self.syncs[p] += 1
                self.reg.publish(SYNC + p, int(self.syncs[p]))
        for p in peers:
            theirs, want = self.reg.peers[p, "ctl"].words, int(self.syncs[p])
            if theirs[SYNC + me] < want:
                self.reg.wait(p, lambda: theirs[SYNC + me] >= want, lambda e: ex._explain(
                    e, f"waiting at sync {want} of {call.name} #{call.seq} (registered buffers) for"), ex, SYNC + me)

