"""Soundness against the real executor: verify never certifies a schedule that computes a wrong
result, in either buffer form, or that hangs.

Built-in schedules are mutated at random (a step's kind changed within what its peers allow,
two neighbouring steps swapped, a chunk index moved); every mutant that verify certifies is run
by ringcomm's own Executor, one thread per rank, over in-memory FIFOs with the transports'
Connection contract (acquire / post, wait / release, ``nslots`` slots), out of place and in
place, with inputs whose sums and averages are exact in any order. A mutant whose failures show
only in place must also be right out of place. Unmutated built-ins run the same way.
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from ringcomm import catalogue
from ringcomm.executor import Call, Executor
from ringcomm.schedule.spec import IN_PLACE, OUT_OF_PLACE, spec
from ringcomm.schedule.step import KINDS, Step
from ringcomm.schedule.verify import verify_schedules
from ringcomm.transport.base import PeerTimeout

NSLOTS, SLOT_BYTES = 4, 8      # one float64 a slot: a step moves 1 or 2 slices, as verify's shapes
TIMEOUT = 20.0                 # a hang is a failure: far beyond what these tiny calls take


class _Fifo:
    """One direction of one pair of ranks: ``nslots`` slots, busy from acquire to release."""

    def __init__(self, receiver: int, sender: int):
        self.cv, self.queue, self.used = threading.Condition(), [], 0
        self.to, self.frm = receiver, sender  # the peer each end waits for, for PeerTimeout

    def _until(self, ready, deadline, peer):
        with self.cv:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout("in-memory FIFO", peer=peer, transport="mem")
                self.cv.wait(left)

    def acquire(self, deadline):
        self._until(lambda: self.used < NSLOTS, deadline, self.to)
        with self.cv:
            self.used += 1
        return np.zeros(SLOT_BYTES, np.uint8)

    def wait(self, deadline):
        self._until(lambda: bool(self.queue), deadline, self.frm)
        return self.queue[0]

    def release(self):
        with self.cv:
            self.queue.pop(0)
            self.used -= 1
            self.cv.notify_all()


class _Send:
    """The sender's end: remembers the slot it acquired, posts its payload."""

    def __init__(self, fifo):
        self.fifo, self.slot = fifo, None

    def acquire(self, deadline):
        self.slot = self.fifo.acquire(deadline)
        return self.slot

    def post(self, nbytes):
        with self.fifo.cv:
            self.fifo.queue.append(self.slot[:nbytes].copy())
            self.fifo.cv.notify_all()


class _Links:
    def __init__(self, rank, fifos):
        self.rank, self.fifos, self.call = rank, fifos, None
        self.sends = {}

    def __call__(self, peer, direction):
        if direction == "recv":
            return self.fifos[peer, self.rank]
        return self.sends.setdefault(peer, _Send(self.fifos[self.rank, peer]))

    def prepare(self, srcs, dsts):
        pass


def execute(collective, scheds, root, form, count, rng):
    """Run the schedules on the real executor; None when every rank is right, else what is wrong."""
    n = len(scheds)
    fifos = {(a, b): _Fifo(b, a) for a in range(n) for b in range(n) if a != b}
    size = count * n if collective in ("reduce_scatter", "all_to_all") else count
    if collective == "scatter":
        size = count * n
    inputs = [rng.integers(-1000, 1000, size).astype(np.float64) for _ in range(n)]
    bufs, results, errors = {}, {}, []
    for r in range(n):
        x = inputs[r].copy()
        if collective in ("gather", "scatter", "all_to_all"):
            inp, out = _block_buffers(collective, x, r, root, n, count, form)
        elif collective == "all_gather":
            out = np.zeros(n * count)
            inp = out[r * count:(r + 1) * count] if form == IN_PLACE else x
            inp[...] = inputs[r]
        elif collective == "reduce_scatter":
            inp, out = x, (x[r * count:(r + 1) * count] if form == IN_PLACE else np.zeros(count))
        else:
            inp, out = x, (x if form == IN_PLACE or collective == "broadcast" else np.zeros(count))
        bufs[r] = (inp, out)

    def run(r):
        try:
            ex = Executor(r, n, _Links(r, fifos), TIMEOUT, SLOT_BYTES, NSLOTS)
            inp, out = bufs[r]
            ex.run(scheds[r], Call(collective, 1, inp, out, count, "avg" if spec(collective).reduces else "sum"))
            results[r] = out
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 5)
    if errors or any(t.is_alive() for t in threads):
        return f"{form}: " + ("; ".join(errors) or "a rank never finished")
    for r in range(n):
        want = _expected(collective, inputs, r, root, count)
        if collective == "reduce" and r != root:  # in place its buffer is its input, untouched
            want = inputs[r] if form == IN_PLACE else None
        if collective == "gather" and r != root:  # no result: its out is not the API's
            want = None
        if want is not None and not np.array_equal(results[r], want):
            return f"{form}: rank {r} got {results[r][:8]} want {want[:8]}"
    return None


def _block_buffers(collective, x, r, root, n, count, form):
    """(inp, out) of all_to_all, gather, scatter; in place only on the root, as the API allows.
    A rank without the root's buffer gets a stand-in its steps never touch, as comm.py passes."""
    if collective == "all_to_all":
        return x, np.zeros(n * count)
    if collective == "gather":
        out = np.zeros(n * count)
        if form == IN_PLACE and r == root:
            out[r * count:(r + 1) * count] = x
            return out[r * count:(r + 1) * count], out
        return x, out
    if r != root:
        out = np.zeros(count)
        return out, out
    return x, (x[r * count:(r + 1) * count] if form == IN_PLACE else np.zeros(count))


def _expected(collective, inputs, r, root, count):
    n = len(inputs)
    if collective == "all_to_all":
        return np.concatenate([x[r * count:(r + 1) * count] for x in inputs])
    if collective == "gather":
        return np.concatenate(inputs)
    if collective == "scatter":
        return inputs[root][r * count:(r + 1) * count]
    if collective in ("all_reduce", "reduce"):
        return sum(inputs) / n
    if collective == "reduce_scatter":
        return (sum(inputs) / n)[r * count:(r + 1) * count]
    if collective == "all_gather":
        return np.concatenate(inputs)
    return inputs[root]


# ---- mutations --------------------------------------------------------------------------------

def _same_shape_kinds(step):
    """Kinds that receive and send exactly where ``step`` does, so both ends still pair up."""
    recv, _, _, send = KINDS[step.kind]
    return [k for k, (r, red, _, s) in KINDS.items() if (r, s) == (recv, send) and (red or len(step.src) < 2)]


def mutate(scheds, rnd):
    scheds = list(scheds)
    r = rnd.randrange(len(scheds))
    steps = list(scheds[r].steps)
    if not steps:
        return scheds
    i, how = rnd.randrange(len(steps)), rnd.choice(("kind", "kind", "swap", "chunk"))
    st = steps[i]
    if how == "kind":
        steps[i] = Step(rnd.choice(_same_shape_kinds(st)), st.chunk, st.src, st.dst)
    elif how == "swap" and i + 1 < len(steps):
        steps[i], steps[i + 1] = steps[i + 1], st
    elif how == "chunk":
        steps[i] = Step(st.kind, rnd.randrange(scheds[r].nchunks), st.src, st.dst)
    scheds[r] = scheds[r].__class__(**{**scheds[r].__dict__, "steps": tuple(steps)})
    return scheds


# The read algorithms run only on registered buffers, not over FIFOs: tests/test_registered.py.
BUILTIN = sorted((c, a) for c, algos in catalogue.ALGOS.items() for a in algos
                 if a not in catalogue.REGISTERED_ONLY)


def _case(rnd):
    collective, algo = rnd.choice(BUILTIN)
    n = rnd.choice((2, 3, 4, 5))
    root = rnd.randrange(n) if spec(collective).rooted else None
    return collective, algo, n, root


@pytest.mark.timeout(300)
def test_builtins_run_right_in_every_form_on_the_executor():
    rng = np.random.default_rng(1)
    for collective, algo in BUILTIN:
        for n in (2, 3, 5):
            root = n - 1 if spec(collective).rooted else None
            scheds = catalogue.schedules(collective, algo, n, root)
            for form in spec(collective).forms:
                assert execute(collective, scheds, root, form, 11, rng) is None, (collective, algo, n, form)


@pytest.mark.timeout(600)
def test_verify_never_certifies_a_mutant_the_executor_gets_wrong():
    rnd, rng = random.Random(14), np.random.default_rng(14)
    certified = in_place_only = 0
    for trial in range(400):
        collective, algo, n, root = _case(rnd)
        scheds = catalogue.schedules(collective, algo, n, root)
        for _ in range(rnd.choice((1, 1, 2))):
            scheds = mutate(scheds, rnd)
        count = rnd.choice((1, 5, 13))
        rep = verify_schedules(collective, scheds, count, root=root, nslots=NSLOTS)
        forms = spec(collective).forms
        if rep.ok:
            certified += 1
            for form in forms:
                bad = execute(collective, scheds, root, form, count, rng)
                assert bad is None, f"verify certified {collective}/{algo} n={n} root={root}: {bad}\n" \
                                    + "\n".join(map(str, scheds))
        elif OUT_OF_PLACE in forms and rep.failures and all(f.form == IN_PLACE for f in rep.failures):
            in_place_only += 1
            bad = execute(collective, scheds, root, OUT_OF_PLACE, count, rng)
            assert bad is None, f"{rep.summary()}\nbut out of place: {bad}"
    assert certified >= 40 and in_place_only >= 5, (certified, in_place_only)  # not vacuous
