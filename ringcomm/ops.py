"""Reduction operators. Each is also its plain string ("sum", ...), which is what kernels take."""
from __future__ import annotations

from enum import Enum


class ReduceOp(str, Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self) -> str:
        return self.value


SUM, PROD, MIN, MAX, AVG = ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG


def as_op(op) -> ReduceOp:
    """Accept a ReduceOp or its name in any case; anything else is a clear error."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    names = ", ".join(o.value for o in ReduceOp)
    raise ValueError(f"unknown reduction op {op!r}: use one of ringcomm.SUM, PROD, MIN, MAX, AVG ({names})")
