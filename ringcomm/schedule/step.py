"""Steps and schedules: collective algorithms as plain data.

A Step is what one rank does with one chunk, modelled on the flags of NCCL's
``genericOp`` (prims_simple.h). Its value is computed in this order:

    value = base[chunk]                       if it receives nothing
    value = received                          if it receives without reducing
    value = base[chunk] op recv_1 op recv_2   if it receives and reduces
    output[chunk] = value                     if it copies
    every peer in ``dst`` gets value          if it sends

``base`` is the rank's input, or (``base="out"``) its output chunk as an earlier
step of this rank left it: a partial result kept there and carried on, the way
the textbook's recursive doubling keeps its running sum (S = S op partner's S,
each stage) without a scratch buffer of its own.

A step that both reduces and copies produces the chunk's final value, so the
executor applies the op's post-processing there (AVG's division), before the
value is sent on, as NCCL's postOp does; unless it is marked ``partial``: the
value it keeps is carried on by a later ``base="out"`` step, which finishes it.

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


# Steps on registered buffers (comm.alloc: memory the host's other ranks map), which read a
# peer's buffer in place of a FIFO. ``remote`` names the peers read, in the order they are
# combined; no src or dst. kind: (the peers' buffer read, reduce, copy)
#   read_copy          output[chunk] = the peer's input chunk
#   read_reduce_copy   output[chunk] = input[chunk] op peer_1's input chunk op peer_2's ...  (final)
#   read_out_copy      output[chunk] = the peer's output chunk, which it wrote before the last sync
#   sync               wait until every peer in ``remote`` has reached this sync too (a barrier)
# A peer's buffers may be read only while it is inside the call: a schedule with reads ends with
# a sync on every rank, and what a read takes from a peer's output was written in an earlier
# phase (between earlier syncs). The simulator checks both (schedule/peer_read.py).
READS = {
    "read_copy": ("in", False, True),
    "read_reduce_copy": ("in", True, True),
    "read_out_copy": ("out", False, True),
    "sync": (None, False, False),
}
# The write twin: the step's own input chunk lands straight in each peer's output chunk (the
# peer's registered buffer, or a plain one by process_vm_writev), so a second core can fill part
# of a buffer its owner is filling too (a 2-rank broadcast: the root writes one half while the
# receiver reads the other).
#   write_copy         every peer in ``remote`` gets output[chunk] = this rank's input chunk
#   write_out_copy     every peer in ``remote`` gets output[chunk] = this rank's output chunk, as an
#                      earlier step of this rank wrote it (all_reduce: each rank's reduced chunk
#                      goes straight to its peers, while it is still in this core's cache)
# The same rules hold, and one more: nothing may touch that output chunk (its owner, or another
# rank reading or writing it) unless a chain of syncs orders it before or after the write.
# The buffer a write step takes its bytes from: this rank's input or its output.
WRITES = {"write_copy": "in", "write_out_copy": "out"}


@dataclass(frozen=True)
class Step:
    kind: str
    chunk: int
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    remote: tuple[int, ...] = ()  # the peers a READS step reads (or syncs with)
    base: str = "in"              # where the value starts: "in" (the input) or "out" (see above)
    partial: bool = False         # a reducing copy that is not the final value (no post-op)

    def __post_init__(self):
        if self.kind in READS or self.kind in WRITES:
            if self.base != "in" or self.partial:
                raise ValueError(f"{self.kind} reads and writes registered buffers: base= and "
                                 f"partial= are for FIFO steps")
            self._init_read()
            return
        if self.kind not in KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}")
        self._check_base()
        if self.remote:
            raise ValueError(f"{self.kind} moves data through FIFOs: remote= is for "
                             f"{sorted(READS) + sorted(WRITES)}")
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
                            ("sends", sends), ("final", reduces and copies and not self.partial),
                            ("reads", None), ("writes", False)):
            object.__setattr__(self, name, value)

    def _check_base(self) -> None:
        _, reduces, copies, _ = KINDS[self.kind]
        if self.base not in ("in", "out"):
            raise ValueError(f"base must be 'in' or 'out', got {self.base!r}")
        if self.base == "out" and not (reduces or self.kind == "send"):
            raise ValueError(f"{self.kind} with base='out': only a step that sends or reduces its base "
                             f"value reads it (send, recv_reduce_*)")
        if self.partial and not (reduces and copies):
            raise ValueError(f"{self.kind} is partial=True, but only a step that reduces and copies "
                             f"keeps a value that could be final")

    def _init_read(self) -> None:
        buffer, reduces, copies = READS.get(self.kind, (None, False, False))
        if self.src or self.dst or not self.remote:
            raise ValueError(f"{self.kind} needs remote=peers and no src or dst, got src={self.src} "
                             f"dst={self.dst} remote={self.remote}")
        if len(self.remote) > 1 and buffer is not None and not reduces:
            raise ValueError(f"{self.kind} reads {len(self.remote)} peers but does not reduce: "
                             f"which value would it keep?")
        for name, value in (("recvs", False), ("reduces", reduces), ("copies", copies), ("sends", False),
                            ("final", reduces and copies), ("reads", buffer),
                            ("writes", self.kind in WRITES)):
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        s = f"{self.kind}({self.chunk}"
        if self.src:
            s += f", from={list(self.src)}"
        if self.dst:
            s += f", to={list(self.dst)}"
        if self.remote:
            verb = "with" if self.kind == "sync" else "writes" if self.kind in WRITES else "reads"
            s += f", {verb}={list(self.remote)}"
        if self.base != "in":
            s += f", base={self.base}"
        if self.partial:
            s += ", partial"
        return s + ")"


def _peers(p) -> tuple[int, ...]:
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def send(c, to, *, base="in"):
    return Step("send", c, (), _peers(to), base=base)


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


def recv_reduce_send(c, frm, to, *, base="in"):
    return Step("recv_reduce_send", c, _peers(frm), _peers(to), base=base)


def recv_reduce_copy(c, frm, *, base="in", partial=False):
    return Step("recv_reduce_copy", c, _peers(frm), base=base, partial=partial)


def recv_reduce_copy_send(c, frm, to, *, base="in", partial=False):
    return Step("recv_reduce_copy_send", c, _peers(frm), _peers(to), base=base, partial=partial)


def read_copy(c, frm):
    return Step("read_copy", c, remote=_peers(frm))


def read_reduce_copy(c, frm):
    return Step("read_reduce_copy", c, remote=_peers(frm))


def read_out_copy(c, frm):
    return Step("read_out_copy", c, remote=_peers(frm))


def write_copy(c, to):
    return Step("write_copy", c, remote=_peers(to))


def write_out_copy(c, to):
    return Step("write_out_copy", c, remote=_peers(to))


def sync(peers):
    return Step("sync", 0, remote=_peers(peers))


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
    # Whether it reads peers' registered buffers (comm.alloc) rather than using FIFOs: derived from
    # the steps in __post_init__ (a value given is ignored), so the executor's per-call question
    # costs an attribute read. A field, so that Schedule(**{**s.__dict__, "steps": ...}) works.
    registered: bool = field(default=False, compare=False, repr=False)

    def peers(self) -> tuple[set[int], set[int]]:
        """(ranks this schedule receives from, ranks it sends to)."""
        srcs = {p for s in self.steps for p in s.src}
        dsts = {p for s in self.steps for p in s.dst}
        return srcs, dsts

    def __post_init__(self):
        object.__setattr__(self, "registered", any(s.remote for s in self.steps))

    def __str__(self) -> str:
        head = (f"{self.collective}/{self.algo} rank {self.rank} of {self.world_size}: "
                f"{self.nchunks} chunks, in={self.in_layout} out={self.out_layout}")
        return "\n".join([head] + [f"  {i:3d}  {s}" for i, s in enumerate(self.steps)])
