"""Ring algorithms, as in NCCL's ``runRing`` (src/device/all_reduce.h and friends).

Rank r receives from r-1 and sends to r+1. Chunk indices are the ring's
"which piece is where" arithmetic; each function's comment says why it is right.
"""
from __future__ import annotations

from .step import (BLOCK, OWN, SPLIT, Schedule, copy, copy_send, recv, recv_copy_send,
                   recv_reduce_copy, recv_reduce_copy_send, recv_reduce_send, send)


def ring_all_reduce(rank: int, n: int) -> Schedule:
    """Reduce-scatter then all-gather around the ring, n chunks a round.

    At step k rank r handles chunk (r - 1 - k) mod n: step 0 sends chunk r-1,
    each following step receives from r-1 the partial sum of the chunk r-1
    sent at the step before (its index is one lower), so after n-1 steps chunk
    r - n = r holds all n contributions. The next n-1 steps pass finished
    chunks on; the last one received is r - 1 - (2n - 2) = r + 1 (mod n).
    """
    if n == 1:
        return Schedule("all_reduce", "ring", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    prev, nxt = (rank - 1) % n, (rank + 1) % n

    def c(k):
        return (rank - 1 - k) % n

    steps = [send(c(0), nxt)]
    steps += [recv_reduce_send(c(k), prev, nxt) for k in range(1, n - 1)]
    steps += [recv_reduce_copy_send(c(n - 1), prev, nxt)]
    steps += [recv_copy_send(c(k), prev, nxt) for k in range(n, 2 * n - 2)]
    steps += [recv(c(2 * n - 2), prev)]
    return Schedule("all_reduce", "ring", rank, n, n, SPLIT, SPLIT, tuple(steps))


def ring_reduce_scatter(rank: int, n: int) -> Schedule:
    """The first half of ring all-reduce: rank r ends holding block r reduced."""
    if n == 1:
        return Schedule("reduce_scatter", "ring", rank, n, 1, BLOCK, OWN, (copy(0),))
    prev, nxt = (rank - 1) % n, (rank + 1) % n

    def c(k):
        return (rank - 1 - k) % n

    steps = [send(c(0), nxt)]
    steps += [recv_reduce_send(c(k), prev, nxt) for k in range(1, n - 1)]
    steps += [recv_reduce_copy(c(n - 1), prev)]  # c(n-1) == rank
    return Schedule("reduce_scatter", "ring", rank, n, n, BLOCK, OWN, tuple(steps))


def ring_all_gather(rank: int, n: int) -> Schedule:
    """Rank r puts its block at slot r and passes it on; at step k it receives
    block r - k, which r-1 received (or owned) at the step before."""
    if n == 1:
        return Schedule("all_gather", "ring", rank, n, 1, OWN, BLOCK, (copy(0),))
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    steps = [copy_send(rank, nxt)]
    steps += [recv_copy_send((rank - k) % n, prev, nxt) for k in range(1, n - 1)]
    steps += [recv((rank - n + 1) % n, prev)]
    return Schedule("all_gather", "ring", rank, n, n, OWN, BLOCK, tuple(steps))


def ring_broadcast(rank: int, n: int, root: int) -> Schedule:
    """A chain root -> root+1 -> ... -> root-1, one chunk a round, so rounds pipeline."""
    if n == 1:
        return Schedule("broadcast", "ring", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    pos = (rank - root) % n
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    if pos == 0:
        step = copy_send(0, nxt)
    elif pos == n - 1:
        step = recv(0, prev)
    else:
        step = recv_copy_send(0, prev, nxt)
    return Schedule("broadcast", "ring", rank, n, 1, SPLIT, SPLIT, (step,))


def ring_reduce(rank: int, n: int, root: int) -> Schedule:
    """A chain root+1 -> root+2 -> ... -> root, reducing on the way; one chunk a round."""
    if n == 1:
        return Schedule("reduce", "ring", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    pos = (rank - root - 1) % n  # 0 starts the chain, n-1 is the root
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    if pos == 0:
        step = send(0, nxt)
    elif pos == n - 1:
        step = recv_reduce_copy(0, prev)
    else:
        step = recv_reduce_send(0, prev, nxt)
    return Schedule("reduce", "ring", rank, n, 1, SPLIT, SPLIT, (step,))
