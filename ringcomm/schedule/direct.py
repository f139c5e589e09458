"""Latency-bound algorithms: Bruck all_gather, one-shot all_reduce, unpipelined binomial trees.

Bruck (Bruck et al. 1997, as in Thakur, Rabenseifner and Gropp 2005). At stage k (distance
2^k, k = 0 .. ceil(log2 n) - 1) rank r sends r - 2^k every block it holds, r .. r + 2^k - 1,
fewer at the last stage so no block arrives twice; ceil(log2 n) messages for any n. The
textbook keeps blocks rotated by r and unrotates them at the end; ringcomm's BLOCK output
layout places each block at its index directly, so no rotation step is needed. As steps, a
block is forwarded as it arrives: rank r gets block r + j (0 < j < n) at stage floor(log2 j)
from r + 2^floor(log2 j) and passes it to r - 2^k for the later stages k with 2^k + j < n.
Every rank walks blocks in index order, so each block's messages are sent and taken at the
same turn (no FIFO fills: verify() checks).

One-shot (direct) all_reduce: every rank sends its whole buffer to every other and adds all
n inputs itself, one step, one message latency: the small-message algorithm of NVLink
libraries. Each rank starts from its own input, so for floats ranks combine in different
orders (verify() reports it): exact for integers, MIN and MAX, and on 2 ranks; it is never
chosen automatically.

Binomial broadcast and reduce without pipelining (one chunk a round): the algorithms of the
paper's formulas. "tree" is the same tree pipelined over 4 chunks.
"""
from __future__ import annotations

from .step import (OWN, BLOCK, SPLIT, Schedule, copy, copy_send, recv, recv_copy_send,
                   recv_reduce_copy, recv_reduce_send, send)
from .tree import binomial_tree


def _stages(n: int) -> int:
    return (n - 1).bit_length()  # ceil(log2 n)


def bruck_all_gather(rank: int, n: int) -> Schedule:
    _check(rank, n)
    if n == 1:
        return Schedule("all_gather", "bruck", rank, n, 1, OWN, BLOCK, (copy(0),))
    kmax = _stages(n)
    steps, stages = [], []
    for b in range(n):
        j = (b - rank) % n
        s = j.bit_length() - 1 if j else -1          # the stage block b reaches this rank
        later = [k for k in range(s + 1, kmax) if (1 << k) + j < n]
        dsts = [(rank - (1 << k)) % n for k in later]
        if j == 0:
            steps.append(copy_send(b, dsts))
        else:
            frm = (rank + (1 << s)) % n
            steps.append(recv_copy_send(b, frm, dsts) if dsts else recv(b, frm))
        stages.append(tuple(later) if dsts else kmax)
    return Schedule("all_gather", "bruck", rank, n, n, OWN, BLOCK, tuple(steps), tuple(stages))


def oneshot_all_reduce(rank: int, n: int) -> Schedule:
    _check(rank, n)
    if n == 1:
        return Schedule("all_reduce", "oneshot", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    others = tuple(q for q in range(n) if q != rank)
    return Schedule("all_reduce", "oneshot", rank, n, 1, SPLIT, SPLIT,
                    (send(0, others), recv_reduce_copy(0, others)), ((0,) * len(others), 1))


def _tree_stages(n: int, root: int, rank: int):
    """Stage of each edge in the paper's binomial tree: relative rank v and its child v + 2^j
    talk at stage ceil(log2 n) - 1 - j for broadcast (big subtrees first), j for reduce."""
    v = (rank - root) % n
    parent, children = binomial_tree(n, root)[rank]
    kids = [((c - root) % n - v).bit_length() - 1 for c in children]
    up = (v & -v).bit_length() - 1 if v else None
    return parent, children, kids, up


def binomial_broadcast(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    if n == 1:
        return Schedule("broadcast", "binomial", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    kmax = _stages(n)
    parent, children, kids, up = _tree_stages(n, root, rank)
    st = tuple(kmax - 1 - j for j in kids)
    if parent is None:
        step = copy_send(0, children)
    elif not children:
        step, st = recv(0, parent), kmax
    else:
        step = recv_copy_send(0, parent, children)
    return Schedule("broadcast", "binomial", rank, n, 1, SPLIT, SPLIT, (step,), (st,))


def binomial_reduce(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    if n == 1:
        return Schedule("reduce", "binomial", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    parent, children, kids, up = _tree_stages(n, root, rank)
    kids_small_first = tuple(reversed(children))  # they finish first: combined as they come
    if parent is None:
        step, st = recv_reduce_copy(0, kids_small_first), _stages(n)
    elif not children:
        step, st = send(0, parent), up
    else:
        step, st = recv_reduce_send(0, kids_small_first, parent), up
    return Schedule("reduce", "binomial", rank, n, 1, SPLIT, SPLIT, (step,), (st,))


def _check(rank: int, n: int, root: int = 0) -> None:
    if not (isinstance(n, int) and n >= 1 and 0 <= rank < n and 0 <= root < n):
        raise ValueError(f"need 0 <= rank, root < n, got rank={rank} root={root} n={n}")
