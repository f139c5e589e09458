"""One-copy algorithms on registered buffers (comm.alloc): every rank reads its peers' memory directly.

The host twin of NCCL's symmetric-memory kernels and of MSCCL++'s MemoryChannel: no FIFO, no
staging slot, so each byte is copied once instead of twice (into a slot, out of it). The steps
read a peer's input or output chunk in place (schedule/step.py, READS); ``sync`` steps separate
the phases, so nobody reads an output chunk before its owner has written it, and nobody leaves
the call while a peer may still read its buffers.

- all_reduce: rank r reduces chunk r of every rank's input, in rank order (x0 + x1 + ... on every
  chunk: the same order on every rank and for every message size), into its own output chunk r,
  and writes that chunk straight into every peer's output chunk r (write_out_copy); sync. The
  engine takes the two steps a piece at a time, so each reduced piece leaves for the peers
  while it is in this core's cache, where reading it back after a sync (read_out_copy, the
  schedule before) read it from memory and cost a second sync. In place is safe: rank r writes
  only chunk r, its own and its peers', and only rank r reads chunk r of anyone's input: it
  reads each piece of a peer's before it writes the result over it.
- reduce_scatter: rank r reduces block r of every rank's input into its output; sync.
- all_gather: rank r writes its own block straight into every peer's output (write_copy), then
  copies it into its own; sync. The engine takes the two steps a piece at a time (a write, then
  the copy of the same piece while it is in cache), so the block is read from memory once where
  reading the peers' blocks would read every block from memory.
- broadcast: the buffer is cut into n chunks; reader r copies every chunk but chunk r from the
  root's buffer while the root writes chunk r straight into reader r's buffer (write_copy), so
  two cores fill a 2-rank broadcast's buffer, a half each; the root syncs with each reader, the
  readers with the root only.
- reduce: the root reduces every rank's input; the root syncs with each rank.
"""
from __future__ import annotations

from .step import (BLOCK, OWN, SPLIT, Schedule, copy, read_copy, read_out_copy, read_reduce_copy, sync,
                   write_copy, write_out_copy)

ALGO = "read"


def read_all_reduce(rank: int, n: int) -> Schedule:
    _check(rank, n)
    if n == 1:
        return Schedule("all_reduce", ALGO, rank, n, 1, SPLIT, SPLIT, (copy(0),))
    others = _others(rank, n)
    steps = (read_reduce_copy(rank, tuple(range(n))), write_out_copy(rank, others), sync(others))
    return Schedule("all_reduce", ALGO, rank, n, n, SPLIT, SPLIT, steps)


def read_back_all_reduce(rank: int, n: int) -> Schedule:
    """The all_reduce read schedule before write_out_copy, kept to learn from and to test the
    checker on: each rank reduces its chunk; sync; it copies every other chunk from its owner's
    output (read_out_copy); sync. Every reduced chunk is read back after the sync, from memory
    once it has left the owner's cache, and the call has two syncs where read_all_reduce has one."""
    _check(rank, n)
    if n == 1:
        return Schedule("all_reduce", ALGO, rank, n, 1, SPLIT, SPLIT, (copy(0),))
    others = _others(rank, n)
    steps = (read_reduce_copy(rank, tuple(range(n))), sync(others),
             *(read_out_copy(q, q) for q in others), sync(others))
    return Schedule("all_reduce", ALGO, rank, n, n, SPLIT, SPLIT, steps)


def read_reduce_scatter(rank: int, n: int) -> Schedule:
    _check(rank, n)
    if n == 1:
        return Schedule("reduce_scatter", ALGO, rank, n, 1, BLOCK, OWN, (copy(0),))
    steps = (read_reduce_copy(rank, tuple(range(n))), sync(_others(rank, n)))
    return Schedule("reduce_scatter", ALGO, rank, n, n, BLOCK, OWN, steps)


def read_all_gather(rank: int, n: int) -> Schedule:
    _check(rank, n)
    if n == 1:
        return Schedule("all_gather", ALGO, rank, n, 1, OWN, BLOCK, (copy(0),))
    others = _others(rank, n)
    steps = (*(write_copy(rank, q) for q in others), copy(rank), sync(others))
    return Schedule("all_gather", ALGO, rank, n, n, OWN, BLOCK, steps)


def read_broadcast(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    if n == 1:
        return Schedule("broadcast", ALGO, rank, n, 1, SPLIT, SPLIT, (copy(0),))
    others = _others(rank, n)
    if rank == root:  # writes chunk r of each reader r, then its own copy (none in place)
        steps = (*(write_copy(r, r) for r in others), *(copy(c) for c in range(n)), sync(others))
    else:             # reads every chunk but its own from the root, which writes that one
        steps = (*(read_copy(c, root) for c in range(n) if c != rank), sync(root))
    return Schedule("broadcast", ALGO, rank, n, n, SPLIT, SPLIT, steps)


def read_reduce(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    if n == 1:
        return Schedule("reduce", ALGO, rank, n, 1, SPLIT, SPLIT, (copy(0),))
    if rank != root:
        return Schedule("reduce", ALGO, rank, n, 1, SPLIT, SPLIT, (sync(root),))
    steps = (read_reduce_copy(0, tuple(range(n))), sync(_others(rank, n)))
    return Schedule("reduce", ALGO, rank, n, 1, SPLIT, SPLIT, steps)


def _others(rank: int, n: int) -> tuple[int, ...]:
    return tuple(q for q in range(n) if q != rank)


def _check(rank: int, n: int, root: int = 0) -> None:
    if not (isinstance(n, int) and n >= 1 and 0 <= rank < n and 0 <= root < n):
        raise ValueError(f"need 0 <= rank, root < n, got rank={rank} root={root} n={n}")
