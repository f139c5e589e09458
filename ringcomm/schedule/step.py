"""Steps and schedules: collective algorithms as plain data.

A Step is what one rank does with one chunk, modelled on the flags of NCCL's
``genericOp`` (prims_simple.h). Its value is computed in this order:

    value = input[chunk]                      if it receives nothing
    value = received                          if it receives without reducing
    value = input[chunk] op recv_1 op recv_2  if it receives and reduces
    output[chunk] = value                     if it copies
    every peer in ``dst`` gets value          if it sends

A step that both reduces and copies produces the chunk's final value, so the
executor applies the op's post-processing there (AVG's division), before the
value is sent on, as NCCL's postOp does.

A Schedule is one rank's list of steps plus the chunk layout. It is executed
once per *round*: the buffer is cut into rounds and each round into
``nchunks`` chunks, so every step moves at most one chunk's worth of slices
and FIFOs of a few slots never deadlock (NCCL's loop over ``loopSize``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import isqrt

# Layouts map (chunk, round range [a, b)) to a range of a buffer of the
# collective's "range count" m:
#   SPLIT: the buffer has m elements; chunk c is the c-th of nchunks even parts of [a, b)
#   BLOCK: the buffer has nchunks * m elements; chunk c is c * m + [a, b)
#   OWN:   the buffer has m elements; every chunk is [a, b) (only this rank's chunk is used)
# all_to_all names the block going from rank s to rank d chunk s * n + d (n * n chunks), so
# both ends of a message agree on its index; the buffers have n blocks of m elements:
#   TO:    chunk s * n + d is block d (the sender's input: one block per destination)
#   FROM:  chunk s * n + d is block s (the receiver's output: one block per source)
# With packed variable blocks (all_to_all's counts) a call passes ``blocks``: (offset, length)
# of each of the n blocks; a round [a, b) then covers [a, b) of every block, clipped to its
# length, so a block shorter than a is empty in that round (both of its ends see the same).
SPLIT, BLOCK, OWN, TO, FROM = "split", "block", "own", "to", "from"


def chunk_span(layout: str, nchunks: int, c: int, a: int, b: int, m: int,
               blocks: tuple | None = None) -> tuple[int, int]:
    """(offset, length) of chunk c of the round [a, b) in a buffer of this layout: the cut the
    executor makes and the verifier replays."""
    if layout == SPLIT:
        # Even split, the first (b - a) % nchunks chunks one element longer.
        base, extra = divmod(b - a, nchunks)
        return a + c * base + min(c, extra), base + (c < extra)
    if layout == BLOCK:
        return c * m + a, b - a
    if layout == OWN:
        return a, b - a
    if layout in (TO, FROM):
        n = isqrt(nchunks)
        j = c % n if layout == TO else c // n
        if blocks is None:
            return j * m + a, b - a
        off, length = blocks[j]
        return off + min(a, length), max(0, min(b, length) - a)
    raise ValueError(f"unknown layout {layout!r}")


KINDS = {
    # kind: (recv, reduce, copy, send)
    "send": (False, False, False, True),
    "copy_send": (False, False, True, True),
    "copy": (False, False, True, False),
    "recv": (True, False, True, False),
    "recv_send": (True, False, False, True),
    "recv_copy_send": (True, False, True, True),
    "recv_reduce_send": (True, True, False, True),
    "recv_reduce_copy": (True, True, True, False),
    "recv_reduce_copy_send": (True, True, True, True),
}


@dataclass(frozen=True)
class Step:
    kind: str
    chunk: int
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}")
        recv, _, _, send = KINDS[self.kind]
        if recv != bool(self.src) or send != bool(self.dst):
            raise ValueError(f"{self.kind} needs src={'peers' if recv else '()'} "
                             f"and dst={'peers' if send else '()'}, got {self.src} {self.dst}")
        if len(self.src) > 1 and not KINDS[self.kind][1]:
            raise ValueError(f"{self.kind} receives from {len(self.src)} peers but does not reduce: "
                             f"which value would it keep?")
        # The flags as plain attributes (the executor reads them for every slice). ``final``: the
        # step yields the chunk's finished reduction, where AVG's division is applied.
        recvs, reduces, copies, sends = KINDS[self.kind]
        for name, value in (("recvs", recvs), ("reduces", reduces), ("copies", copies),
                            ("sends", sends), ("final", reduces and copies)):
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        s = f"{self.kind}({self.chunk}"
        if self.src:
            s += f", from={list(self.src)}"
        if self.dst:
            s += f", to={list(self.dst)}"
        return s + ")"


def _peers(p) -> tuple[int, ...]:
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def send(c, to):
    return Step("send", c, (), _peers(to))


def copy_send(c, to):
    return Step("copy_send", c, (), _peers(to))


def copy(c):
    return Step("copy", c)


def recv(c, frm):
    return Step("recv", c, _peers(frm))


def recv_send(c, frm, to):
    return Step("recv_send", c, _peers(frm), _peers(to))


def recv_copy_send(c, frm, to):
    return Step("recv_copy_send", c, _peers(frm), _peers(to))


def recv_reduce_send(c, frm, to):
    return Step("recv_reduce_send", c, _peers(frm), _peers(to))


def recv_reduce_copy(c, frm):
    return Step("recv_reduce_copy", c, _peers(frm))


def recv_reduce_copy_send(c, frm, to):
    return Step("recv_reduce_copy_send", c, _peers(frm), _peers(to))


@dataclass(frozen=True)
class Schedule:
    """One rank's part of a collective algorithm."""

    collective: str
    algo: str
    rank: int
    world_size: int
    nchunks: int
    in_layout: str
    out_layout: str
    steps: tuple[Step, ...] = field(default_factory=tuple)
    # Optional, for the cost model only (the executor ignores it): one entry per step, the
    # stage of its sends, an int or one int per dst. Sends of one rank to one peer in one stage
    # count as one message (one alpha), as MPI would send them; empty means "the step's depth
    # in the dataflow" (schedule/cost.py).
    stages: tuple = ()

    def peers(self) -> tuple[set[int], set[int]]:
        """(ranks this schedule receives from, ranks it sends to)."""
        srcs = {p for s in self.steps for p in s.src}
        dsts = {p for s in self.steps for p in s.dst}
        return srcs, dsts

    def __str__(self) -> str:
        head = (f"{self.collective}/{self.algo} rank {self.rank} of {self.world_size}: "
                f"{self.nchunks} chunks, in={self.in_layout} out={self.out_layout}")
        return "\n".join([head] + [f"  {i:3d}  {s}" for i, s in enumerate(self.steps)])
