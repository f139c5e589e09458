"""The Communicator: checks a call, picks an algorithm, hands its Schedule to the executor."""
from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref

import numpy as np

from . import check, model, plain_read, reproducible as repro, vcounts
from .buffers import address, expect_size, host_array, overlaps, same_dtype
from .catalogue import ALGOS, build_schedule
from .errors import CommunicatorClosed, RingcommError
from .executor import Call
from .group import Group
from .known_calls import KnownCalls
from .ops import SUM, as_op
from .registered import refuse, settle, why_read
from .schedule.onecopy import ALGO as READ
from .schedule import p2p
from .progress import Progress, asyncable

NEVER = 1 << 62   # a call count no communicator reaches: _balance_at where no balance runs

# This process's communicators, so that a forked child can disown them (_after_fork_in_child).
_LIVE: weakref.WeakSet = weakref.WeakSet()


class Communicator:
    """A group of ranks that run collectives together. Make one with ringcomm.init().

    Every public call that moves data is decorated with ``@asyncable``: it takes ``async_op=True``
    and then returns a ringcomm.Work; all calls run in issue order (ringcomm/progress.py).
    """

    def __init__(self, rank, world_size, local_rank, store, links, executor, *, timeout, owns_store, prefix,
                 roster=None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.timeout = timeout
        self._prefix = prefix
        self._store, self._links, self._executor = store, links, executor
        self._owns_store = owns_store
        self._roster = roster  # every rank's meeting address, for shrink (ringcomm/roster.py)
        self._seq = 0          # every call, for messages
        self._ordinal = 0      # collectives only (all ranks call them), for RINGCOMM_DEBUG=check
        self._balance_at = 0 if executor.balance is not None else NEVER   # the _ordinal of the next balance tick
        self._broken: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # one first writer of _broken: abort() or a failing call
        # Knobs read once: a collective must not pay for os.environ lookups.
        self._forced_algo = os.environ.get("RINGCOMM_ALGO", "").strip().lower()
        self._check = check.enabled()
        self._auto: dict = {}  # (collective, size band, swap_safe) -> the algorithm automatic choice picked
        self._device = None    # ringcomm.device.DevicePath, made at the first call on device buffers
        self._registry = None  # ringcomm.registered.Registry, made by the first alloc()
        self._known = KnownCalls()  # small calls repeated on the same arrays (known_calls.py)
        self._scratch: dict = {}  # reproducible mode's codes and limbs, kept between calls
        self._progress = Progress(rank, self._execute_now, self.abort)  # where calls run, in order
        self._pid = os.getpid()   # the process that made it: in a fork's child (_forked) nothing is ours
        _LIVE.add(self)

    # ---- collectives -------------------------------------------------------------------------

    @asyncable
    def all_reduce(self, buf, op=SUM, *, out=None, algo=None, reproducible=False):
        """Reduce ``buf`` over all ranks; the result lands in ``out`` (default: ``buf`` itself).

        ``reproducible=True`` (sum and avg of float dtypes): every element's bits depend only on the
        multiset of the ranks' inputs -- not on rank order, algorithm, slot settings, position or extra
        ranks of zeros; the exact sum rounded once (see ringcomm.reproducible and docs/05)."""
        args = ("all_reduce", op, algo)
        known = self._known.get(buf, out, args) if reproducible is False else None
        if known is not None:  # the same arrays as an earlier call, unchanged: its checks hold
            x = buf if buf.ndim == 1 else buf.reshape(-1)   # _flat, inlined on the 8-byte path
            y = x if out is None else out if out.ndim == 1 else out.reshape(-1)
            self._run_known(known, "all_reduce", x, y, x.size, None)
            return buf if out is None else out
        op = as_op(op)
        x = host_array(buf, "all_reduce buf", writable=out is None)
        y = x if out is None else self._out(out, x, x.size, "all_reduce")
        if self._reproducible(reproducible, "all_reduce", algo, x, y, op, None):
            return buf if out is None else out
        picked, sched = self._run("all_reduce", algo, x, y, x.size, op, None, x.nbytes)
        self._known.remember(buf, out, args, op, picked, sched)
        return buf if out is None else out

    @asyncable
    def all_gather(self, buf, out, *, algo=None):
        """``out`` gets world_size blocks of buf.size elements; rank r's buf at block r."""
        args = ("all_gather", algo)
        known = self._known.get(buf, out, args)
        if known is not None:
            x = _flat(buf)
            self._run_known(known, "all_gather", x, _flat(out), x.size, None)
            return out
        x = host_array(buf, "all_gather buf", writable=False)
        y = self._out(out, x, x.size * self.world_size, "all_gather")
        picked, sched = self._run("all_gather", algo, x, y, x.size, "sum", None, y.nbytes)
        self._known.remember(buf, out, args, "sum", picked, sched)
        return out

    @asyncable
    def reduce_scatter(self, buf, out, op=SUM, *, algo=None, reproducible=False):
        """``buf`` holds world_size blocks of out.size; rank r gets block r reduced over all ranks
        (``reproducible=True``: the very bits all_reduce(reproducible=True) gives for those elements)."""
        args = ("reduce_scatter", op, algo)
        known = self._known.get(buf, out, args) if reproducible is False else None
        if known is not None:
            y = _flat(out)
            self._run_known(known, "reduce_scatter", _flat(buf), y, y.size, None)
            return out
        op = as_op(op)
        x = host_array(buf, "reduce_scatter buf", writable=False)
        y = host_array(out, "reduce_scatter out", writable=True)
        same_dtype(x, y, "reduce_scatter buf and out")
        expect_size(x, y.size * self.world_size, f"reduce_scatter buf (world_size {self.world_size} x out.size)")
        if overlaps(x, y) and not _aliases_ok(x, y, "reduce_scatter", self.rank):
            raise ValueError("reduce_scatter: buf and out overlap without out being buf's own block")
        if self._reproducible(reproducible, "reduce_scatter", algo, x, y, op, None):
            return out
        picked, sched = self._run("reduce_scatter", algo, x, y, y.size, op, None, x.nbytes)
        self._known.remember(buf, out, args, op, picked, sched)
        return out

    @asyncable
    def broadcast(self, buf, root=0, *, algo=None):
        """Every rank's ``buf`` gets root's."""
        args = ("broadcast", algo, type(root), root)   # with its type: 0.0 == 0, but only an int passes
        known = self._known.get(buf, None, args)
        if known is not None:
            x = buf if buf.ndim == 1 else buf.reshape(-1)   # _flat, inlined as in all_reduce
            self._run_known(known, "broadcast", x, x, x.size, root)
            return buf
        self._check_rank(root, "broadcast root")
        x = host_array(buf, "broadcast buf", writable=self.rank != root)
        picked, sched = self._run("broadcast", algo, x, x, x.size, "sum", root, x.nbytes)
        self._known.remember(buf, None, args, "sum", picked, sched)
        return buf

    @asyncable
    def reduce(self, buf, root=0, op=SUM, *, out=None, algo=None, reproducible=False):
        """Like all_reduce, but only ``root`` gets the result (in ``out``, default ``buf``);
        ``reproducible=True`` as for all_reduce, with the same bits."""
        args = ("reduce", op, algo, type(root), root)   # the root with its type, as broadcast's
        known = self._known.get(buf, out, args) if reproducible is False else None
        if known is not None:
            x = _flat(buf)
            self._run_known(known, "reduce", x, x if out is None else _flat(out), x.size, root)
            return buf if out is None else out
        op = as_op(op)
        self._check_rank(root, "reduce root")
        x = host_array(buf, "reduce buf", writable=out is None and self.rank == root)
        y = x if out is None else self._out(out, x, x.size, "reduce")
        if self._reproducible(reproducible, "reduce", algo, x, y, op, root):
            return buf if out is None else out
        picked, sched = self._run("reduce", algo, x, y, x.size, op, root, x.nbytes)
        self._known.remember(buf, out, args, op, picked, sched)
        return buf if out is None else out

    @asyncable
    def all_to_all(self, buf, out, *, send_counts=None, recv_counts=None, algo=None):
        """Without counts: buf's block j (world_size equal blocks) goes to rank j, and out's block i
        comes from rank i. With send_counts and recv_counts (both, world_size ints each): the blocks
        are packed in rank order, buf.size == sum(send_counts), out.size == sum(recv_counts), and
        rank i's send_counts[j] must be rank j's recv_counts[i]. out may not overlap buf."""
        args = ("all_to_all", algo)   # equal blocks only: packed counts take the checked path every time
        equal = send_counts is None and recv_counts is None
        known = self._known.get(buf, out, args) if equal else None
        if known is not None:
            x = _flat(buf)
            self._run_known(known, "all_to_all", x, _flat(out), x.size // self.world_size, None)
            return out
        x, y, m, blocks = vcounts.all_to_all_args(buf, out, send_counts, recv_counts, self.rank, self.world_size)
        if blocks is not None:
            algo = vcounts.direct_algo(algo, self._forced_algo, self.world_size)
        picked, sched = self._run("all_to_all", algo, x, y, m, "sum", None, x.nbytes, blocks)
        if equal:
            self._known.remember(buf, out, args, "sum", picked, sched)
        return out

    @asyncable
    def gather(self, buf, out=None, root=0, *, algo=None):
        """``root``'s out (world_size * buf.size) gets rank r's buf at block r; other ranks omit out."""
        args = ("gather", algo, type(root), root)   # the root with its type, as broadcast's
        known = self._known.get(buf, out, args)
        if known is not None:
            x = _flat(buf)
            self._run_known(known, "gather", x, x if out is None else _flat(out), x.size, root)
            return out
        self._check_rank(root, "gather root")
        x, y = vcounts.gather_args(buf, out, self.rank == root, self.rank, root, self.world_size)
        picked, sched = self._run("gather", algo, x, y, x.size, "sum", root, x.nbytes * self.world_size)
        self._known.remember(buf, out, args, "sum", picked, sched)
        return out

    @asyncable
    def scatter(self, buf, out, root=0, *, algo=None):
        """Block r of ``root``'s buf (world_size * out.size) goes to rank r's out; other ranks pass
        buf=None."""
        args = ("scatter", algo, type(root), root)
        # remembered by (buf, out), or on the ranks that pass buf=None by (out, None)
        first, second = (out, None) if buf is None else (buf, out)
        known = self._known.get(first, second, args)
        if known is not None:
            y = _flat(out)
            self._run_known(known, "scatter", y if buf is None else _flat(buf), y, y.size, root)
            return out
        self._check_rank(root, "scatter root")
        x, y = vcounts.scatter_args(buf, out, self.rank == root, self.rank, root, self.world_size)
        picked, sched = self._run("scatter", algo, x, y, y.size, "sum", root, y.nbytes * self.world_size)
        self._known.remember(first, second, args, "sum", picked, sched)
        return out

    @asyncable
    def send(self, buf, peer):
        """Send ``buf`` to ``peer``, which must call recv with a buffer of the same size and dtype."""
        if self._to_self(peer, "send", buf):
            return
        self._check_rank(peer, "send peer", not_me=True)
        x = host_array(buf, "send buf", writable=False)
        self._p2p("send", p2p.p2p_send(self.rank, self.world_size, peer), x, x)

    @asyncable
    def recv(self, buf, peer):
        """Receive into ``buf`` what ``peer`` sends."""
        if self._to_self(peer, "recv", buf):
            return buf
        self._check_rank(peer, "recv peer", not_me=True)
        x = host_array(buf, "recv buf", writable=True)
        self._p2p("recv", p2p.p2p_recv(self.rank, self.world_size, peer), x, x)
        return buf

    @asyncable
    def barrier(self, *, algo=None):
        """Return once every rank has entered the barrier. ``algo``: "dissemination" (the one there
        is, and the default: ceil(log2 n) rounds of one message each way)."""
        if algo not in (None, "dissemination"):
            raise ValueError(f"barrier has no algorithm {algo!r}; choose one of ['dissemination']")
        token = np.zeros(1, np.uint8)
        self._start("barrier", "dissemination", p2p.barrier(self.rank, self.world_size), token, token,
                    token.size, "sum", None)

    def group(self) -> Group:
        """``with comm.group(): ...``: the calls issued inside start together and all complete
        when the block exits, so any matching set of sends, receives and collectives works
        whatever its order and message sizes (ringcomm/group.py)."""
        return Group(self)

    def alloc(self, shape, dtype=np.float32) -> np.ndarray:
        """A zeroed numpy array in shared memory that this host's other ranks map: collectives on
        buffers from alloc read the peers' memory directly (one copy instead of two; algorithm
        "read"). A collective call: every rank calls it, in the same order, with the same shape
        and dtype. The array stays shared until close(); after that it is private memory of this
        process. With peers on other hosts (or one rank) it is an ordinary array."""
        if self._closed or self._broken is not None:
            self._next_seq()  # raises: the communicator is closed or unusable
        return self._make_registry().alloc(shape, dtype)

    def _make_registry(self):
        if self._registry is None:
            from .registered import Registry
            self._registry = self._executor.registered = Registry(self.rank, self.world_size, self._links,
                                                                  self.timeout)
            self._known.forget()  # registered buffers may now change a call's algorithm
        return self._registry

    def transport_to(self, peer) -> str:
        """The transport that joins this rank to ``peer`` for host buffers: "shm" on this host,
        else "ibverbs" where both ends have an RDMA device, else "tcp" (device buffers use
        "cuda_ipc" on this host)."""
        self._check_rank(peer, "peer", not_me=True)
        return self._links.transport_for(peer)

    # ---- sub-communicators (ringcomm/subcomm.py) ------------------------------------------------

    def split(self, color, key=0):
        """Collective: the ranks passing the same ``color`` (an int >= 0) form a new Communicator,
        ranked by (key, rank); ``color=None`` takes part and returns None."""
        from .subcomm import split
        return split(self, color, key)

    def shrink(self, exclude=None):
        """A new Communicator of the live ranks less ``exclude`` (which do not call it), in the old
        order; allowed on a communicator a failure broke, even after rank 0 died."""
        from .subcomm import shrink
        return shrink(self, exclude)

    # ---- lifecycle ---------------------------------------------------------------------------

    def abort(self):
        """Wake every wait of this communicator, from any thread; the call in flight raises and
        every later call is refused. Peers see this rank's links close and fail too."""
        self._links.ctx.abort.set()
        with self._lock:
            if self._broken is None:
                self._broken = "comm.abort() was called"
        # Every call runs holding the progress token (ringcomm/progress.py). Free: close the links now,
        # so the peers learn at once. Held: the running call meets the abort in its waits, or at
        # its next _execute_now, and closes them itself -- never under a running executor.
        if self._progress.token.acquire(False):
            try:
                self._close_links()
            finally:
                self._progress.token.release()
        self._progress.fail_queued("comm.abort() was called")

    def close(self):
        """Release connections, segments and (on the rank that hosts it) the store."""
        if self._closed:
            return
        if self._forked:     # all of it is the parent's, which goes on using it: let go, touch nothing
            self._closed = True
            return
        self._progress.close(self.timeout)  # queued calls finish first, within the timeout
        self._closed = True
        self._scratch.clear()
        self._links.close()
        if self._roster is not None:
            self._roster.close()
        if self._executor.balance is not None:
            self._executor.balance.close()
        if self._device is not None:
            self._device.close()
        if self._registry is not None:
            self._registry.close()
        if self.world_size > 1:
            self._leave_store()
        if self._owns_store:
            self._store.close()

    def _leave_store(self):
        # Rank 0 hosts the store: it stays up until every rank has closed, so a
        # slower rank can still look up its peers. After an error, not for long.
        hosts = self._owns_store and self.rank == 0
        try:
            self._store.arrive(f"{self._prefix}/closed", self.world_size,
                               wait=(1.0 if self._broken else min(self.timeout, 60.0)) if hosts else None)
        except (RingcommError, OSError):
            pass  # closing never raises: the job may already be going down

    @property
    def _forked(self) -> bool:
        """Whether this process is a fork's child of the one that made the communicator: its links,
        segments and store are the parent's (asked on cold paths only: close, failures)."""
        return os.getpid() != self._pid

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<ringcomm.Communicator rank {self.rank} of {self.world_size}>"

    # ---- the work ------------------------------------------------------------------------------

    def _run(self, collective, algo, x, y, m, op, root, nbytes, blocks=None):
        picked = self._pick_algo(collective, algo, nbytes, op, x.dtype)
        # RINGCOMM_ALGO=read: "read" where the buffers allow it (reproducible mode passes the forced name on)
        auto = self._forced_algo in ("", READ) and (algo is None or algo == self._forced_algo)
        n, on_host = self.world_size, isinstance(x, np.ndarray)
        if not on_host:  # device buffers: the read steps read host memory (comm.alloc, CMA)
            if picked == READ and not auto and n > 1:
                refuse(collective, picked)
            picked = "ring" if picked == READ else picked
        elif auto and self._registry is None and n > 1 and plain_read.wanted(collective, nbytes, n):
            self._make_registry()  # plain buffers may take the read steps by CMA: settle probes once
        if on_host and (self._registry is not None or picked == READ):
            # comm.alloc or a CMA candidate, or "read" asked for
            if self._registry is not None:
                self._registry.doing = (collective, self._seq + 1)  # named if settle's probe fails
            chosen, picked = picked, settle(self._registry, collective, picked, auto, x, y, nbytes)
            if picked != chosen and auto:
                model.log_override(collective, n, nbytes, chosen, picked, why_read(self._registry, x, y, picked))
        algo = picked
        sched = build_schedule(collective, algo, self.rank, self.world_size, root)
        if sched.registered and algo != READ and self.world_size > 1 and not (
                self._registry is not None and self._registry.holds(x, y)):
            refuse(collective, algo)  # an algorithm of the user's with read steps, on plain memory
        self._start(collective, algo, sched, x, y, m, op, root, blocks)
        return algo, sched

    def _run_known(self, known, collective, x, y, m, root):
        """A call repeated on the same arrays (known_calls.py): its checks hold and its schedule is
        chosen. Where an engine ran it in compiled code before, the call goes down that engine's
        lane (engine_native.Lane for the FIFOs, read_engine.ReadLane for CMA reads) straight in,
        past _start, the executor's and the engine's look-ups: 2 ranks, an 8-byte all_reduce 2.2 us
        a call instead of 2.7, an 8-byte broadcast 1.7 instead of 2.2 (ringcomm-bench, alternating
        launches); reusing the known call's Call took them to 2.0 and 1.6 (docs/06, "The small
        call"). Anything unusual (a group or RINGCOMM_DEBUG=check, a closed or broken
        communicator) takes _start's way."""
        lane = known.lane
        if not lane or self._closed or self._broken is not None or self._check or self._progress.capturing:
            self._start(collective, known.algo, known.sched, x, y, m, known.op, root, addrs=known.addrs)
            if lane is None:   # looked for once, after the first call has made its plan
                call = Call(collective, 0, x, y, m, known.op, None, None, known.addrs)
                known.lane = self._executor.lane(known.sched, call) or False
                call.inp = call.out = None   # the known call holds its arrays weakly: so must its Call
                known.call = call
            return
        # _start's numbering, repeated rather than called: passing the lane through _start measured
        # 0.05-0.2 us slower on an 8-byte call (2.36 / 2.51 us against 2.25 / 2.30). Keep the two alike.
        self._seq = seq = self._seq + 1
        self._ordinal += 1
        # The known call's own Call, renumbered (0.15 us less than a new one): calls run one at a
        # time (the progress token), and the arrays may be new views of the same memory (reshape).
        call = known.call
        call.seq, call.inp, call.out = seq, x, y
        ex = self._executor
        ex._call, ex._nsteps = call, lane.nsteps   # the watchdog's position
        # _execute_now, inlined (0.06 us of a 64 KiB broadcast's 1.1 us of Python): the lane is the
        # engine, inside the same handler, so that Ctrl-C after the loop returned mid-call (signals
        # wait for compiled code to return) breaks the communicator. Keep the two alike.
        try:
            if self._broken is not None or self._ordinal >= self._balance_at:
                self._execute_now(known.sched, call, lane)   # its refusal, or the core balance's tick first
                return
            try:
                lane.run(known.sched, call)
            except BaseException as e:
                self._failed(e, known.sched, call)
                raise
            ex._call = ex.links.call = None
        finally:
            call.inp = call.out = None

    def _start(self, collective, algo, sched, x, y, m, op, root, blocks=None, addrs=None):
        """A checked call, with its algorithm and schedule chosen: number it and run it (``addrs``:
        x's and y's addresses, where a known call has them)."""
        if self._closed or self._broken is not None:  # _next_seq, inlined
            self._refuse()
        self._seq = seq = self._seq + 1
        self._ordinal += 1
        if self._check and self.world_size > 1:  # RINGCOMM_DEBUG=check
            self._fingerprint(collective, algo, x, m if blocks is None else vcounts.PACKED, op, root, seq)
            if blocks is not None:
                self._progress.later(functools.partial(self._check_counts, blocks, seq))
        call = Call(collective, seq, x, y, m, op, None, blocks, addrs)  # a ReduceOp is its name (a str)
        # _execute, inlined: this is the path of every collective, an 8-byte one's ~2 us of Python
        if self._progress.capturing:
            self._progress.execute(sched, call)
        else:
            self._execute_now(sched, call)

    def _reproducible(self, wanted, collective, algo, x, y, op, root) -> bool:
        """Run the call in reproducible mode if ``wanted``; False (nothing done) if not."""
        if not isinstance(wanted, (bool, np.bool_)):
            raise TypeError(f"{collective}: reproducible must be True or False, got {wanted!r}")
        if not wanted:
            return False
        fmt = repro.check(collective, x.dtype, op, self.world_size)
        algo = self._pick_algo(collective, algo, x.size * fmt.NL * fmt.limb.itemsize)
        repro.check_read(self, collective, algo, x, y)   # "read": the caller's buffers, as a plain call's
        if x.size:  # passes that read each other's results: in order, where the data moves (progress.py)
            self._progress.later(functools.partial(repro.run, self, collective, algo, x, y, op, root))
        return True

    def _fingerprint(self, collective, algo, x, m, op, root, seq):
        """RINGCOMM_DEBUG=check: compare this call's fingerprint with every rank's before it runs."""
        mine = check.fingerprint(collective, x.dtype, op, algo, root, m, self._ordinal)
        self._progress.later(functools.partial(self._compare_fingerprints, collective, mine, seq))

    def _compare_fingerprints(self, collective, mine, seq):
        every = np.empty(mine.size * self.world_size, np.uint8)
        gather = build_schedule("all_gather", "ring", self.rank, self.world_size, None)
        self._execute_now(gather, Call(f"{collective} (fingerprint)", seq, mine, every, mine.size))
        check.compare(self.rank, every, self.world_size)

    def _check_counts(self, blocks, seq):
        """RINGCOMM_DEBUG=check: all-gather every rank's counts; all see whether they agree pairwise."""
        mine = vcounts.counts_row(blocks)
        every = np.empty(mine.size * self.world_size, mine.dtype)
        gather = build_schedule("all_gather", "ring", self.rank, self.world_size, None)
        self._execute_now(gather, Call("all_to_all (counts check)", seq, mine, every, mine.size))
        vcounts.compare(self.rank, every.reshape(self.world_size, mine.size))

    def _p2p(self, name, sched, x, y):
        self._execute(sched, Call(name, self._next_seq(), x, y, x.size))

    def _execute(self, sched, call):
        """Every call's data movement starts here: now, on this thread; or queued (async_op=True);
        or with its group (comm.group()). ringcomm/progress.py decides."""
        if self._progress.capturing:
            self._progress.execute(sched, call)
        else:
            self._execute_now(sched, call)

    def _execute_now(self, sched, call, engine=None):
        """Run one call (``engine``: default the host executor or the device path; a group passes
        its own), refused on a broken communicator; a failure, or any exception once bytes have
        moved, breaks it. The caller holds the progress token (every call does:
        ringcomm/progress.py), so abort() cannot close the links under it."""
        if engine is None:
            engine = self._executor if isinstance(call.inp, np.ndarray) else self._device_path(call)
        if self._broken is not None:  # abort() may have come after _next_seq, and left the links to us
            self._close_links()
            raise CommunicatorClosed(f"rank {self.rank}: the communicator is unusable: {self._broken}")
        if self._ordinal >= self._balance_at:  # keep the host's ranks spread over its cores (core_balance.py)
            self._balance_at = self._ordinal + self._executor.balance.tick()
        try:
            engine.run(sched, call)
        except BaseException as e:
            self._failed(e, sched, call)
            raise
        # Done: the executor lets go of the call and its arrays (the user may free them now; the
        # watchdog asks where a rank is only while it waits in a call)
        ex = self._executor
        ex._call = ex.links.call = None

    def _failed(self, e: BaseException, sched, call) -> None:
        """A call raised ``e`` (the caller re-raises it). A failed collective leaves peers and FIFOs
        in an unknown state: the communicator refuses later calls and closes its links, and the
        peers waiting on this rank learn it now."""
        if isinstance(e, RingcommError):
            self._break(str(e))
            if self._owns_store and self.rank == 0 and self._executor.watchdog is not None:
                # This process hosts the store: keep it up while the others report (at exit,
                # so a program that catches the error loses no time).
                atexit.register(self._executor.watchdog.linger)
            return
        # Anything else that stops a call once bytes have moved (Ctrl-C, an exception from a
        # signal handler) leaves it half done: the next call would take this one's slices in
        # the FIFOs for its own and return wrong numbers without a word. So it breaks the
        # communicator as a failure does. Argument errors raised before the executor started
        # (a device buffer on another GPU, say) leave it usable.
        moved = self._started(sched if call is None else [(sched, call)])
        if moved is not None:
            self._break(f"{moved.name} #{moved.seq} was interrupted by {type(e).__name__} after it "
                        f"had started moving data")

    def _started(self, members):
        """Which of ``members`` [(schedule, Call)] an executor has started, if any: the host
        executor and the device path's each set ``_call`` just before a call's first byte moves."""
        executors = [self._executor] + ([self._device.executor] if self._device is not None else [])
        return next((call for _, call in members for x in executors if x._call is call), None)

    def _break(self, reason: str) -> None:
        """Refuse every later call (the first reason stays), and close the links so that peers
        waiting on this rank learn it now."""
        with self._lock:
            self._broken = self._broken or reason
        self._close_links()

    def _close_links(self):
        """After a failure or abort(): close the links, and mark this rank's registered buffers as
        left, so peers waiting in a call on them (which read no link) learn it now too."""
        if self._forked:
            return
        self._links.close()
        if self._registry is not None:
            self._registry.leave()

    def _device_path(self, first=None):
        if self._device is None:
            from .device import DevicePath
            self._device = DevicePath(self._links, self._executor, first)
        return self._device

    def _next_seq(self) -> int:
        if self._closed or self._broken is not None:
            self._refuse()
        self._seq += 1
        return self._seq

    def _refuse(self):
        """Raise why no call may start: the communicator is closed, or broken."""
        if self._closed:
            raise CommunicatorClosed(f"rank {self.rank}: the communicator is closed")
        if self._forked:
            raise CommunicatorClosed(f"rank {self.rank}: {self._broken}")
        raise CommunicatorClosed(f"rank {self.rank}: the communicator is unusable after an earlier "
                                 f"error: {self._broken}")

    def _pick_algo(self, collective, algo, nbytes, op="sum", dtype=None) -> str:
        choices = ALGOS[collective]
        if algo is not None:
            if algo not in choices:
                raise ValueError(f"{collective} has no algorithm {algo!r}; choose one of {sorted(choices)}")
            return algo
        forced = self._forced_algo
        if forced:
            return forced if forced in choices else next(iter(choices))
        # float min(-0.0, +0.0) depends on the operands' order: see model.choose
        swap_safe = op not in ("min", "max") or dtype is None or dtype.kind in "iu"
        key = (collective, max(0, nbytes - 1).bit_length(), swap_safe)  # the model's power-of-two size band
        algo = self._auto.get(key)
        if algo is None:
            algo = self._auto[key] = model.choose(collective, self.world_size, nbytes, swap_safe=swap_safe)
        return algo

    def _out(self, out, x, size, name) -> np.ndarray:
        y = host_array(out, f"{name} out", writable=True)
        same_dtype(x, y, f"{name} buf and out")
        expect_size(y, size, f"{name} out")
        if overlaps(x, y) and not _aliases_ok(x, y, name, self.rank):
            raise ValueError(f"{name}: buf and out overlap without being the same memory")
        return y

    def _check_rank(self, r, what, not_me=False):
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise ValueError(f"{what} {r!r} is out of range for world_size {self.world_size}")
        if not_me and r == self.rank:
            raise ValueError(f"{what} {r} is this rank itself (inside comm.group(), a send to itself and a "
                             f"receive from itself pair up as a copy; alone, each would wait for the other)")

    def _to_self(self, peer, kind: str, buf) -> bool:
        """Inside comm.group(), a send to this rank itself or a receive from it: recorded, to pair
        up in issue order as a copy when the group runs (NCCL allows them in a group too)."""
        group = self._progress.capture() if self._progress.capturing else None
        if group is None or not isinstance(peer, (int, np.integer)) or peer != self.rank:
            return False
        x = host_array(buf, f"{kind} buf", writable=kind == "recv")
        self._next_seq()   # refused on a closed communicator, as every call
        group.to_self.append((kind, x))
        return True


def _flat(arr: np.ndarray) -> np.ndarray:
    return arr if arr.ndim == 1 else arr.reshape(-1)


def _aliases_ok(x, y, name, rank) -> bool:
    """In place is allowed where torch allows it: out is buf, or buf is out's own block (out is
    buf's own block for reduce_scatter). schedule/spec.py models exactly these forms."""
    xp, yp = address(x), address(y)
    if name == "all_gather":
        return xp == yp + rank * x.nbytes
    if name == "reduce_scatter":
        return yp == xp + rank * y.nbytes
    return xp == yp and x.size == y.size


def _after_fork_in_child() -> None:
    """In the child of an os.fork(): every communicator of the parent refuses calls, and its
    close() (a ``with`` block's end, torch's exit hook) lets go of the links, segments and store
    without touching them. Before, a plain fork's child that ended normally closed the parent's
    communicator at exit, and the job's next collective failed on every rank."""
    for comm in list(_LIVE):
        comm._broken = (f"rank {comm.rank}'s communicator was made in process {comm._pid}, and this process "
                        f"({os.getpid()}) is a fork of it: its links belong to the parent. Make a new one here")


os.register_at_fork(after_in_child=_after_fork_in_child)
