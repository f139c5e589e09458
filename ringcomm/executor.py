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
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ringcomm.kernels import host as kernels
from ringcomm.transport.base import Aborted, PeerGone, PeerTimeout

from .errors import CollectiveTimeout, PeerFailure, RingcommError
from .schedule.step import BLOCK, OWN, SPLIT, Schedule


@dataclass
class Call:
    """One collective call as the executor sees it."""

    name: str          # "all_reduce", ...
    seq: int           # this communicator's sequence number
    inp: np.ndarray    # 1-D
    out: np.ndarray    # 1-D, same dtype (may be inp)
    m: int             # the range count the layouts refer to
    op: str = "sum"
    dev: object = None  # device buffers: ringcomm.device.DeviceSteps does each slice's work on the GPU


def chunk_span(layout: str, nchunks: int, c: int, a: int, b: int, m: int) -> tuple[int, int]:
    """(offset, length) of chunk c of the round [a, b) in a buffer of this layout."""
    if layout == SPLIT:
        # Even split, the first (b - a) % nchunks chunks one element longer.
        base, extra = divmod(b - a, nchunks)
        return a + c * base + min(c, extra), base + (c < extra)
    if layout == BLOCK:
        return c * m + a, b - a
    if layout == OWN:
        return a, b - a
    raise ValueError(f"unknown layout {layout!r}")


class Executor:
    def __init__(self, rank: int, world_size: int, links: Callable, timeout: float,
                 slot_bytes: int, nslots: int):
        self.rank, self.world_size = rank, world_size
        self.links = links  # links(peer, "send" | "recv") -> Connection; links.prepare(srcs, dsts)
        self.timeout, self.slot_bytes, self.nslots = timeout, slot_bytes, nslots
        self.watchdog = None  # ringcomm.watchdog.Watchdog, told of every failure
        # Where this rank is, for the watchdog's table: plain attributes, cheap to keep current.
        self._call, self._step, self._nsteps, self._waiting = None, 0, 0, None

    def run(self, sched: Schedule, call: Call) -> None:
        if call.m == 0:
            return
        srcs, dsts = sched.peers()
        self.links.purpose = f", for {call.name} #{call.seq}"
        self.links.prepare(srcs, dsts)
        slot_elems = self.slot_bytes // call.inp.itemsize
        chunk_elems = slot_elems * max(1, self.nslots // 2)
        round_elems = chunk_elems * (sched.nchunks if sched.in_layout == SPLIT else 1)
        nslice = 0
        self._call, self._nsteps = call, len(sched.steps)
        for a in range(0, call.m, round_elems):
            b = min(a + round_elems, call.m)
            for self._step, step in enumerate(sched.steps):
                io, n = chunk_span(sched.in_layout, sched.nchunks, step.chunk, a, b, call.m)
                oo, _ = chunk_span(sched.out_layout, sched.nchunks, step.chunk, a, b, call.m)
                for s in range(0, n, slot_elems):
                    k = min(slot_elems, n - s)
                    self._slice(step, call, io + s, oo + s, k, nslice)
                    nslice += 1

    def _slice(self, step, call: Call, io: int, oo: int, k: int, nslice: int) -> None:
        srcs = [self._wait(p, call, k, nslice) for p in step.src]
        dsts = [self._acquire(p, call, k, nslice) for p in step.dst]
        x_in = call.inp[io:io + k]
        x_out = call.out[oo:oo + k]
        if call.dev is None:
            value = _compute(step, call, x_in, x_out, srcs, dsts, self.world_size)
            if step.copies and not _same(value, x_out):
                x_out[...] = value
            for d in dsts:
                if not _same(value, d):
                    d[...] = value
        else:
            call.dev.apply(step, call, x_in, x_out, srcs, dsts, self.world_size)
        for p in step.src:
            self.links(p, "recv").release()
        for p in step.dst:
            self.links(p, "send").post(k * call.inp.itemsize)

    def _wait(self, peer, call, k, nslice) -> np.ndarray:
        t0 = time.monotonic()
        self._waiting = (peer, "recv", nslice, t0)
        try:
            data = self.links(peer, "recv").wait(t0 + self.timeout)
        except (PeerTimeout, PeerGone, Aborted) as e:
            raise self._explain(e, f"waiting for slice {nslice} of {call.name} #{call.seq} from") from None
        if data.size != k * call.inp.itemsize:
            raise RingcommError(
                f"rank {self.rank} (this process) expected {k * call.inp.itemsize} bytes for slice "
                f"{nslice} of {call.name} #{call.seq} from rank {peer} but got {data.size}: the ranks "
                f"called different collectives or passed different sizes")
        return data.view(call.inp.dtype)

    def _acquire(self, peer, call, k, nslice) -> np.ndarray:
        t0 = time.monotonic()
        self._waiting = (peer, "send", nslice, t0)
        try:
            slot = self.links(peer, "send").acquire(t0 + self.timeout)
        except (PeerTimeout, PeerGone, Aborted) as e:
            raise self._explain(e, f"waiting to send slice {nslice} of {call.name} #{call.seq} to") from None
        return slot[: k * call.inp.itemsize].view(call.inp.dtype)

    def _explain(self, e, doing: str) -> RingcommError:
        me = f"rank {self.rank} (this process)"
        if isinstance(e, PeerTimeout):
            kind, state = CollectiveTimeout, "timed out"
            msg = f"{me} timed out after {self.timeout:g} s {doing} rank {e.peer} over {e.transport}"
        elif isinstance(e, Aborted):
            kind, state = RingcommError, "aborted"
            msg = f"{me} was aborted {doing} rank {e.peer} over {e.transport}"
        else:
            kind, state = PeerFailure, "failed"
            msg = f"{me} failed {doing} rank {e.peer} over {e.transport}: {e}"
        table = self.watchdog.on_failure(state, msg) if self.watchdog is not None else ""
        return kind(f"{msg}\nwhere every rank was:\n{table}" if table else msg)

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


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    return x.__array_interface__["data"][0] == y.__array_interface__["data"][0]


def _compute(step, call: Call, x_in, x_out, srcs, dsts, world_size) -> np.ndarray:
    """The step's value for one slice, written where it is needed first."""
    if not step.recvs:
        return x_in
    if not step.reduces:
        return srcs[0]
    # Reduce into the first place the value must land: the output, else the
    # first outgoing slot (the fused recv-reduce-send), so nothing is copied twice.
    target = x_out if step.copies else dsts[0]
    kernels.reduce_copy(target, x_in, srcs[0], call.op)
    for extra in srcs[1:]:
        kernels.reduce(target, extra, call.op)
    if step.final:
        kernels.postprocess(target, call.op, world_size)
    return target
