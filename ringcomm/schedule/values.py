"""Symbolic values: what a simulated chunk holds (contributions and the order they were
combined in), and what a simulation produced."""
from __future__ import annotations

from dataclasses import dataclass, field

from .faults import Failure
from .step import Step


@dataclass(frozen=True)
class Sym:
    """A symbolic chunk value: the sorted contributions, how they were combined,
    and whether the op's post-processing (AVG's division) has been applied."""

    terms: tuple[tuple[int, int], ...]
    order: object  # a leaf (rank, chunk), or a tuple of the combined operands' orders
    post: bool = False

    @staticmethod
    def leaf(rank: int, chunk: int) -> "Sym":
        return Sym(((rank, chunk),), (rank, chunk))

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for r, _ in self.terms)

    def __str__(self) -> str:
        def show(o):
            if isinstance(o[0], int):
                return f"x{o[0]}[{o[1]}]"
            return "(" + " + ".join(show(x) for x in o) + ")"
        return show(self.order) + ("/post" if self.post else "")


@dataclass
class Result:
    """What a simulation produced. Outputs are [rank][chunk]; under the OWN output layout a
    rank has one output cell, shown at index rank % nchunks."""

    outputs: list[list[Sym | None]]  # round 0
    messages: int                    # slices posted, all rounds together
    round_outputs: list[list[list[Sym | None]]] = field(default_factory=list)  # [round][rank][chunk]
    # every final step's value, once per step: (round, rank, step index, step, value)
    finals: list[tuple[int, int, int, Step, Sym]] = field(default_factory=list)
    # [round][rank]: the ranks known (directly or through others) to have entered that round
    knowledge: list[list[frozenset[int]]] = field(default_factory=list)
    # value faults met on the way (counted twice, post-op, read-after-write), in the order met
    faults: list[Failure] = field(default_factory=list)
    # (round, rank, output cell) -> index of the step that wrote it last
    writers: dict = field(default_factory=dict)
