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
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
ALGOS = {"all_reduce": (None, "ring", "tree", "rabenseifner", "oneshot"),
         "broadcast": (None, "ring", "tree", "binomial"), "reduce": (None, "ring", "tree", "binomial"),
         "all_gather": (None, "ring", "doubling", "bruck"), "reduce_scatter": (None, "ring", "halving")}


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
    that every value of every axis appears; only ``big`` cases use the 2^20 + 3 count."""
    rnd = random.Random(seed)
    cases = []
    for i, (coll, dtype) in enumerate(itertools.product(COLLECTIVES, DTYPES)):
        op = OPS[(i + i // len(DTYPES)) % len(OPS)]
        algos = ALGOS[coll]
        cases.append(dict(collective=coll, dtype=dtype, op=op,
                          count=COUNTS[i % (len(COUNTS) - 1)],
                          algo=algos[(i // 2) % len(algos)],
                          root=(0, world_size - 1)[(i // 3) % 2],
                          inplace=bool(i % 2), seed=rnd.randrange(2**31)))
    for case in rnd.sample(cases, big):
        case["count"] = COUNTS[-1]
    return cases


def run_case(comm, case: dict) -> str | None:
    """Run one case on this rank; None when right, else what went wrong."""
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
