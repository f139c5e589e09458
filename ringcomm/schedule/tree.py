"""Tree algorithms: NCCL's double binary tree for all-reduce, binomial trees for
broadcast and reduce.

Double binary tree (NCCL src/graph/trees.cc, ``ncclGetBtree`` / ``ncclGetDtree``).
Tree 0 is an in-order binary tree over the ranks: the node whose lowest set bit is
b has children r - b/2 and r + b/2 (the latter pulled down to r + b/4, ... while
out of range), so the odd ranks are its leaves; rank 0 is the root with a single
child, the largest power of two below n. Tree 1 is tree 0 mirrored (r -> n-1-r)
when n is even, shifted (r -> r+1) when n is odd. Consequences, checked in tests:
every rank has at most two children counting both trees, so no rank reduces or
forwards more than two children's data; for even n every rank is a leaf in one
tree and interior in the other; for odd n every rank but 0 is, while rank 0 is
interior in both but has one child in each. The chunks of a round are split
between the trees (chunks 0..K-1 go up and down tree 0, K..2K-1 tree 1), so both
links of every rank carry data in both directions.

Step order and why it cannot deadlock. A tree's work on chunk c is an "up" step
(leaf: send; interior: recv_reduce_send from the children to the parent; root:
recv_reduce_copy_send, which ends the reduction and starts the broadcast) and a
"down" step (interior: recv_copy_send from the parent to the children; leaf: recv;
root: nothing). Every rank runs them in one global order, lagged by one chunk so
chunk c+1 climbs while chunk c descends, and both trees interleaved:

    up0(0) up1(0) | up0(1) up1(1) down0(0) down1(0) | ... | down0(K-1) down1(K-1)

Every message is sent and received at the same position of that order, except the
root's down messages (sent at up(c), taken at down(c)); between those two
positions the root sends that child at most one more chunk, so with
``nslots >= 2 * slices`` its FIFO never fills. Then the rank at the earliest
position is never blocked on a full FIFO, and what it waits for comes from ranks
at the same position along tree edges, which end at a leaf or the root: some rank
can always move. The shared FIFOs must also deliver in the order each end expects;
that holds as long as no connection carries another message between a root's
up(c) and down(c), which is true for n >= 4 (the root-to-child links are not
edges of the other tree) but not for n = 2 or 3, where the two trees share those
links. There, and only there, all-reduce falls back to one binomial tree rooted
at 0 carrying all 2K chunks, with the same lagged order. n == 1 is a copy.

Broadcast and reduce use a binomial tree rooted at ``root`` (relative rank v's
parent is v with its lowest set bit cleared) over K chunks a round; every message
is sent and received at the same chunk, so they pipeline freely.
"""
from __future__ import annotations

from .step import (SPLIT, Schedule, Step, copy, copy_send, recv, recv_copy_send,
                   recv_reduce_copy, recv_reduce_copy_send, recv_reduce_send, send)

K = 4  # chunks per tree per round: enough for chunk c+1 to climb while chunk c descends

Node = tuple  # (parent or None, children tuple)


def btree(n: int, rank: int) -> Node:
    """NCCL's ncclGetBtree: (parent, children) of ``rank`` in tree 0."""
    bit = 1
    while bit < n and not bit & rank:
        bit <<= 1  # lowest set bit of rank (n's next power of two for rank 0)
    if rank == 0:
        return None, ((bit >> 1,) if n > 1 else ())
    parent = (rank ^ bit) | (bit << 1)  # xx01[0] and xx11[0] -> xx10[0] ...
    if parent >= n:
        parent = rank ^ bit             # ... or xx00[0] when that is out of range
    low = bit >> 1
    if low == 0:
        return parent, ()               # odd ranks are leaves
    right = rank + low
    while right >= n and low:           # the right subtree may be truncated: go lower
        low >>= 1
        right = rank + low
    return parent, (rank - (bit >> 1),) + ((right,) if low else ())


def double_binary_tree(n: int) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
    """((parent, children) for every rank in tree 0, the same for tree 1)."""
    tree0 = tuple(btree(n, r) for r in range(n))
    if n % 2:
        to, frm = (lambda r: (r + 1) % n), (lambda r: (r - 1) % n)
    else:
        to = frm = (lambda r: n - 1 - r)
    tree1 = []
    for r in range(n):
        parent, children = tree0[frm(r)]
        tree1.append((None if parent is None else to(parent), tuple(to(c) for c in children)))
    return tree0, tuple(tree1)


def binomial_tree(n: int, root: int = 0) -> tuple[Node, ...]:
    """(parent, children) of every rank in the binomial tree rooted at ``root``.
    Relative rank v > 0 hangs below v minus its lowest set bit; children are listed
    largest subtree first, so the longest pipeline starts first."""
    nodes = []
    for r in range(n):
        v = (r - root) % n
        low = v & -v if v else 1 << max(n - 1, 1).bit_length()
        parent = None if v == 0 else (v - (v & -v) + root) % n
        kids = [v + m for m in (1 << k for k in range(low.bit_length() - 1)) if v + m < n]
        nodes.append((parent, tuple((c + root) % n for c in reversed(kids))))
    return tuple(nodes)


def _up(c: int, node: Node) -> Step:
    parent, children = node
    if parent is None:
        return recv_reduce_copy_send(c, children, children)
    if not children:
        return send(c, parent)
    return recv_reduce_send(c, children, parent)


def _down(c: int, node: Node) -> Step | None:
    parent, children = node
    if parent is None:
        return None  # the root's up step already sent the finished chunk down
    if not children:
        return recv(c, parent)
    return recv_copy_send(c, parent, children)


def _lagged(plan: list[tuple[Node, range]]) -> list[Step]:
    """Up steps of chunk i of every tree, then down steps of chunk i-1 (module docstring)."""
    steps = []
    for i in range(max(len(chunks) for _, chunks in plan) + 1):
        steps += [_up(chunks[i], node) for node, chunks in plan if i < len(chunks)]
        downs = [_down(chunks[i - 1], node) for node, chunks in plan if 0 < i <= len(chunks)]
        steps += [s for s in downs if s is not None]
    return steps


def tree_all_reduce(rank: int, n: int) -> Schedule:
    """Double binary tree all-reduce, 2K chunks a round (binomial tree for n <= 3)."""
    _check(rank, n)
    if n == 1:
        return Schedule("all_reduce", "tree", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    if n <= 3:
        plan = [(binomial_tree(n)[rank], range(2 * K))]
    else:
        tree0, tree1 = double_binary_tree(n)
        plan = [(tree0[rank], range(K)), (tree1[rank], range(K, 2 * K))]
    return Schedule("all_reduce", "tree", rank, n, 2 * K, SPLIT, SPLIT, tuple(_lagged(plan)))


def tree_broadcast(rank: int, n: int, root: int) -> Schedule:
    """Binomial-tree broadcast from ``root``, K pipelined chunks a round."""
    _check(rank, n, root)
    if n == 1:
        return Schedule("broadcast", "tree", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    parent, children = binomial_tree(n, root)[rank]
    if parent is None:
        steps = [copy_send(c, children) for c in range(K)]
    elif not children:
        steps = [recv(c, parent) for c in range(K)]
    else:
        steps = [recv_copy_send(c, parent, children) for c in range(K)]
    return Schedule("broadcast", "tree", rank, n, K, SPLIT, SPLIT, tuple(steps))


def tree_reduce(rank: int, n: int, root: int) -> Schedule:
    """Binomial-tree reduce to ``root`` (result on the root only), K pipelined chunks a round."""
    _check(rank, n, root)
    if n == 1:
        return Schedule("reduce", "tree", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    parent, children = binomial_tree(n, root)[rank]
    if parent is None:
        steps = [recv_reduce_copy(c, children) for c in range(K)]
    elif not children:
        steps = [send(c, parent) for c in range(K)]
    else:
        steps = [recv_reduce_send(c, children, parent) for c in range(K)]
    return Schedule("reduce", "tree", rank, n, K, SPLIT, SPLIT, tuple(steps))


def _check(rank: int, n: int, root: int = 0) -> None:
    if not (n >= 1 and 0 <= rank < n and 0 <= root < n):
        raise ValueError(f"need 0 <= rank, root < n, got rank={rank} root={root} n={n}")
