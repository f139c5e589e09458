"""all_to_all as schedules: pairwise exchange and Bruck (Thakur, Rabenseifner and Gropp 2005).

Chunk names. The block rank s sends rank d is chunk s * n + d of an n * n chunk round, so
both ends of every message name it alike; the TO layout finds it in the sender's input
(block d), FROM in the receiver's output (block s).

Pairwise exchange (MPICH's alltoall for long messages, any n): at stage k = 1 .. n-1 rank r
sends its block for r + k and receives rank r - k's block for it; a send step, then a receive
step. Each connection carries one block a round and a chunk fills at most half a FIFO, so
the sends of a stage never block: (p - 1)(alpha + n/p beta).

Bruck (1997; the short-message algorithm): block (s, s + j) travels in hops, one per set bit
b of the distance j, from s + (j mod 2^b) to s + (j mod 2^(b+1)), and every hop over bit b is
sent in stage b, so each rank sends ceil(log2 n) messages of about half its data. The
textbook packs a stage's blocks into one message through a scratch buffer; ringcomm's steps
hold no scratch, so a block is forwarded as it arrives (recv_send) and Schedule.stages tells
the cost model which blocks travel together. Every rank walks the distances j = 0 .. n-1 in
order and, for each, its hops in order (source, each intermediate place, destination): a
hop's message is sent and taken at the same turn, so no FIFO holds more than a turn's chunk
(verify() checks every FIFO shape). Intermediate ranks move blocks whose lengths only the
two ends know, so Bruck needs equal blocks; is_direct() tells which schedules do not.
"""
from __future__ import annotations

from .step import FROM, TO, Schedule, copy, recv, recv_send, send


def pairwise_all_to_all(rank: int, n: int) -> Schedule:
    _check(rank, n)
    steps, stages = [copy(rank * n + rank)], [0]
    for k in range(1, n):
        to, frm = (rank + k) % n, (rank - k) % n
        steps += [send(rank * n + to, to), recv(frm * n + rank, frm)]
        stages += [k, k]
    return Schedule("all_to_all", "pairwise", rank, n, n * n, TO, FROM, tuple(steps), tuple(stages))


def bruck_all_to_all(rank: int, n: int) -> Schedule:
    _check(rank, n)
    steps, stages = [copy(rank * n + rank)], [0]
    for j in range(1, n):
        bits = [b for b in range(j.bit_length()) if j >> b & 1]
        src = rank  # the block's source, for the hop leaving this rank: r - (j mod 2^b)
        steps.append(send(src * n + (src + j) % n, (rank + (1 << bits[0])) % n))
        stages.append(bits[0])
        for prev, b in zip(bits, bits[1:]):
            src = (rank - j % (1 << b)) % n
            steps.append(recv_send(src * n + (src + j) % n, (rank - (1 << prev)) % n, (rank + (1 << b)) % n))
            stages.append(b)
        src = (rank - j) % n
        steps.append(recv(src * n + rank, (rank - (1 << bits[-1])) % n))
        stages.append(bits[-1])
    return Schedule("all_to_all", "bruck", rank, n, n * n, TO, FROM, tuple(steps), tuple(stages))


def is_direct(s: Schedule) -> bool:
    """Whether every block of this rank's schedule goes straight from its source to its
    destination: then only those two ranks touch it, and both know its length, so the
    schedule can run packed variable blocks (all_to_all's send_counts / recv_counts)."""
    for st in s.steps:
        src, dst = divmod(st.chunk, s.world_size)
        if st.recvs and (st.src != (src,) or s.rank != dst):
            return False
        if st.sends and (st.dst != (dst,) or s.rank != src):
            return False
        if (st.copies and s.rank != dst) or (not st.recvs and s.rank != src):
            return False
    return True


def _check(rank: int, n: int) -> None:
    if not (isinstance(n, int) and n >= 1 and 0 <= rank < n):
        raise ValueError(f"need 0 <= rank < n, got rank={rank} n={n}")
