"""The collective test matrix: case generation, inputs, and the numpy reference.

Inputs are chosen so that every result is exact whatever the reduction order,
as nccl-tests' verifiable inputs are: integers are random over their whole
range (wrapping arithmetic is exact and order-free), floats are small integers
(sums of up to 8 stay exact even in fp16 and bf16) and PROD multiplies powers of
two. Only AVG on floats rounds: its tolerance is one rounding of the dtype.
"""
from __future__ import annotations

import itertools
import random

import ml_dtypes
import numpy as np

from ringcomm.kernels.host import reference_reduce

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "uint32", "int64", "uint64")
OPS = ("sum", "prod", "min", "max", "avg")
COUNTS = (0, 1, 7, 1000, 2**20 + 3)
BLOCK_COLLECTIVES = ("all_to_all", "gather", "scatter")  # move blocks, reduce nothing: run_block_case
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce") + BLOCK_COLLECTIVES
ALGOS = {"all_reduce": (None, "ring", "tree", "rabenseifner", "oneshot"),
         "broadcast": (None, "ring", "tree", "binomial"), "reduce": (None, "ring", "tree", "binomial"),
         "all_gather": (None, "ring", "doubling", "bruck"), "reduce_scatter": (None, "ring", "halving"),
         "all_to_all": (None, "pairwise", "bruck"), "gather": (None, "linear", "binomial"),
         "scatter": (None, "linear", "binomial")}
# all_to_all's blocks: world_size equal ones, or packed counts (random), or packed counts with
# zeros in every row and column (a rank's block to itself among them) and a rank sending nothing.
A2A_COUNTS = ("equal", "packed", "zeros")


def dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(case: dict, rank: int, size: int) -> np.ndarray:
    dt = dtype_of(case["dtype"])
    rng = np.random.default_rng([case["seed"], rank])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=size, dtype=dt, endpoint=True)
    if case["op"] == "prod":
        return rng.choice(np.array([-2, -1, 1, 2], np.float32), size=size).astype(dt)
    return rng.integers(-4, 5, size=size).astype(dt)


def reference(case: dict, inputs: list[np.ndarray]) -> np.ndarray:
    dt = dtype_of(case["dtype"])
    if dt.kind in "iu" or case["op"] != "avg":
        return reference_reduce(inputs, case["op"])
    total = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    return (total / len(inputs)).astype(dt)


def sample_cases(world_size: int, seed: int, big: int = 2) -> list[dict]:
    """Every collective x dtype once, ops / counts / algorithms / roots / placement cycled so
    that every value of every axis appears; only ``big`` cases use the 2^20 + 3 count, and (if
    big) one more among the block collectives. The block collectives' cases come after the
    others' random draws, so those stay what they were before all_to_all, gather and scatter."""
    rnd = random.Random(seed)
    cases = []
    first_block = COLLECTIVES.index(BLOCK_COLLECTIVES[0]) * len(DTYPES)
    for i, (coll, dtype) in enumerate(itertools.product(COLLECTIVES, DTYPES)):
        if i == first_block:
            for case in rnd.sample(cases, big):
                case["count"] = COUNTS[-1]
        op = OPS[(i + i // len(DTYPES)) % len(OPS)]
        algos = ALGOS[coll]
        cases.append(dict(collective=coll, dtype=dtype, op=op,
                          count=COUNTS[i % (len(COUNTS) - 1)],
                          algo=algos[(i // 2) % len(algos)],
                          root=(0, world_size - 1)[(i // 3) % 2],
                          inplace=bool(i % 2), seed=rnd.randrange(2**31)))
    for case in rnd.sample(cases[first_block:], min(big, 1)):
        case["count"] = COUNTS[-1]
    for i, case in enumerate(c for c in cases if c["collective"] == "all_to_all"):
        # Bruck moves equal blocks only (packed counts refuse it: test_api checks that)
        case["counts"] = "equal" if case["algo"] == "bruck" else A2A_COUNTS[i % len(A2A_COUNTS)]
    return cases


def run_case(comm, case: dict) -> str | None:
    """Run one case on this rank; None when right, else what went wrong."""
    if case["collective"] in BLOCK_COLLECTIVES:
        return run_block_case(comm, case)
    got, want = call_case(comm, case)
    return compare(got, want, case)


def call_case(comm, case: dict):
    """(this rank's result, what it must be) for one case."""
    n, r = comm.world_size, comm.rank
    coll, count, root = case["collective"], case["count"], case["root"]
    insize = count * n if coll == "reduce_scatter" else count
    inputs = [make_input(case, k, insize) for k in range(n)]
    x = inputs[r].copy()
    kw = {"algo": case["algo"]}
    if coll == "all_reduce":
        out = None if case["inplace"] else np.empty_like(x)
        got = comm.all_reduce(x, case["op"], out=out, **kw)
        want = reference(case, inputs)
    elif coll == "reduce":
        out = None if case["inplace"] else np.zeros_like(x)
        got = comm.reduce(x, root, case["op"], out=out, **kw)
        want = reference(case, inputs) if r == root else (inputs[r] if case["inplace"] else np.zeros_like(x))
    elif coll == "broadcast":
        got = comm.broadcast(x, root, **kw)
        want = inputs[root]
    elif coll == "all_gather":
        out = np.empty(count * n, x.dtype)
        if case["inplace"]:
            out[r * count:(r + 1) * count] = x
            x = out[r * count:(r + 1) * count]
        got = comm.all_gather(x, out, **kw)
        want = np.concatenate(inputs)
    else:
        out = x[r * count:(r + 1) * count] if case["inplace"] else np.empty(count, x.dtype)
        got = comm.reduce_scatter(x, out, case["op"], **kw)
        want = reference(case, inputs)[r * count:(r + 1) * count]
    return got, want


def compare(got: np.ndarray, want: np.ndarray, case: dict) -> str | None:
    if got.shape != want.shape:
        return f"{case}: shape {got.shape} != {want.shape}"
    dt = got.dtype
    if dt.kind in "iu" or case["op"] != "avg":
        bad = ~((got == want) | (np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))))
    else:
        eps = float(np.finfo(dt).eps) if dt != dtype_of("bfloat16") else 2.0 ** -7
        g, w = got.astype(np.float64), want.astype(np.float64)
        bad = np.abs(g - w) > eps * np.abs(w) + 1e-30
    if bad.any():
        i = int(np.argmax(bad))
        return f"{case}: {int(bad.sum())} wrong of {got.size}, first at {i}: got {got[i]!r} want {want[i]!r}"
    return None


def run_cases(comm, cases: list[dict]) -> list[str]:
    return [err for err in (run_case(comm, c) for c in cases) if err]


def block_size(case: dict, n: int) -> int:
    """The block of all_to_all, gather and scatter: the case's count, but the large count is the
    whole n-block buffer (odd blocks), so a reference holds ~2^20 elements, not n times that."""
    count = case["count"]
    return count if count < COUNTS[-1] else (count // n) | 1


def a2a_counts(case: dict, n: int) -> list[list[int]]:
    """C[i][j]: how many elements rank i sends rank j (every rank computes the same matrix)."""
    b = block_size(case, n)
    if case.get("counts", "equal") == "equal":
        return [[b] * n for _ in range(n)]
    rnd = random.Random(case["seed"])
    c = [[rnd.randint(0, 2 * b) for _ in range(n)] for _ in range(n)]
    if case["counts"] == "zeros":
        shift = case["seed"] % n
        for i in range(n):
            c[i][(i + shift) % n] = 0  # shift 0: every rank's block to itself is empty
        if n > 1:
            c[n - 1] = [0] * n          # and one rank sends nothing at all
    return c


def _as_given(counts: list[int], style: int):
    """Counts as a list, a tuple or an integer array, as the API takes them."""
    return (list, tuple, lambda c: np.array(c, np.int64), lambda c: np.array(c, np.int32))[style % 4](counts)


def run_block_case(comm, case: dict, dev=lambda a: a, host=lambda a, dtype: a) -> str | None:
    """all_to_all, gather or scatter; ``dev`` / ``host`` move arrays to and from the buffers under
    test (device_cases.py). None when right, else what went wrong."""
    n, r = comm.world_size, comm.rank
    coll, root, kw = case["collective"], case["root"], {"algo": case["algo"]}
    count = block_size(case, n)
    exact = {**case, "op": "sum"}  # blocks are moved, never combined: bit for bit
    if coll == "all_to_all":
        c = a2a_counts(case, n)
        inputs = [make_input(case, i, sum(c[i])) for i in range(n)]
        want = np.concatenate([inputs[i][sum(c[i][:r]):sum(c[i][:r + 1])] for i in range(n)])
        got = dev(np.zeros_like(want))
        if case.get("counts", "equal") != "equal":
            kw.update(send_counts=_as_given(c[r], case["seed"]),
                      recv_counts=_as_given([c[i][r] for i in range(n)], case["seed"] + 1))
        comm.all_to_all(dev(inputs[r]), got, **kw)
    elif coll == "gather":
        mine = make_input(case, r, count)
        if r != root:
            res = comm.gather(dev(mine), root=root, **kw)
            return None if res is None else f"{case}: gather returned {res!r} on a rank other than the root"
        want = np.concatenate([make_input(case, k, count) for k in range(n)])
        whole = np.zeros_like(want)
        whole[r * count:(r + 1) * count] = mine
        got = dev(whole)
        x = got[r * count:(r + 1) * count] if case["inplace"] else dev(mine)
        comm.gather(x, got, root, **kw)
    else:
        src = make_input(case, root, n * count)
        want = src[r * count:(r + 1) * count]
        if r == root:
            whole = dev(src)
            got = whole[r * count:(r + 1) * count] if case["inplace"] else dev(np.zeros_like(want))
            comm.scatter(whole, got, root, **kw)
        else:
            got = dev(np.zeros_like(want))
            comm.scatter(None, got, root, **kw)
    return compare(host(got, want.dtype), want, exact)


ENGINES = ("native", "python")


def run_cases_on_engines(comm, cases: list[dict]) -> list[str]:
    """Every case on the native engine, then on the reference engine (ringcomm.executor): both
    must be right, and give the same bits. Where the native engine does not apply (tcp links),
    both runs take the reference engine and agree trivially."""
    n = comm.world_size
    if not all(comm.transport_to(p) == "shm" for p in range(n) if p != comm.rank):
        return run_cases(comm, cases)
    errors = []
    for case in cases:
        if case["collective"] in BLOCK_COLLECTIVES:  # checked against numpy on each engine
            for engine in ENGINES:
                comm._executor.engine = engine
                err = run_block_case(comm, case)
                if err:
                    errors.append(f"[{engine} engine] {err}")
            continue
        results = {}
        for engine in ENGINES:
            comm._executor.engine = engine
            got, want = call_case(comm, case)
            err = compare(got, want, case)
            if err:
                errors.append(f"[{engine} engine] {err}")
            results[engine] = got.tobytes()
        if results["native"] != results["python"]:
            errors.append(f"{case}: the native and python engines' results differ")
    comm._executor.engine = ENGINES[0]
    return errors
