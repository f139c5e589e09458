"""RINGCOMM_DEBUG=check: before any data moves, every rank agrees on what is being called.

Each collective first all-gathers a fixed-size fingerprint (collective, count,
dtype, op, root, algorithm, and how many collectives this rank has called) over
the same links the data uses, so the check costs one tiny all-gather. If the
fingerprints differ, every rank raises the same CollectiveMismatch naming the
ranks that differ and how: a mismatch is reported, never run (a mismatched
collective otherwise hangs, or worse, silently reduces the wrong bytes).
Point-to-point calls involve two ranks only and are not fingerprinted.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from .errors import RingcommError

FINGERPRINT = struct.Struct("<16s16s8s16sqqq")  # collective, dtype, op, algo, root, count, ordinal


class CollectiveMismatch(RingcommError, ValueError):
    """The ranks called different collectives, or the same one with different arguments."""


def enabled() -> bool:
    return "check" in os.environ.get("RINGCOMM_DEBUG", "").lower().split(",")


def fingerprint(collective, dtype, op, algo, root, count, ordinal) -> np.ndarray:
    raw = FINGERPRINT.pack(collective.encode(), str(dtype).encode(), str(op).encode(), algo.encode(),
                           -1 if root is None else root, count, ordinal)
    return np.frombuffer(bytearray(raw), dtype=np.uint8)


def describe(raw: bytes) -> str:
    coll, dtype, op, algo, root, count, ordinal = FINGERPRINT.unpack(raw)
    text = lambda b: b.rstrip(b"\0").decode(errors="replace")  # noqa: E731
    args = [f"count={count}" if count >= 0 else "send_counts/recv_counts", f"dtype={text(dtype)}"]
    if text(coll) in ("all_reduce", "reduce_scatter", "reduce"):
        args.append(f"op={text(op)}")
    if root >= 0:
        args.append(f"root={root}")
    args.append(f"algo={text(algo)}")
    return f"collective #{ordinal}: {text(coll)}({', '.join(args)})"


def compare(rank: int, gathered: np.ndarray, world_size: int) -> None:
    """Raise CollectiveMismatch (the same text on every rank) unless all fingerprints agree."""
    size = FINGERPRINT.size
    prints = [gathered[r * size:(r + 1) * size].tobytes() for r in range(world_size)]
    if len(set(prints)) == 1:
        return
    groups: dict[bytes, list[int]] = {}
    for r, fp in enumerate(prints):
        groups.setdefault(fp, []).append(r)
    parts = [f"{_ranks(rs)} called {describe(fp)}" for fp, rs in sorted(groups.items(), key=lambda g: g[1])]
    raise CollectiveMismatch(f"rank {rank} (this process): the ranks disagree (RINGCOMM_DEBUG=check): "
                             + "; ".join(parts))


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
