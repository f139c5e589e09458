"""Point-to-point transfers and the barrier, as schedules.

A send or a recv is one chunk a round, so a large message pipelines over rounds
and slices like any collective. The barrier is the dissemination barrier
(Hensgen, Finkel and Manber, 1988): in round k every rank signals rank + 2^k and
then waits for rank - 2^k. After round k a rank has heard, directly or through
the ranks it heard from, of the 2^(k+1) ranks just below it, so ceil(log2 n)
rounds reach everyone, for any n. Its buffer is a single element; the data is
meaningless, only the arrivals matter.

The builders are cached (schedules are immutable): the executor keys its slice plans by the
schedule object, so a fresh schedule per call would rebuild the plan at every send, recv and
barrier (~20 us of Python) and push the collectives' plans out of its cache.
"""
from __future__ import annotations

from functools import lru_cache

from .step import SPLIT, Schedule, copy, recv, send


def _check_peer(rank: int, n: int, peer: int) -> None:
    if not (0 <= rank < n and 0 <= peer < n):
        raise ValueError(f"need 0 <= rank, peer < n, got rank={rank} peer={peer} n={n}")
    if peer == rank:
        raise ValueError(f"rank {rank} cannot send to or receive from itself; copy locally instead")


@lru_cache(maxsize=1024)
def p2p_send(rank: int, n: int, peer: int) -> Schedule:
    """Send the buffer to ``peer``, which runs p2p_recv(peer, n, rank)."""
    _check_peer(rank, n, peer)
    return Schedule("send", "p2p", rank, n, 1, SPLIT, SPLIT, (send(0, peer),))


@lru_cache(maxsize=1024)
def p2p_recv(rank: int, n: int, peer: int) -> Schedule:
    """Receive the buffer from ``peer``, which runs p2p_send(peer, n, rank)."""
    _check_peer(rank, n, peer)
    return Schedule("recv", "p2p", rank, n, 1, SPLIT, SPLIT, (recv(0, peer),))


@lru_cache(maxsize=1024)
def barrier(rank: int, n: int) -> Schedule:
    """Dissemination barrier over a one-element buffer: ceil(log2 n) send/recv pairs.

    The offsets 2^k (< n) are distinct, so each round uses its own pair of
    connections and a send never waits behind an earlier round's message.
    """
    if not 0 <= rank < n:
        raise ValueError(f"need 0 <= rank < n, got rank={rank} n={n}")
    if n == 1:
        return Schedule("barrier", "dissemination", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    steps = []
    dist = 1
    while dist < n:
        steps += [send(0, (rank + dist) % n), recv(0, (rank - dist) % n)]
        dist *= 2
    return Schedule("barrier", "dissemination", rank, n, 1, SPLIT, SPLIT, tuple(steps))
