"""Recursive halving and doubling (Thakur, Rabenseifner and Gropp 2005; MPICH's allreduce.c):
Rabenseifner's all_reduce, recursive-halving reduce_scatter, recursive-doubling all_gather, and
the recursive-doubling all_reduce of short messages.

As steps. The textbook algorithm exchanges half the vector, then a quarter, ... and keeps
partial sums in a scratch buffer. ringcomm's steps reduce as data arrives and have no
scratch, so each chunk's value travels on its own: chunk c is reduced up a binomial tree
onto the rank that owns it (at halving stage s a rank sends partner v ^ (p'/2^s) the chunks
on the partner's side; a chunk that leaves at stage s has collected the rank's own input and
what partners 1..s-1 sent, in one recv_reduce_send), and all_gather sends it back down the
mirror tree (at doubling stage t the partner v ^ 2^(t-1) gets every chunk of v's group).
The messages, their sizes and their stages are exactly the textbook's; Schedule.stages says
which stage each send belongs to, so the cost model groups them into the textbook's messages.

Order. Every rank walks the chunks in the same order and, for each, does its reduce step then
its gather step. Each chunk's messages are sent and taken at that chunk's turn, so a FIFO holds
at most a chunk or two (verify() checks every FIFO shape) - the textbook order, which sends half
the vector before receiving anything, would deadlock FIFOs of a few slots.

Non-power-of-two world sizes: MPICH's fold. With p' the largest power of two <= n and
rem = n - p', each even rank r < 2*rem hands its data to r + 1 (stage 0) and sits out; the
p' others run the algorithm over virtual ranks (r // 2 below 2*rem, r - rem above) and at the
end hand the even ranks their result.
"""
from __future__ import annotations

from .step import (BLOCK, OWN, SPLIT, Schedule, copy, copy_send, recv, recv_copy_send,
                   recv_reduce_copy, recv_reduce_copy_send, recv_reduce_send, send)


class Fold:
    """The virtual power-of-two world of a world of n ranks."""

    def __init__(self, n: int):
        self.n, self.p2 = n, 1 << (n.bit_length() - 1)
        self.k, self.rem = self.p2.bit_length() - 1, n - self.p2

    def virtual(self, r: int) -> int | None:
        """r's virtual rank, or None for an even rank that sits out."""
        if r < 2 * self.rem:
            return None if r % 2 == 0 else r // 2
        return r - self.rem

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.rem else v + self.rem

    def extra(self, v: int) -> int | None:
        """The rank that sits out and hands its data to virtual rank v, if any."""
        return 2 * v if v < self.rem else None

    def owner(self, r: int) -> int:
        """The virtual rank that works for real rank r."""
        v = self.virtual(r)
        return self.virtual(r + 1) if v is None else v

    def halving(self, v: int) -> list[int]:
        """Real partners of v at halving stages 1..k: distance p'/2 first."""
        return [self.real(v ^ (self.p2 >> s)) for s in range(1, self.k + 1)]

    def doubling(self, v: int) -> list[int]:
        """Real partners of v at doubling stages 1..k: distance 1 first."""
        return [self.real(v ^ (1 << t)) for t in range(self.k)]

    @staticmethod
    def split(v: int, w: int) -> int:
        """The dimension where virtual ranks v != w part: their highest differing bit."""
        return (v ^ w).bit_length() - 1


def _reduce_step(f: Fold, v, w, chunk, extra):
    """v's halving step for a chunk owned by virtual rank w != v: the chunk leaves v at the
    stage whose partner is on w's side, with v's input plus what the extra rank and the
    earlier partners sent. Returns (step, stage)."""
    j = f.split(v, w)
    s = f.k - j
    srcs = ([extra] if extra is not None else []) + f.halving(v)[:s - 1]
    to = f.halving(v)[s - 1]
    return (recv_reduce_send(chunk, srcs, to) if srcs else send(chunk, to)), s


def _gather_dsts(f: Fold, v, t, extra, base):
    """(dsts, stages) of a chunk v holds from doubling stage t on: the later partners, then
    the extra rank at the very end."""
    dsts = f.doubling(v)[t:]
    stages = [base + u for u in range(t + 1, f.k + 1)]
    if extra is not None:
        dsts, stages = dsts + [extra], stages + [base + f.k + 1]
    return dsts, tuple(stages)


def rabenseifner_all_reduce(rank: int, n: int) -> Schedule:
    """Recursive-halving reduce-scatter, then recursive-doubling all-gather; p' chunks a round."""
    _check(rank, n)
    if n == 1:
        return Schedule("all_reduce", "rabenseifner", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    f = Fold(n)
    v, k = f.virtual(rank), f.k
    steps, stages = [], []
    if v is None:  # hand every chunk to rank + 1, get every result back
        for c in range(f.p2):
            steps += [send(c, rank + 1), recv(c, rank + 1)]
            stages += [0, 2 * k + 2]
        return _sched("all_reduce", "rabenseifner", rank, n, f.p2, SPLIT, SPLIT, steps, stages)
    extra = f.extra(v)
    for c in range(f.p2):
        if c == v:  # the chunk v owns: everything arrives, the sum is final, then it spreads
            srcs = ([extra] if extra is not None else []) + f.halving(v)
            dsts, st = _gather_dsts(f, v, 0, extra, k)
            steps.append(recv_reduce_copy_send(c, srcs, dsts))
            stages.append(st)
            continue
        step, s = _reduce_step(f, v, c, c, extra)
        steps.append(step)
        stages.append(s)
        t = f.split(v, c) + 1  # the doubling stage at which c's group meets v's
        frm = f.doubling(v)[t - 1]
        dsts, st = _gather_dsts(f, v, t, extra, k)
        steps.append(recv_copy_send(c, frm, dsts) if dsts else recv(c, frm))
        stages.append(st if dsts else 2 * k + 2)
    return _sched("all_reduce", "rabenseifner", rank, n, f.p2, SPLIT, SPLIT, steps, stages)


def doubling_all_reduce(rank: int, n: int) -> Schedule:
    """Recursive doubling, MPICH's all_reduce for short messages: at stage j every rank swaps its
    partial sum with v ^ 2^(j-1) and folds in what it gets, so after log2(p') stages all hold the
    total; one chunk, the whole vector in every message (Thakur et al.: lg p (alpha + n beta +
    n gamma)).

    The running sum S lives in the output. The first exchange reduces the input with the
    partner's and keeps it there (partial=True: not final, so AVG does not divide yet); each
    later one carries it on (base="out": S = S op what the partner sends), and the last finishes
    it. A step sends the value it makes to the next stage's partner as it makes it, so a rank
    sends once a stage and a FIFO holds one message at a time. Both ends of an exchange combine
    the same two values (S op P at one end, P op S at the other), so for a commutative op all
    ranks hold the same bits. Non-power-of-two sizes fold in MPICH's way (Fold): an even rank
    below 2*rem hands its input to rank + 1 (stage 0), which starts from the two, and gets the
    result back (stage k + 1)."""
    _check(rank, n)
    if n == 1:
        return Schedule("all_reduce", "doubling", rank, n, 1, SPLIT, SPLIT, (copy(0),))
    f = Fold(n)
    v, k = f.virtual(rank), f.k
    if v is None:
        return _sched("all_reduce", "doubling", rank, n, 1, SPLIT, SPLIT,
                      [send(0, rank + 1), recv(0, rank + 1)], [0, k + 1])
    extra = f.extra(v)
    partners = f.doubling(v)
    if extra is None:   # stage 1 sends the input itself
        steps, stages, base = [send(0, partners[0])], [1], "in"
    else:               # ... or the input with the extra rank's, kept as the running sum
        steps, stages, base = [recv_reduce_copy_send(0, extra, partners[0], partial=True)], [1], "out"
    for j, frm in enumerate(partners):
        last = j == k - 1
        if not last:
            step = recv_reduce_copy_send(0, frm, partners[j + 1], base=base, partial=True)
        elif extra is not None:
            step = recv_reduce_copy_send(0, frm, extra, base=base)
        else:
            step = recv_reduce_copy(0, frm, base=base)
        steps.append(step)
        stages.append(j + 2)
        base = "out"
    return _sched("all_reduce", "doubling", rank, n, 1, SPLIT, SPLIT, steps, stages)


def halving_reduce_scatter(rank: int, n: int) -> Schedule:
    """Recursive-halving reduce-scatter: block b is reduced onto rank b (one chunk per rank)."""
    _check(rank, n)
    if n == 1:
        return Schedule("reduce_scatter", "halving", rank, n, 1, BLOCK, OWN, (copy(0),))
    f = Fold(n)
    v, k = f.virtual(rank), f.k
    steps, stages = [], []
    if v is None:  # hand every other block to rank + 1; its partial of my block comes back
        for b in range(n):
            steps.append(send(b, rank + 1) if b != rank else recv_reduce_copy(b, rank + 1))
            stages.append(0 if b != rank else k + 2)
        return _sched("reduce_scatter", "halving", rank, n, n, BLOCK, OWN, steps, stages)
    extra = f.extra(v)
    for b in range(n):
        w = f.owner(b)
        if w != v:
            step, s = _reduce_step(f, v, w, b, extra)
        elif b == rank:
            srcs = ([extra] if extra is not None else []) + f.halving(v)
            step, s = recv_reduce_copy(b, srcs), k + 2
        else:  # the extra rank's block: everything but its own input, for it to finish
            step, s = recv_reduce_send(b, f.halving(v), b), k + 1
        steps.append(step)
        stages.append(s)
    return _sched("reduce_scatter", "halving", rank, n, n, BLOCK, OWN, steps, stages)


def doubling_all_gather(rank: int, n: int) -> Schedule:
    """Recursive-doubling all-gather: at stage t every rank swaps all it has with v ^ 2^(t-1)."""
    _check(rank, n)
    if n == 1:
        return Schedule("all_gather", "doubling", rank, n, 1, OWN, BLOCK, (copy(0),))
    f = Fold(n)
    v = f.virtual(rank)
    steps, stages = [], []
    if v is None:
        for b in range(n):
            steps.append(copy_send(b, rank + 1) if b == rank else recv(b, rank + 1))
            stages.append(0 if b == rank else f.k + 2)
        return _sched("all_gather", "doubling", rank, n, n, OWN, BLOCK, steps, stages)
    extra = f.extra(v)
    for b in range(n):
        w = f.owner(b)
        if b == rank:
            dsts, st = _gather_dsts(f, v, 0, extra, 0)
            steps.append(copy_send(b, dsts))
        elif b == extra:  # its block joins mine before the first exchange
            dsts, st = _gather_dsts(f, v, 0, None, 0)
            steps.append(recv_copy_send(b, extra, dsts))
        else:
            t = f.split(v, w) + 1
            dsts, st = _gather_dsts(f, v, t, extra, 0)
            frm = f.doubling(v)[t - 1]
            steps.append(recv_copy_send(b, frm, dsts) if dsts else recv(b, frm))
            st = st if dsts else f.k + 2
        stages.append(st)
    return _sched("all_gather", "doubling", rank, n, n, OWN, BLOCK, steps, stages)


def _sched(coll, algo, rank, n, nchunks, ins, outs, steps, stages):
    return Schedule(coll, algo, rank, n, nchunks, ins, outs, tuple(steps), tuple(stages))


def _check(rank: int, n: int) -> None:
    if not (isinstance(n, int) and n >= 1 and 0 <= rank < n):
        raise ValueError(f"need 0 <= rank < n, got rank={rank} n={n}")
