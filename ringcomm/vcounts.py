"""The arguments of the collectives that move blocks between ranks: all_to_all (equal blocks or
packed counts), gather and scatter. Everything here runs before any byte moves, so bad input is
a TypeError or ValueError on the calling rank, like the rest of the API.

Packed counts are MPI_Alltoallv's with packed displacements (torch's all_to_all_single split
sizes): block j of ``buf`` is send_counts[j] elements going to rank j, block i of ``out`` is
recv_counts[i] elements from rank i, each block right after the previous one. A call hands the
executor a block table, ((offset, length) of each input block, ... of each output block), that
the TO / FROM layouts read (schedule/step.py). The counts must agree pairwise: rank i's
send_counts[j] is rank j's recv_counts[i]. Only the two ends of a block know its length, so only
a schedule that sends every block straight to its destination (alltoall.is_direct) can run
packed counts: pairwise can, Bruck cannot from 4 ranks up (its blocks cross intermediate ranks). With
RINGCOMM_DEBUG=check every rank all-gathers the counts and all raise the same
CollectiveMismatch if any pair disagrees; without it a disagreement fails on the receiving rank
(a slice of the wrong size) or times out.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import accumulate

import numpy as np

from .buffers import address, expect_size, host_array, overlaps, same_dtype
from .catalogue import ALGOS, build_schedule
from .check import CollectiveMismatch
from .schedule.alltoall import is_direct

PACKED = -1  # the fingerprint's count for packed counts: each rank's longest block differs


def counts_tuple(counts, n: int, what: str) -> tuple[int, ...]:
    """``counts`` (a list, tuple or 1-D integer array of n ints >= 0) as a tuple of ints. An array
    is numpy's or anything numpy reads without a copy from a device (a CPU torch tensor)."""
    if not isinstance(counts, (list, tuple, np.ndarray)) and hasattr(counts, "__array__"):
        try:
            counts = np.asarray(counts)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{what} must be a list, tuple or host integer array: {e}") from None
    if isinstance(counts, np.ndarray):
        if counts.dtype.kind not in "iu" or counts.ndim != 1:
            raise TypeError(f"{what} must be a 1-D integer array, got {counts.dtype} with shape {counts.shape}")
        counts = counts.tolist()
    elif not isinstance(counts, (list, tuple)):
        raise TypeError(f"{what} must be a list, tuple or integer array of world_size ints, "
                        f"got {type(counts).__name__}")
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, (int, np.integer))]
    if bad:
        raise TypeError(f"{what} must hold ints, got {bad[0]!r} ({type(bad[0]).__name__})")
    if len(counts) != n:
        raise ValueError(f"{what} has {len(counts)} entries, expected world_size = {n}")
    if any(c < 0 for c in counts):
        raise ValueError(f"{what} must be >= 0, got {list(counts)}")
    return tuple(int(c) for c in counts)


def spans(counts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(offset, length) of each packed block."""
    starts = accumulate(counts[:-1], initial=0)
    return tuple(zip(starts, counts))


def all_to_all_args(buf, out, send_counts, recv_counts, rank: int, n: int):
    """(x, y, m, blocks) for the executor: m is the block length (equal blocks) or the longest
    block (packed counts, with ``blocks`` their table; else None)."""
    x = host_array(buf, "all_to_all buf", writable=False)
    y = host_array(out, "all_to_all out", writable=True)
    same_dtype(x, y, "all_to_all buf and out")
    if (send_counts is None) != (recv_counts is None):
        raise ValueError("all_to_all: send_counts and recv_counts come together: pass both or neither")
    if overlaps(x, y):
        raise ValueError("all_to_all: buf and out overlap; all_to_all is never in place")
    if send_counts is None:
        if x.size % n:
            raise ValueError(f"all_to_all buf has {x.size} elements, not world_size ({n}) equal blocks; "
                             f"pass send_counts and recv_counts for blocks of different sizes")
        expect_size(y, x.size, "all_to_all out (the size of buf)")
        return x, y, x.size // n, None
    sc = counts_tuple(send_counts, n, "all_to_all send_counts")
    rc = counts_tuple(recv_counts, n, "all_to_all recv_counts")
    expect_size(x, sum(sc), "all_to_all buf (sum(send_counts))")
    expect_size(y, sum(rc), "all_to_all out (sum(recv_counts))")
    if sc[rank] != rc[rank]:
        raise ValueError(f"all_to_all: rank {rank} sends itself send_counts[{rank}] = {sc[rank]} elements "
                         f"but expects recv_counts[{rank}] = {rc[rank]} from itself")
    return x, y, max(sc + rc), (spans(sc), spans(rc))


def direct_algo(algo, forced: str, n: int) -> str:
    """The algorithm for packed counts: ``algo`` if given (ValueError unless it is direct), else
    RINGCOMM_ALGO if that names a direct all_to_all algorithm, else pairwise. Never the model's
    choice: every rank must pick alike, and a rank knows only its own counts."""
    names = ALGOS["all_to_all"]
    if algo is None:
        algo = forced if forced in names and _direct(names[forced], forced, n) else "pairwise"
    elif algo not in names:
        raise ValueError(f"all_to_all has no algorithm {algo!r}; choose one of {sorted(names)}")
    elif not _direct(names[algo], algo, n):
        raise ValueError(f"all_to_all algo={algo!r} forwards blocks through other ranks, which do not know "
                         f"the lengths of packed blocks: with send_counts / recv_counts use a direct "
                         f"algorithm such as 'pairwise', or equal blocks without counts")
    return algo


@lru_cache(maxsize=64)
def _direct(make, algo: str, n: int) -> bool:
    # Keyed by the builder too, so a registered algorithm replaced under the same name is looked
    # at afresh. Every rank's schedule, not just this one's: all ranks must reach the same answer.
    return all(is_direct(build_schedule("all_to_all", algo, r, n, None)) for r in range(n))


def counts_row(blocks) -> np.ndarray:
    """This rank's send then recv counts, for the RINGCOMM_DEBUG=check exchange."""
    ins, outs = blocks
    return np.array([length for _, length in ins + outs], np.int64)


def compare(rank: int, rows: np.ndarray) -> None:
    """Raise CollectiveMismatch (the same text on every rank) unless rank i's send_counts[j] is
    rank j's recv_counts[i] for every pair; ``rows`` is every rank's counts_row."""
    n = rows.shape[0]
    send, recv = rows[:, :n], rows[:, n:]
    bad = [(i, j) for i in range(n) for j in range(n) if send[i, j] != recv[j, i]]
    if not bad:
        return
    shown = "; ".join(f"rank {i} sends rank {j} {send[i, j]} elements but rank {j} expects {recv[j, i]}"
                      for i, j in bad[:4])
    more = f" (and {len(bad) - 4} more pairs)" if len(bad) > 4 else ""
    raise CollectiveMismatch(f"rank {rank} (this process): all_to_all counts disagree (RINGCOMM_DEBUG=check): "
                             f"{shown}{more}")


def gather_args(buf, out, is_root: bool, rank: int, root: int, n: int):
    """(x, y) for gather: the root's out holds n blocks of buf.size; other ranks omit out (their y
    is a stand-in that their steps never write: they only send and forward)."""
    x = host_array(buf, "gather buf", writable=False)
    if not is_root:
        if out is not None:
            raise ValueError(f"gather: only the root (rank {root}) passes out; rank {rank} must omit it")
        return x, x
    if out is None:
        raise ValueError(f"gather: the root (rank {rank}) must pass out ({n} x buf.size elements)")
    y = host_array(out, "gather out", writable=True)
    same_dtype(x, y, "gather buf and out")
    expect_size(y, n * x.size, f"gather out (world_size {n} x buf.size)")
    _in_place_only(x, y, address(x) == address(y) + rank * x.nbytes, "gather", "buf is block root of out")
    return x, y


def scatter_args(buf, out, is_root: bool, rank: int, root: int, n: int):
    """(x, y) for scatter: the root's buf holds n blocks of out.size; other ranks pass buf=None
    (their x is a stand-in that their steps never read: they only receive)."""
    y = host_array(out, "scatter out", writable=True)
    if not is_root:
        if buf is not None:
            raise ValueError(f"scatter: only the root (rank {root}) passes buf; rank {rank} must pass buf=None")
        return y, y
    if buf is None:
        raise ValueError(f"scatter: the root (rank {rank}) must pass buf ({n} x out.size elements)")
    x = host_array(buf, "scatter buf", writable=False)
    same_dtype(x, y, "scatter buf and out")
    expect_size(x, n * y.size, f"scatter buf (world_size {n} x out.size)")
    _in_place_only(x, y, address(y) == address(x) + rank * y.nbytes, "scatter", "out is block root of buf")
    return x, y


def _in_place_only(x, y, in_place: bool, name: str, form: str) -> None:
    """On the root, buf and out may share memory only as MPI_IN_PLACE does: ``form``."""
    if overlaps(x, y) and not in_place:
        raise ValueError(f"{name}: buf and out overlap; the only overlap allowed is in place, where {form}")
