"""The peers' registered allocations as this process maps them: the table that compiled code
reads a peer's registered buffer through (read_native's rows, fetch_reduce's operands).

A rank that passes a registered buffer publishes (allocation k, byte offset) in its descriptor
(ctl_layout.DESC), not an address: each process maps a peer's segment where its own mmap put it.
The table turns that pair into an address here. Word 0 counts the allocations entered, then
(base address, bytes) for (peer p, allocation k) at 1 + 2 * (p * MAP_CAP + k); Registry.alloc
enters each allocation once every peer's segment is mapped, and close() empties it. A call on an
allocation past MAP_CAP goes by Python's steps (its views).
"""
from __future__ import annotations

import numpy as np

MAP_CAP = 64


def table(n: int) -> np.ndarray:
    """An empty table for ``n`` ranks."""
    return np.zeros(1 + 2 * n * MAP_CAP, np.int64)


def enter(maps: np.ndarray, k: int, bases: dict) -> None:
    """Enter allocation k, mapped here at ``bases`` {peer: (address, bytes)}, then count it (a
    compiled call reads the count first)."""
    if k >= MAP_CAP:
        return
    for p, (base, size) in bases.items():
        maps[1 + 2 * (p * MAP_CAP + k):3 + 2 * (p * MAP_CAP + k)] = base, size
    maps[0] = max(int(maps[0]), k + 1)


def mapped(maps, q, k, where, nbytes):
    """Where peer q's allocation k, from byte ``where`` on, is mapped here, if it holds ``nbytes``
    from there; else 0. (Plain Python that each compiled module compiles with its own code.)"""
    if k < 0 or k >= min(maps[0], MAP_CAP) or where < 0:
        return 0
    at = 1 + 2 * (q * MAP_CAP + k)
    if where + nbytes > maps[at + 1]:
        return 0
    return maps[at] + where
