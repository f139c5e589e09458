"""gather and scatter as schedules: linear and binomial (Thakur, Rabenseifner and Gropp 2005).

Chunk c is rank c's block: gather reads each rank's buffer whole (OWN) into block c of the
root's output (BLOCK); scatter reads block c of the root's input (BLOCK) into rank c's
output (OWN). Ranks other than the root have no buffer on the root's side: they only send
(gather) or receive (scatter) through the steps below, never copy a block that is not theirs.

Linear: the root talks to every rank directly, in rank order from root + 1; one stage of
p - 1 messages: (p - 1) alpha + (p - 1)/p n beta.

Binomial: the tree of tree.binomial_tree (relative rank v hangs below v minus its lowest set
bit). The relative ranks of v's subtree are v .. v + size - 1. Every edge carries a subtree's
blocks in the order the rank below handles them: its own block, then each child's subtree.
Gather takes the children smallest first (relative ranks ascending) and sends a subtree up
at the stage of its lowest set bit, so a rank's children (lower bits) are done before it
sends; scatter serves the children largest first, the child at distance 2^j in stage
ceil(log2 p) - 1 - j. Blocks are forwarded as they arrive (recv_send, no scratch); the stages
group them into the textbook's messages: ceil(log2 p) alpha + (p - 1)/p n beta.
"""
from __future__ import annotations

from .step import BLOCK, OWN, Schedule, copy, recv, recv_send, send
from .tree import binomial_tree


def linear_gather(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    if rank != root:
        return Schedule("gather", "linear", rank, n, n, OWN, BLOCK, (send(rank, root),), (0,))
    others = [(root + k) % n for k in range(1, n)]
    steps = (copy(root),) + tuple(recv(c, c) for c in others)
    return Schedule("gather", "linear", rank, n, n, OWN, BLOCK, steps, (0,) * n)


def linear_scatter(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    if rank != root:
        return Schedule("scatter", "linear", rank, n, n, BLOCK, OWN, (recv(rank, root),), (1,))
    others = [(root + k) % n for k in range(1, n)]
    steps = (copy(root),) + tuple(send(c, c) for c in others)
    return Schedule("scatter", "linear", rank, n, n, BLOCK, OWN, steps, (0,) * n)


def _subtree(v: int, n: int) -> range:
    """The relative ranks of v's subtree: v and the next lowbit(v) - 1 (fewer at the end)."""
    size = v & -v if v else n
    return range(v, min(v + size, n))


def binomial_gather(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    v = (rank - root) % n
    parent, children = binomial_tree(n, root)[rank]
    up = (v & -v).bit_length() - 1 if v else None  # the stage this rank sends in
    real = lambda u: (u + root) % n  # noqa: E731
    if parent is None:
        steps, stages = [copy(rank)], [0]
    else:
        steps, stages = [send(rank, parent)], [up]
    for c in reversed(children):  # smallest subtree first: relative ranks in ascending order
        for u in _subtree((c - root) % n, n):
            if parent is None:
                steps.append(recv(real(u), c))
            else:
                steps.append(recv_send(real(u), c, parent))
            stages.append(up if parent is not None else 0)
    return Schedule("gather", "binomial", rank, n, n, OWN, BLOCK, tuple(steps), tuple(stages))


def binomial_scatter(rank: int, n: int, root: int) -> Schedule:
    _check(rank, n, root)
    tree = binomial_tree(n, root)
    parent, children = tree[rank]
    v, kmax = (rank - root) % n, (n - 1).bit_length()
    steps, stages = [copy(rank) if parent is None else recv(rank, parent)], [0]
    for c in children:  # largest subtree first: the longest pipeline starts first
        stage = kmax - 1 - (((c - root) % n - v).bit_length() - 1)
        for b in _down_order(tree, c):
            steps.append(send(b, c) if parent is None else recv_send(b, parent, c))
            stages.append(stage)
    return Schedule("scatter", "binomial", rank, n, n, BLOCK, OWN, tuple(steps), tuple(stages))


def _down_order(tree, r: int) -> list[int]:
    """The blocks of r's subtree in the order r forwards them: its own, then each child's
    subtree (largest first), so the edge into r carries them in the order r consumes them."""
    order = [r]
    for c in tree[r][1]:
        order += _down_order(tree, c)
    return order


def _check(rank: int, n: int, root: int) -> None:
    if not (isinstance(n, int) and n >= 1 and 0 <= rank < n and 0 <= root < n):
        raise ValueError(f"need 0 <= rank, root < n, got rank={rank} root={root} n={n}")
