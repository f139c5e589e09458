"""Check data whose every result is exact, so #wrong counts real errors and nothing else.

Like nccl-tests' verifiable inputs, the data is a formula of (rank, element index), and so is the
expected result: no rank needs the others' data to know what it must receive. Element i of rank r's
input is table_r[i % PERIOD]; the expected output is another table of the same period. PERIOD is a
prime, so a block that lands at the wrong offset (every chunk size is a multiple of small powers of
two) shows up as wrong values.

Exactness, per op (whatever order the ranks combine in):
- sum: floats are small integers whose partial sums stay below the dtype's last exact integer
  (256 for bfloat16, 2048 for float16); integers take their whole range (wrapping addition is exact
  and order-free).
- prod: floats are +-1 with a sparse +-2 (products are small powers of two); integers wrap.
- min / max: order-free by nature.
- avg: rank r contributes c + e_r with sum over ranks of e_r == 0, so the sum is n * c and the
  average is exactly c, for floats (divide once) and integers (wrapping sum, truncating division).
"""
from __future__ import annotations

import numpy as np

PERIOD = 1021
SEED = 20240607
# The largest integer below which every integer is exact, for float dtypes (by itemsize / name).
_EXACT = {"float16": 2048, "bfloat16": 256, "float32": 2**24, "float64": 2**53}
_KMAX = 100  # floats stay within +-100 per rank: plenty of distinct values, far from any limit


def _rng(op: str, salt: int = 0) -> np.random.Generator:
    # The same generator on every rank (and in the parent): tables are a function of (op, dtype) only.
    return np.random.default_rng([SEED, "sum prod min max avg".split().index(op), salt])


def _bound(dt: np.dtype, per_rank_terms: int) -> int:
    """Largest k such that per_rank_terms values in [-k, k] add up exactly in dt."""
    return max(1, min(_KMAX, _EXACT[str(dt)] // per_rank_terms))


def _random_full(rng, dt: np.dtype, size: int) -> np.ndarray:
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=size, dtype=dt, endpoint=True)


def input_table(dt: np.dtype, op: str, n: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s input pattern: element i of its send buffer is this table[i % PERIOD]."""
    dt = np.dtype(dt)
    is_int = dt.kind in "iu"
    if op == "avg":
        return _avg_parts(dt, n)[rank]
    if op in ("sum", "prod", "min", "max") and is_int:
        base = _random_full(_rng(op), dt, PERIOD)
    elif op == "sum":
        k = _bound(dt, n)
        base = _rng(op).integers(-k, k, size=PERIOD, endpoint=True).astype(dt)
    elif op == "prod":
        rng = _rng(op)
        mag = np.where(np.arange(PERIOD) % 16 == 0, 2.0, 1.0)  # at most ceil(n/16)+1 twos per product
        base = (mag * rng.choice([-1.0, 1.0], size=PERIOD)).astype(dt)
    elif op in ("min", "max"):
        k = _bound(dt, 1)
        base = _rng(op).integers(-k, k, size=PERIOD, endpoint=True).astype(dt)
    else:
        raise ValueError(f"unknown op {op!r}")
    # Ranks differ by a rotation of one table: element i of rank r is base[(i + r) % PERIOD].
    return np.roll(base, -rank)


def _avg_parts(dt: np.dtype, n: int) -> list[np.ndarray]:
    rng = _rng("avg")
    if dt.kind in "iu":
        info = np.iinfo(dt)
        k = max(1, min(_KMAX, info.max // n))   # n * c must not wrap
        lo = 0 if dt.kind == "u" else -k
        c = rng.integers(lo, k, size=PERIOD, endpoint=True).astype(dt)
        e = [_random_full(rng, dt, PERIOD) for _ in range(n - 1)]
    else:
        k = _bound(dt, 3 * n)  # |partial sums| <= n|c| + 2 * sum|e_r| <= 3nk
        c = rng.integers(-k, k, size=PERIOD, endpoint=True).astype(dt)
        e = [rng.integers(-k, k, size=PERIOD, endpoint=True).astype(dt) for _ in range(n - 1)]
    with np.errstate(over="ignore"):
        last = -np.sum(np.stack(e), axis=0, dtype=dt) if e else np.zeros(PERIOD, dt)  # wraps for ints
        return [c + x for x in e] + [(c + last).astype(dt)]


def avg_expected(dt: np.dtype, n: int) -> np.ndarray:
    rng = _rng("avg")
    dt = np.dtype(dt)
    if dt.kind in "iu":
        k = max(1, min(_KMAX, np.iinfo(dt).max // n))
        lo = 0 if dt.kind == "u" else -k
    else:
        k = _bound(dt, 3 * n)
        lo = -k
    return rng.integers(lo, k, size=PERIOD, endpoint=True).astype(dt)


def reduced_table(dt: np.dtype, op: str, n: int) -> np.ndarray:
    """The pattern of the reduction over all n ranks' inputs."""
    dt = np.dtype(dt)
    if op == "avg":
        return avg_expected(dt, n)
    tables = [input_table(dt, op, n, r) for r in range(n)]
    if dt.kind in "iu":
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        acc = tables[0].copy()
        with np.errstate(over="ignore"):
            for t in tables[1:]:
                ufunc(acc, t, out=acc)  # wraps in the dtype, as the collective does
        return acc
    wide = np.stack([t.astype(np.float64) for t in tables])
    return {"sum": wide.sum(0), "prod": wide.prod(0), "min": wide.min(0), "max": wide.max(0)}[op].astype(dt)


def fill_tiled(dst: np.ndarray, table: np.ndarray, start: int = 0) -> None:
    """dst[i] = table[(start + i) % PERIOD], by doubling copies (no temporary the size of dst)."""
    size = dst.size
    if size == 0:
        return
    first = np.roll(table, -(start % PERIOD))
    k = min(PERIOD, size)
    dst[:k] = first[:k]
    filled = k
    while filled < size:  # dst[:filled] is whole periods, so copying it keeps the pattern
        k = min(filled, size - filled)
        dst[filled:filled + k] = dst[:k]
        filled += k


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def count_wrong(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements whose bits differ (so -0.0 vs 0.0 and NaNs count as what they are)."""
    if result.shape != expected.shape or result.dtype != expected.dtype:
        raise ValueError(f"result {result.dtype}{result.shape} and expected {expected.dtype}{expected.shape} differ")
    return int(np.count_nonzero(_bits(result) != _bits(expected)))


def poison(out: np.ndarray, expected: np.ndarray) -> None:
    """Fill ``out`` with the bitwise complement of what it should receive: an element the collective
    never writes is then wrong for certain (nccl-tests zeroes it, which can match by chance)."""
    np.invert(_bits(expected), out=_bits(out))
