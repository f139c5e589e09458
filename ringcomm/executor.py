"""Runs one rank's Schedule over Connections and kernels, slice by slice.

The buffer's range of ``m`` elements is cut into rounds. Each round holds
``nchunks`` chunks of at most ``chunk_elems`` elements each (SPLIT layout) and
every step of the schedule moves its chunk of the round as slices of at most
one slot. A chunk is at most ``nslots // 2`` slots, so a step never posts more
than half a FIFO before it has to receive: the ring's "everyone sends first"
step cannot fill every FIFO at once and deadlock (NCCL sizes its chunks from
its buffer the same way; the simulator checks it for every schedule).

Where a step receives, reduces and sends, the executor reduces straight out of
the incoming slot into the outgoing one: one pass over the data, no scratch.

This is the reference engine, the one the docs teach. With ``engine="native"``
(RINGCOMM_ENGINE, the default) a call whose links are all shm runs the same plan,
cut into cache-sized slices, in compiled code (ringcomm/engine_native.py); every
other call (tcp, ibverbs, device buffers) runs here. Schedules that read peers'
registered buffers (algorithm "read", comm.alloc) use no FIFO: on either engine
they run in ringcomm/read_engine.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ringcomm.kernels import host as kernels
from ringcomm.transport.base import Aborted, PeerGone, PeerTimeout, RecvConnection

from .errors import CollectiveTimeout, PeerFailure, RingcommError
from .schedule.step import SPLIT, Schedule, chunk_span
from .watchdog import told


_NO_PLAN = (None, None)  # (owner, plan) of a plan not made yet
NATIVE_BUDGET_S = 1e-3  # the native loop returns to Python at least this often


@dataclass(slots=True)
class Call:
    """One collective call as the executor sees it."""

    name: str          # "all_reduce", ...
    seq: int           # this communicator's sequence number
    inp: np.ndarray    # 1-D
    out: np.ndarray    # 1-D, same dtype (may be inp)
    m: int             # the range count the layouts refer to
    op: str = "sum"
    dev: object = None  # device buffers: ringcomm.device.DeviceSteps does each slice's work on the GPU
    # Packed variable blocks (all_to_all's counts): ((offset, length) of each input block, the
    # same for the output), handed to chunk_span; m is then the longest block, so the rounds
    # cover every block. None: equal blocks of m.
    blocks: tuple | None = None
    # (inp's address, out's address), where the caller knows them (a known call, known_calls.py):
    # the read engine needs them, and address() costs ~1 us of Python
    addrs: tuple | None = None


class Executor:
    def __init__(self, rank: int, world_size: int, links: Callable, timeout: float,
                 slot_bytes: int, nslots: int, engine: str = "python", slice_bytes: int = 0,
                 spin_s: float = 0.0):
        self.rank, self.world_size = rank, world_size
        self.links = links  # links(peer, "send" | "recv") -> Connection; links.prepare(srcs, dsts)
        self.timeout, self.slot_bytes, self.nslots = timeout, slot_bytes, nslots
        self.watchdog = None  # ringcomm.watchdog.Watchdog, told of every failure
        # Where this rank is, for the watchdog's table: plain attributes, cheap to keep current.
        self._call, self._step, self._nsteps, self._waiting = None, 0, 0, None
        # (id(schedule), item size, count, native?) -> (schedule, plan), see _plan
        self._plans: dict = {}
        self.registered = None  # ringcomm.registered.Registry, once comm.alloc() was called
        self.balance = None     # ringcomm.core_balance.CoreBalance: the host's ranks kept spread over its cores
        self.native = self._native_off = None
        self._spin_s = spin_s
        self.slice_bytes = min(slice_bytes or slot_bytes, slot_bytes)
        if engine == "native":
            from .engine_native import NativeEngine
            self.native = NativeEngine(self, spin_s=spin_s, budget_s=NATIVE_BUDGET_S)

    @property
    def engine(self) -> str:
        """"native" or "python": the engine that runs calls over shm (tests switch it to run
        one case on both; RINGCOMM_ENGINE picks it at init)."""
        return "python" if self.native is None else "native"

    @engine.setter
    def engine(self, name: str) -> None:
        if name == self.engine:
            return
        if name == "python":
            self.native.release()
            self._native_off, self.native = self.native, None
        elif name == "native":
            if self._native_off is None:
                from .engine_native import NativeEngine
                self._native_off = NativeEngine(self, spin_s=self._spin_s, budget_s=NATIVE_BUDGET_S)
            self.native, self._native_off = self._native_off, None
        else:
            raise ValueError(f"engine must be 'native' or 'python', got {name!r}")
        # The reference engine's plans are cut by the engine setting (see _plan): made afresh.
        self._plans = {key: entry for key, entry in self._plans.items() if key[-1]}

    def has_arrived(self, peer: int) -> bool | None:
        """Whether the host link from ``peer`` holds a slice no call has taken yet; None where it
        cannot tell (no link yet, or a transport without a probe). Between calls only: the native
        engine keeps the links' counters while it runs, and hands them back here first."""
        conn = self.links.conns.get((peer, "recv"))
        if conn is None or type(conn).ready is RecvConnection.ready:
            return None
        if self.native is not None:
            self.native.release()
        return bool(conn.ready())

    def run(self, sched: Schedule, call: Call) -> None:
        if call.m == 0:
            return
        if sched.registered:  # reads peers' registered buffers, no FIFO: ringcomm/read_engine.py on
            return self.registered.run(self, sched, call)  # either engine (the native one never sees it)
        self.links.call = call  # named in connect errors
        self._call, self._nsteps = call, len(sched.steps)
        if self.native is not None and call.dev is None:
            # The native engine, if it takes the call (all links shm, a dtype whose compiled
            # arithmetic matches the host kernels): its plan is None where a link is not shm.
            owner, plan = self._plans.get((id(sched), call.inp.itemsize, call.m, call.blocks, True), _NO_PLAN)
            if owner is not sched:  # _cached_plan's look, inlined on the path of every small call
                plan = self._cached_plan(sched, call, True)
            if plan is not None and self.native.run(plan, call):
                return
            self.native.release()  # the reference engine takes over the connections' counters
        plan = self._cached_plan(sched, call, False)
        inp, out = call.inp, call.out
        if call.dev is not None:
            for entry in plan:
                self._device_slice(entry, call)
            return
        fn = kernels.elementwise(call.op, inp.dtype)
        in_place = inp is out  # the same array object: copying a chunk onto itself can be skipped
        if inp.dtype.kind != "f":
            for entry in plan:
                self._slice(entry, call, inp, out, fn, in_place)
            return
        with np.errstate(all="ignore"):  # once per call: NCCL does not trap on overflow either
            for entry in plan:
                self._slice(entry, call, inp, out, fn, in_place)

    def lane(self, sched: Schedule, call: Call):
        """The compiled lane for calls like ``call`` on this schedule (comm._run_known takes it): the
        native engine's (engine_native.Lane) or the read engine's (read_engine.ReadLane), once such
        a call ran there; None where there is none: the reference engine, a plan over links that
        are not all shm, a read schedule that Python runs, a 16-bit float loop."""
        if self.native is None or call.m == 0 or call.blocks is not None:
            return None
        if sched.registered:
            return self.registered.engine.lane(self, sched, call) if self.registered is not None else None
        plan = self._cached_plan(sched, call, True)
        return None if plan is None else self.native.lane(plan, call.inp.dtype, call.op, len(sched.steps))

    def _cached_plan(self, sched: Schedule, call: Call, native: bool):
        # Keyed by identity: hashing a schedule hashes every step. The entry keeps the schedule
        # alive and is checked, so a recycled id can never return another schedule's plan.
        key = (id(sched), call.inp.itemsize, call.m, call.blocks, native)
        owner, plan = self._plans.get(key, _NO_PLAN)
        if owner is not sched:
            plan = self._plan(sched, call, native)
            if len(self._plans) >= 64:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = (sched, plan)
        return plan

    def _plan(self, sched: Schedule, call: Call, native: bool = False):
        """Every slice of the call, in order: where it reads and writes and which connections it
        uses. Built once per (schedule, item size, count, blocks, engine), so a repeated call is one tight
        loop. With the native engine on, every call is cut in slices of slice_bytes (cache-sized, see
        README), whichever engine runs it: a rank whose links are all shm runs a call natively while its
        neighbour with a tcp link runs it in Python, and the two must cut the same slices (the settings
        every rank compares at init say the cut). With RINGCOMM_ENGINE=python a slice fills a whole slot
        (each slice costs the reference engine ~5 us of Python)."""
        srcs, dsts = sched.peers()
        self.links.prepare(srcs, dsts)
        slot_elems = (self.slice_bytes if self.native is not None else self.slot_bytes) // call.inp.itemsize
        chunk_elems = slot_elems * max(1, self.nslots // 2)
        round_elems = chunk_elems * (sched.nchunks if sched.in_layout == SPLIT else 1)
        plan = []
        ins, outs = call.blocks if call.blocks is not None else (None, None)
        for a in range(0, call.m, round_elems):
            b = min(a + round_elems, call.m)
            for i, step in enumerate(sched.steps):
                io, n = chunk_span(sched.in_layout, sched.nchunks, step.chunk, a, b, call.m, ins)
                oo, n_out = chunk_span(sched.out_layout, sched.nchunks, step.chunk, a, b, call.m, outs)
                if step.recvs:  # a packed block's length is known here from its output block
                    n = n_out   # (the same as the input's for equal blocks and other layouts)
                recvs = tuple((p, self.links(p, "recv")) for p in step.src)
                sends = tuple((p, self.links(p, "send")) for p in step.dst)
                for s in range(0, n, slot_elems):
                    k = min(slot_elems, n - s)
                    plan.append((i, step, io + s, oo + s, k, k * call.inp.itemsize, recvs, sends, len(plan)))
        return self.native.plan(plan) if native else plan

    def _slice(self, entry, call: Call, inp, out, fn, in_place) -> None:
        self._step, step, io, oo, k, nbytes, recvs, sends, nslice = entry
        dtype = inp.dtype
        srcs = [self._wait(p, c, call, nbytes, nslice).view(dtype) for p, c in recvs]
        dsts = [self._acquire(p, c, call, nslice)[:nbytes].view(dtype) for p, c in sends]
        x_in = out[oo:oo + k] if step.base == "out" else inp[io:io + k]
        if not step.recvs:
            value = x_in
        elif not step.reduces:
            value = srcs[0]
        else:
            # Reduce into the first place the value must land: the output, else the first
            # outgoing slot (the fused recv-reduce-send), so nothing is copied twice.
            value = out[oo:oo + k] if step.copies else dsts[0]
            fn(x_in, srcs[0], out=value)
            for extra in srcs[1:]:
                fn(value, extra, out=value)
            if step.final:
                kernels.postprocess(value, call.op, self.world_size)
        if step.copies and not (step.reduces or (value is x_in and in_place and io == oo)):
            out[oo:oo + k] = value
        for d in dsts:
            if d is not value:
                d[...] = value
        for _, c in recvs:
            c.release()
        self._post(sends, call, nbytes, nslice)

    def _device_slice(self, entry, call: Call) -> None:
        self._step, step, io, oo, k, nbytes, recvs, sends, nslice = entry
        dtype = call.inp.dtype
        for p, c in recvs:
            self._wait(p, c, call, nbytes, nslice)
        for p, c in sends:
            self._acquire(p, c, call, nslice)
        # The connections keep a typed view per (slot, dtype): one cheap slice each, no view per slice.
        srcs = [c.typed(dtype, k) for _, c in recvs]
        dsts = [c.typed(dtype, k) for _, c in sends]
        call.dev.apply(step, call, io, oo, k, srcs, dsts, self.world_size)
        for _, c in recvs:
            c.release()
        self._post(sends, call, nbytes, nslice)

    def _post(self, sends, call, nbytes, nslice) -> None:
        # A tcp sender thread that lost its peer reports it at the next post(): explained like
        # any wait's failure (try costs nothing in 3.11 until something raises).
        try:
            for _, c in sends:
                c.post(nbytes)
        except (PeerTimeout, PeerGone, Aborted) as e:
            raise self._explain(e, f"sending slice {nslice} of {call.name} #{call.seq} to") from None

    def _wait(self, peer, conn, call, nbytes, nslice) -> np.ndarray:
        t0 = time.monotonic()
        self._waiting = (peer, "recv", nslice, t0)
        try:
            data = conn.wait(t0 + self.timeout)
        except (PeerTimeout, PeerGone, Aborted) as e:
            raise self._explain(e, f"waiting for slice {nslice} of {call.name} #{call.seq} from") from None
        if data.size != nbytes:
            raise RingcommError(
                f"rank {self.rank} (this process) expected {nbytes} bytes for slice {nslice} of "
                f"{call.name} #{call.seq} from rank {peer} but got {data.size}: the ranks called "
                f"different collectives or passed different sizes")
        return data

    def _acquire(self, peer, conn, call, nslice) -> np.ndarray:
        t0 = time.monotonic()
        self._waiting = (peer, "send", nslice, t0)
        try:
            return conn.acquire(t0 + self.timeout)
        except (PeerTimeout, PeerGone, Aborted) as e:
            raise self._explain(e, f"waiting to send slice {nslice} of {call.name} #{call.seq} to") from None

    def _explain(self, e, doing: str) -> RingcommError:
        me = f"rank {self.rank} (this process)"
        if isinstance(e, PeerTimeout):
            kind, state = CollectiveTimeout, "timed out"
            msg = f"{me} timed out after {self.timeout:g} s {doing} rank {e.peer} over {e.transport}"
            if getattr(e, "detail", ""):  # what else this rank waited on (the device proxy's GPU work)
                msg += f"; {e.detail}"
        elif isinstance(e, Aborted):
            kind, state = RingcommError, "aborted"
            msg = f"{me} was aborted {doing} rank {e.peer} over {e.transport}"
        else:
            kind, state = PeerFailure, "failed"
            msg = f"{me} failed {doing} rank {e.peer} over {e.transport}: {e}"
        return told(self.watchdog, kind, state, msg, e.peer)

    def position(self) -> dict:
        """Where this rank is now (for the watchdog)."""
        call = self._call
        if call is None:
            return {}
        where = {"collective": call.name, "seq": call.seq, "step": self._step, "nsteps": self._nsteps}
        if self._waiting is not None:
            peer, direction, nslice, t0 = self._waiting
            where.update(peer=peer, direction=direction, slice=nslice, **{"for": time.monotonic() - t0})
        return where
