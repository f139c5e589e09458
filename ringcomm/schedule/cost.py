"""The alpha-beta-gamma cost of a collective, derived from its schedules.

A message costs alpha + beta * bytes to deliver; reducing a received chunk into another costs
gamma * bytes (Hockney's model with Thakur, Rabenseifner and Gropp's gamma). The schedules say
everything else:

- Messages. Each send of a step is an item of nbytes / nchunks bytes on one connection. Items a
  rank sends one peer in the same *stage* travel as one message (one alpha), as MPI would send
  them in one MPI_Send. A stage is what Schedule.stages declares for that send, or else the
  sending step's depth in the dataflow (the longest chain of messages before it): the ring's
  step k is stage k.
- Reductions. A received item consumed by a reducing step costs gamma * its bytes in the stage
  it arrives in (the textbook reduces a message when it arrives; ringcomm reduces it inside the
  step that forwards the result, which moves the same bytes).

Two ways to add it up:

- ``rounds`` (the default): the paper's synchronous rounds. A stage takes as long as its slowest
  rank, max(time to send its messages one after another, time to receive its messages) plus
  its reductions; the collective takes the sum over stages. This reproduces the paper's closed
  forms exactly (tests/test_cost.py).
- ``critical_path``: no rounds. A message leaves once its items are ready and the sender's
  previous message has left; a rank reduces what arrives in stage order; the cost is when the
  last rank is done. Never more than ``rounds``; less where ranks idle in some rounds (a
  binomial tree on a non-power-of-two world).

All arithmetic is exact when alpha, beta, gamma and nbytes are Fractions.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from . import peer_read
from .simulate import _check_pairing, _validate
from .step import TO, Schedule


@dataclass
class Cost:
    seconds: object
    alphas: object = 0      # the coefficients of the slowest path: seconds = alphas * alpha
    beta_bytes: object = 0  # + beta_bytes * beta + gamma_bytes * gamma
    gamma_bytes: object = 0
    stages: list = field(default_factory=list)  # rounds: [(stage, seconds, slowest rank)]


@dataclass
class Messages:
    size: dict     # (src, dst, stage) -> bytes
    items: dict    # (src, dst, stage) -> indices of the src's steps whose sends it carries
    reduced: dict  # (rank, stage) -> bytes received in that stage and reduced
    inputs: dict   # (rank, step index) -> the latest stage among the step's inputs, or None

    def stages(self):
        return sorted({k[2] for k in self.size} | {k[1] for k in self.reduced})


def messages(scheds: list[Schedule], nbytes) -> Messages:
    _validate(scheds)
    _check_pairing(scheds)
    # nbytes is the paper's n: the buffer of nchunks chunks, except all_to_all's n * n chunks,
    # where n is what each rank sends (n blocks of nbytes / n).
    s0 = scheds[0]
    chunk = nbytes / (s0.world_size if s0.in_layout == TO else s0.nchunks)
    for s in scheds:
        if s.stages and (len(s.stages) != len(s.steps) or any(
                isinstance(st, tuple) and len(st) != len(step.dst) for st, step in zip(s.stages, s.steps))):
            raise ValueError(f"rank {s.rank}: Schedule.stages needs one entry per step (an int, or one "
                             f"int per dst), got {s.stages} for {len(s.steps)} steps")
    depth = _depths(scheds)
    m = Messages(defaultdict(lambda: 0), defaultdict(list), defaultdict(lambda: 0), {})
    fifo = defaultdict(list)  # (a, b) -> stages of a's sends to b, in order
    for s in scheds:
        for i, st in enumerate(s.steps):
            for j, b in enumerate(st.dst):
                stage = _stage(s, i, j, depth)
                m.size[s.rank, b, stage] += chunk
                m.items[s.rank, b, stage].append(i)
                fifo[s.rank, b].append(stage)
    taken = defaultdict(int)
    for s in scheds:
        for i, st in enumerate(s.steps):
            got = []
            for a in st.src:
                stage = fifo[a, s.rank][taken[a, s.rank]]
                taken[a, s.rank] += 1
                got.append(stage)
                if st.reduces:
                    m.reduced[s.rank, stage] += chunk
            m.inputs[s.rank, i] = max(got) if got else None
            for j in range(len(st.dst)):
                if got and _stage(s, i, j, depth) <= max(got):
                    raise ValueError(f"rank {s.rank} step {i} {st}: sends in stage {_stage(s, i, j, depth)} "
                                     f"what it receives in stage {max(got)}; a send's stage must be later")
    peer_read.cost_messages(scheds, m, chunk)  # reads of registered buffers, and syncs
    m.size, m.items, m.reduced = dict(m.size), dict(m.items), dict(m.reduced)
    return m


def _stage(s: Schedule, i: int, j: int, depth) -> int:
    if not s.stages:
        return depth[s.rank, i]
    st = s.stages[i]
    return st[j] if isinstance(st, tuple) else st


def _depths(scheds):
    """Longest chain of messages before each step (Kahn's order over the matched sends)."""
    n = len(scheds)
    producers = defaultdict(list)
    sent = defaultdict(list)
    for s in scheds:
        for i, st in enumerate(s.steps):
            for b in st.dst:
                sent[s.rank, b].append((s.rank, i))
    pos = defaultdict(int)
    for s in scheds:
        for i, st in enumerate(s.steps):
            for a in st.src:
                producers[s.rank, i].append(sent[a, s.rank][pos[a, s.rank]])
                pos[a, s.rank] += 1
    depth = {}
    todo = [(r, i) for r in range(n) for i in range(len(scheds[r].steps))]
    while todo:
        left = []
        for key in todo:
            ps = producers[key]
            if all(p in depth for p in ps):
                depth[key] = 1 + max(depth[p] for p in ps) if ps else 0
            else:
                left.append(key)
        if len(left) == len(todo):
            raise ValueError(f"the schedules' messages depend on each other in a cycle at {left[:3]}")
        todo = left
    return depth


def rounds_cost(scheds, nbytes, alpha, beta, gamma) -> Cost:
    m = messages(scheds, nbytes)
    reduced = m.reduced
    out, inn = defaultdict(list), defaultdict(list)
    for (a, b, stage), size in m.size.items():
        out[a, stage].append(size)
        inn[b, stage].append(size)
    total, coef = Cost(0 * alpha), [0, 0, 0]
    for stage in m.stages():
        best = None
        for r in range(len(scheds)):
            sends, recvs = out.get((r, stage), []), inn.get((r, stage), [])
            red = reduced.get((r, stage), 0)
            terms = max([(len(sends), sum(sends)), (len(recvs), sum(recvs))],
                        key=lambda t: t[0] * alpha + t[1] * beta)
            t = terms[0] * alpha + terms[1] * beta + red * gamma
            if best is None or t > best[0]:
                best = (t, r, terms[0], terms[1], red)
        total.seconds += best[0]
        total.stages.append((stage, best[0], best[1]))
        coef = [coef[0] + best[2], coef[1] + best[3], coef[2] + best[4]]
    total.alphas, total.beta_bytes, total.gamma_bytes = coef
    return total


def critical_path_cost(scheds, nbytes, alpha, beta, gamma) -> Cost:
    m = messages(scheds, nbytes)
    n, zero = len(scheds), 0 * alpha
    done = [zero] * n                    # when each rank has reduced everything that arrived so far
    at = [dict() for _ in range(n)]      # rank -> {stage: done time after that stage}
    port = [zero] * n                    # when each rank's previous message has left
    path = [(0, 0, 0)] * n               # (alphas, beta bytes, gamma bytes) along the path to done
    ports = [(0, 0, 0)] * n
    for stage in m.stages():
        arrive = defaultdict(list)
        for (a, b, st), size in sorted((k, v) for k, v in m.size.items() if k[2] == stage):
            ready, via = zero, (0, 0, 0)
            for i in m.items[a, b, st]:
                src = m.inputs[a, i]  # the item is ready once the rank has dealt with that stage
                if src is not None and at[a][src][0] > ready:
                    ready, via = at[a][src]
            leave, base = (ready, via) if ready >= port[a] else (port[a], ports[a])
            port[a] = leave + alpha + size * beta
            ports[a] = (base[0] + 1, base[1] + size, base[2])
            arrive[b].append((port[a], ports[a]))
        for r in range(n):
            red = m.reduced.get((r, stage), 0)
            if arrive[r] or red:
                t, p = max(arrive[r] + [(done[r], path[r])], key=lambda x: x[0])
                done[r], path[r] = t + red * gamma, (p[0], p[1], p[2] + red)
                at[r][stage] = (done[r], path[r])
    end = max([(done[r], path[r]) for r in range(n)] + [(port[r], ports[r]) for r in range(n)],
              key=lambda x: x[0])
    return Cost(end[0], *end[1])


def model_cost(scheds, nbytes, alpha, beta, gamma, model: str = "rounds") -> Cost:
    if model == "rounds":
        return rounds_cost(scheds, nbytes, alpha, beta, gamma)
    if model == "critical_path":
        return critical_path_cost(scheds, nbytes, alpha, beta, gamma)
    raise ValueError(f"model must be 'rounds' or 'critical_path', got {model!r}")
