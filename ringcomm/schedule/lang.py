"""Write an algorithm as the flow of chunks between ranks; compile it to per-rank Steps.

In the spirit of MSCCLang (msccl-tools' ``chunk(rank, buffer, index).copy(...)``), a program
follows each chunk's value as it moves:

    p = Program("all_reduce", n=3, nchunks=3)
    v = p.chunk(1, 0)                 # rank 1's input chunk 0
    v = p.chunk(2, 0).reduce(v)       # rank 1 sends it to rank 2, which adds its own chunk 0
    v = p.chunk(0, 0).reduce(v).output()   # ... then rank 0: the finished sum, kept in its output
    v.copy(1).copy(2)                 # passed on 0 -> 1 -> 2, each keeping it in its output

The values are symbolic; compile() turns every value into the step of the rank that makes it:
whether it receives (from a copy or reduce), reduces (its own input plus what arrives),
copies (``output()``), and sends (each later ``copy``/``reduce`` at another rank that uses
it). That is the step model of NCCL's primitives: a reduction starts from the rank's own
input and happens as data arrives, and every message is used by exactly one step of its
receiver. A reduction the rank kept (``output=True``) can be reduced again: the new step
carries the kept value on (``base="out"``; recursive doubling's running sum); a value only
sent, not kept, cannot (nothing holds it: write one multi-input ``reduce`` chain instead).

Each rank's steps are ordered by their depth in the dataflow (how many messages lie on the
longest path before them), then by the order the program made them: the order in which a
pipelined implementation meets them. verify() checks the result (FIFO order, deadlock,
contributions); ``stage=`` on copy/reduce groups sends into one message for the cost model.
"""
from __future__ import annotations

from .spec import SPECS, nchunks_needed
from .step import KINDS, OWN, TO, Schedule, Step

# The buffers' layouts each collective's API uses (spec.SPECS): every collective with data.
LAYOUTS = {c: sp.layouts for c, sp in SPECS.items() if c != "barrier"}
# all_to_all's chunk s * n + d is the block rank s sends rank d: n * n chunks, rank s owns s * n .. s * n + n-1


class ProgramError(ValueError):
    """The program cannot be expressed as ringcomm steps; the message says why and what to do."""


class Value:
    """A chunk's value at one rank. Make values with Program.chunk, copy and reduce."""

    def __init__(self, prog, rank, index, srcs=(), own=True):
        self.prog, self.rank, self.index = prog, rank, index
        self.own = own                    # starts from the rank's own input chunk
        self.srcs = list(srcs)            # values received (and reduced in this order)
        self.sends: list[tuple[int, int | None]] = []  # (dst rank, stage or None)
        self.users: list[Value] = []      # the values made from this one at the dst ranks
        self.out = False
        self.carries: Value | None = None  # the kept value of this rank it starts from (base="out")
        self.carried = False              # a later value carries this one on: it is not final
        self.order = prog._tick()         # when it last changed: the tie-break among equal depths

    @property
    def leaf(self) -> bool:
        return not self.srcs

    def copy(self, dst: int, *, output: bool = True, stage: int | None = None) -> "Value":
        """Send this value to ``dst``, which keeps it in its output (unless output=False)."""
        self._send(dst, stage)
        v = Value(self.prog, dst, self.index, [self], own=False)
        self.users.append(v)
        v.out = output
        return self.prog._adopt(v)

    def reduce(self, other: "Value", *, output: bool = False, stage: int | None = None) -> "Value":
        """This rank's chunk combined with ``other``, which another rank sends here.

        ``self`` is this rank's input chunk (from Program.chunk), a reduce chain still being
        built here (the result is a new handle for the same step), or a reduction this rank kept
        with ``output=True``: then the new value carries that one on (a step with base="out",
        the way recursive doubling keeps its running sum), and the kept one is no longer final."""
        if not isinstance(other, Value):
            raise TypeError(f"reduce() takes a Value, got {type(other).__name__}")
        if other.rank == self.rank:
            raise ProgramError(f"rank {self.rank} reduces a value it already holds: a reduction "
                               f"combines the rank's input with what another rank sends")
        if other.index != self.index:
            raise ProgramError(f"rank {self.rank} reduces chunk {other.index} from rank {other.rank} "
                               f"into its chunk {self.index}: a chunk travels under its own index")
        if not self.own:
            raise ProgramError(f"rank {self.rank}: a received copy cannot be reduced into; reduce "
                               f"into Program.chunk({self.rank}, {self.index}) instead")
        carry = not self.leaf and self.out
        if carry and self.carried:
            raise ProgramError(f"rank {self.rank} chunk {self.index}: this kept value is carried on "
                               f"already, and the output now holds what that made of it")
        if not self.leaf and self.sends and not self.out:
            raise ProgramError(f"rank {self.rank} chunk {self.index}: this value was sent but not kept, "
                               f"so nothing holds it to reduce further: keep it (output=True) to carry "
                               f"it on, or add all inputs to one reduce chain")
        other._send(self.rank, stage)
        if self.leaf or carry:
            v = Value(self.prog, self.rank, self.index, [other])
            other.users.append(v)
            if carry:
                v.carries, self.carried = self, True
        else:  # extend the chain: the same step receives one more input
            v = self
            v.srcs.append(other)
            other.users.append(v)
            v.order = self.prog._tick()  # ordered after its newest input
        v.out = output
        return self.prog._adopt(v)

    def output(self) -> "Value":
        """Keep this value in the rank's output chunk."""
        self.out = True
        return self

    def _send(self, dst, stage):
        if not isinstance(dst, int) or not 0 <= dst < self.prog.n:
            raise ProgramError(f"rank {dst!r} out of range for world size {self.prog.n}")
        if dst == self.rank:
            raise ProgramError(f"rank {self.rank} sends chunk {self.index} to itself")
        if any(d == dst for d, _ in self.sends):
            raise ProgramError(f"rank {self.rank} sends the same value of chunk {self.index} to "
                               f"rank {dst} twice")
        self.sends.append((dst, stage))

    def __repr__(self):
        return f"<chunk {self.index} at rank {self.rank}>"


class Program:
    """A collective algorithm for one world size, written as chunk flows."""

    def __init__(self, collective: str, n: int, nchunks: int, *, name: str = "custom"):
        if collective not in LAYOUTS:
            raise ValueError(f"Program: collective must be one of {sorted(LAYOUTS)}, got {collective!r}")
        if not isinstance(n, int) or n < 1 or not isinstance(nchunks, int) or nchunks < 1:
            raise ValueError(f"Program: need n >= 1 and nchunks >= 1, got n={n!r} nchunks={nchunks!r}")
        need = nchunks_needed(collective, n)
        if collective == "all_to_all" and nchunks != need:
            raise ValueError(f"all_to_all has a chunk per (source, destination): nchunks must be {need}")
        if need is not None and nchunks != need:
            raise ValueError(f"{collective} has one chunk per rank (block r is rank r's): nchunks must be {need}")
        self.collective, self.n, self.nchunks, self.name = collective, n, nchunks, name
        self.values: list[Value] = []
        self._count = 0

    def chunk(self, rank: int, index: int) -> Value:
        """Rank ``rank``'s input chunk ``index`` (for all_gather, a rank's only input is chunk
        ``rank``: its block)."""
        if not (isinstance(rank, int) and 0 <= rank < self.n):
            raise ProgramError(f"rank {rank!r} out of range for world size {self.n}")
        if not (isinstance(index, int) and 0 <= index < self.nchunks):
            raise ProgramError(f"chunk {index!r} out of range: the program has {self.nchunks} chunks")
        if LAYOUTS[self.collective][0] == OWN and index != rank:
            raise ProgramError(f"{self.collective}: rank {rank} owns only its block, chunk {rank}")
        if LAYOUTS[self.collective][0] == TO and index // self.n != rank:
            raise ProgramError(f"all_to_all: rank {rank} owns chunks {rank * self.n} .. {rank * self.n + self.n - 1} "
                               f"(the blocks it sends), not {index}")
        return self._adopt(Value(self, rank, index))

    def _tick(self) -> int:
        self._count += 1
        return self._count

    def _adopt(self, v: Value) -> Value:
        if v not in self.values:
            self.values.append(v)
        return v

    def compile(self) -> list[Schedule]:
        """Every rank's Schedule (index = rank)."""
        # Depth: messages on the longest path to a value. A value's inputs are older than it
        # (``order`` moves on when a chain gains an input), so one pass in order suffices.
        depth: dict[int, int] = {}
        for v in sorted(self.values, key=lambda v: v.order):
            depth[id(v)] = 1 + max(depth[id(s)] for s in v.srcs) if v.srcs else 0
            if v.carries is not None:   # after the step whose value it carries on
                depth[id(v)] = max(depth[id(v)], depth[id(v.carries)])
        per_rank: list[list[tuple]] = [[] for _ in range(self.n)]
        for v in self.values:
            step = _step_of(v)
            if step is not None:
                per_rank[v.rank].append((depth[id(v)], v.order, step, v))
        explicit = any(st is not None for v in self.values for _, st in v.sends)
        ins, outs = LAYOUTS[self.collective]
        scheds = []
        for r, items in enumerate(per_rank):
            items.sort(key=lambda t: (t[0], t[1]))
            steps = tuple(t[2] for t in items)
            stages = ()
            if explicit:
                stages = tuple(tuple(t[0] if st is None else st for _, st in t[3].sends) if t[3].sends
                               else t[0] for t in items)
            scheds.append(Schedule(self.collective, self.name, r, self.n, self.nchunks, ins, outs,
                                   steps, stages))
        return scheds

    def builder(self):
        """A builder(rank, n[, root]) for register_algorithm, for this program's world size."""
        scheds = self.compile()

        def build(rank, n, root=None):
            if n != self.n:
                raise ValueError(f"program {self.name!r} was written for {self.n} ranks, not {n}")
            return scheds[rank]
        return build


def _step_of(v: Value) -> Step | None:
    recv, reduce, copy, send = bool(v.srcs), bool(v.srcs) and v.own, v.out, bool(v.sends)
    if not recv and not copy and not send:
        return None  # an input chunk the program never used
    if reduce and not (copy or send):
        raise ProgramError(f"rank {v.rank} computes a reduction of chunk {v.index} and neither "
                           f"keeps nor sends it: add .output() or send it on")
    if recv and not reduce and len(v.srcs) > 1:
        raise ProgramError(f"rank {v.rank} receives chunk {v.index} from several ranks without reducing")
    kind = next(k for k, flags in KINDS.items() if flags == (recv, reduce, copy, send))
    return Step(kind, v.index, tuple(s.rank for s in v.srcs), tuple(d for d, _ in v.sends),
                base="out" if v.carries is not None else "in", partial=v.carried and reduce)


def program_builder(make):
    """Turn ``make(n) -> Program`` (or ``make(n, root)``) into a builder(rank, n[, root]) for
    register_algorithm; each world size (and root) is compiled once."""
    cache: dict = {}

    def build(rank, n, *root):
        key = (n,) + root
        if key not in cache:
            prog = make(n, *root)
            if not isinstance(prog, Program):
                raise TypeError(f"{getattr(make, '__name__', make)!r} must return a Program, "
                                f"got {type(prog).__name__}")
            cache[key] = prog.compile()
        return cache[key][rank]
    return build
