"""The cost model at the user's level: cost(), fit() to ringcomm-bench figures, automatic choice.

    ringcomm.cost("all_reduce", "ring", 8, 2**20, alpha=2e-5, beta=2e-10, gamma=3e-10)
    params = ringcomm.fit("bench.json")            # or rows of (collective, algo, n, nbytes, seconds)

cost() builds every rank's schedule of the named algorithm and runs schedule/cost.py over
them (see there for the model). fit() finds the alpha, beta, gamma (all >= 0) that best explain
measured times in relative terms: each row contributes (model / measured - 1)^2, so a 20 us call
weighs as much as a 20 ms one. The model's time is linear in the three for a fixed slowest path,
so fit() solves a small nonnegative least-squares problem, recomputes the paths with the result
and repeats until they settle.

Automatic choice (algo=None): among AUTO's algorithms for the collective, the one the model
says is fastest at this world size and message size, with the parameters of RINGCOMM_MODEL (a
JSON file as written by ``fit(...).save(path)``) or else DEFAULT. RINGCOMM_DEBUG=info prints the
choice and the modelled times to stderr once per collective, world size and power-of-two size class.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache

from . import catalogue
from .schedule.cost import Cost, model_cost

# Fitted on this machine kind (2 cores, shm): see docs/cost_model.md for the run.
DEFAULT = {"alpha": 3.0e-5, "beta": 2.5e-10, "gamma": 4.0e-10}
# Algorithms automatic choice may pick. The model prices messages, not the executor's steps:
# it ranks Rabenseifner first from 4 ranks up, but ringcomm runs it chunk by chunk (no scratch)
# and ringcomm-bench measures it slower than the ring here (docs/cost_model.md), so automatic
# choice keeps to the algorithms whose executor cost the model tracks. Widen it at your own risk
# (never with oneshot from 3 ranks: its ranks combine in different orders). Recursive doubling
# ("doubling") joins where the op commutes bit for bit (_choose): its partners combine S op P and
# P op S, which differ only for float min / max at signed zeros. It is fast where the model says:
# on 4 ranks sharing 2 cores, 8 B-32 KiB took 12-27 us against the ring's 19-36, but 48 KiB was
# level (31-39 against 39-42) and 96-128 KiB slower (54-81 against 45-65), where the model, whose
# alpha was fitted on 2 ranks, still prices it cheaper. So automatic choice offers it up to 32 KiB
# (ringcomm-bench all_reduce -n 4 --algo ring,doubling, 2026-12-04).
# all_to_all: pairwise or Bruck (fewer, larger messages: small blocks on many ranks); with packed
# counts always a direct algorithm (vcounts.direct_algo), never the model's pick.
DOUBLING_AUTO_MAX_BYTES = 32 * 1024
AUTO = {"all_reduce": ("ring", "tree"), "reduce_scatter": ("ring",), "all_gather": ("ring",),
        "broadcast": ("ring", "tree"), "reduce": ("ring", "tree"), "all_to_all": ("pairwise", "bruck"),
        "gather": ("linear", "binomial"), "scatter": ("linear", "binomial")}


@dataclass
class Params:
    alpha: float
    beta: float
    gamma: float
    rows: int = 0
    rms_relative_error: float = 0.0

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)


def cost_breakdown(collective, algo, world_size, nbytes, alpha, beta, gamma, *, root=None,
                   model="rounds") -> Cost:
    """cost() with its parts: Cost.seconds, the coefficients of alpha, beta, gamma along the slowest
    path (alphas, beta_bytes, gamma_bytes) and, for rounds, each stage's time and slowest rank."""
    if not (isinstance(nbytes, (int, float)) or hasattr(nbytes, "denominator")) or nbytes < 0:
        raise ValueError(f"nbytes must be a number >= 0, got {nbytes!r}")
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    if model not in ("rounds", "critical_path"):
        raise ValueError(f"model must be 'rounds' or 'critical_path', got {model!r}")
    if collective in catalogue.ROOTED and root is None:
        root = 0
    scheds = catalogue.schedules(collective, algo, world_size, root)
    return model_cost(scheds, nbytes, alpha, beta, gamma, model)


def cost(collective, algo, world_size, nbytes, alpha, beta, gamma, *, root=None, model="rounds"):
    """Modelled seconds of one call: ``nbytes`` is the vector of all_reduce, broadcast and reduce,
    the gathered output of all_gather and gather, the input of reduce_scatter and scatter, what each
    rank sends in all_to_all (the paper's n)."""
    return cost_breakdown(collective, algo, world_size, nbytes, alpha, beta, gamma, root=root,
                          model=model).seconds


def load_bench(path) -> list[tuple]:
    """Rows (collective, algo, n, nbytes, seconds) of a ``ringcomm-bench --json`` file, out-of-place
    times: each algorithm run by name, and the rows run with automatic choice under the algorithm
    it ran (recorded per row as "ran"; a file written before that was recorded has no such rows)."""
    with open(path) as f:
        doc = json.load(f)
    try:
        coll, n = doc["config"]["collective"], int(doc["config"]["ranks"])
        runs = doc["ringcomm"]["rows"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a ringcomm-bench --json file (missing {e})") from None
    out = []
    for label, rows in runs.items():
        for r in rows:
            algo = r["oop"].get("ran") if label == "auto" else label
            if r["size"] > 0 and algo in catalogue.names(coll):
                out.append((coll, algo, n, int(r["size"]), float(r["oop"]["seconds"])))
    return out


def fit(data, *, model="rounds", iterations=5) -> Params:
    """alpha, beta, gamma from measurements: ``data`` is a ringcomm-bench JSON path, a list of them,
    or rows (collective, algo, n, nbytes, seconds)."""
    rows = _rows(data)
    if len(rows) < 3:
        raise ValueError(f"fit needs at least 3 measurements with nbytes > 0, got {len(rows)}")
    guess = (DEFAULT["alpha"], DEFAULT["beta"], DEFAULT["gamma"])
    for _ in range(iterations):
        feats = [_features(r, guess, model) for r in rows]
        new = _nnls([[f / r[4] for f in fs] for fs, r in zip(feats, rows)], [1.0] * len(rows))
        if all(abs(a - b) <= 1e-9 * max(abs(b), 1e-30) for a, b in zip(new, guess)):
            break
        guess = tuple(new)
    errs = [cost(*r[:4], *guess, model=model) / r[4] - 1 for r in rows]
    return Params(*guess, rows=len(rows), rms_relative_error=(sum(e * e for e in errs) / len(errs)) ** 0.5)


def _rows(data):
    if isinstance(data, (str, os.PathLike)):
        return load_bench(data)
    rows = []
    for item in data:
        if isinstance(item, (str, os.PathLike)):
            rows += load_bench(item)
        else:
            coll, algo, n, nbytes, seconds = item
            if seconds <= 0:
                raise ValueError(f"measured seconds must be > 0, got {item!r}")
            rows.append((coll, algo, int(n), nbytes, float(seconds)))
    return [r for r in rows if r[3] > 0]


def _features(row, params, model):
    c = cost_breakdown(*row[:4], *params, model=model)
    return [float(c.alphas), float(c.beta_bytes), float(c.gamma_bytes)]


def _nnls(a, b):
    """min |A x - b| with x >= 0 for three unknowns: the best of every subset of free variables."""
    import numpy as np
    A, B = np.asarray(a, float), np.asarray(b, float)
    scale = np.maximum(np.abs(A).max(axis=0), 1e-300)
    best = (np.inf, np.zeros(A.shape[1]))
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            x, *_ = np.linalg.lstsq(A[:, cols] / scale[list(cols)], B, rcond=None)
            if (x >= 0).all():
                full = np.zeros(A.shape[1])
                full[list(cols)] = x / scale[list(cols)]
                err = float(((A @ full - B) ** 2).sum())
                if err < best[0]:
                    best = (err, full)
    return [float(v) for v in best[1]]


def params_from_env() -> tuple:
    return _params(os.environ.get("RINGCOMM_MODEL", ""))


@lru_cache(maxsize=8)
def _params(path: str) -> tuple:
    if not path:
        return DEFAULT["alpha"], DEFAULT["beta"], DEFAULT["gamma"]
    try:
        with open(path) as f:
            doc = json.load(f)
        return float(doc["alpha"]), float(doc["beta"]), float(doc["gamma"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"RINGCOMM_MODEL={path!r}: cannot read alpha, beta, gamma from it: {e}") from None


def choose(collective: str, world_size: int, nbytes: int, params=None, *, swap_safe: bool = True) -> str:
    """The AUTO algorithm the model says is fastest; ties go to the earlier one in AUTO.

    ``swap_safe``: whether ``a op b`` and ``b op a`` give the same bits for the call's op and
    dtype. IEEE + and * commute exactly, integer min and max too; float min and max do not where
    the operands are +0.0 and -0.0 (fmin, like NCCL's fminf, returns either zero). Where they do
    not, one-shot (whose two ranks combine in opposite orders) is not offered, so that every rank
    still gets the same bits."""
    params = params_from_env() if params is None else tuple(params)
    size_class = max(0, int(nbytes) - 1).bit_length()  # one choice per power-of-two band
    algo, times = _choose(collective, world_size, size_class, params, swap_safe)
    if "info" in os.environ.get("RINGCOMM_DEBUG", "").lower().split(","):
        _log_once(collective, world_size, size_class, algo, times, params)
    return algo


def log_override(collective: str, world_size: int, nbytes: int, chosen: str, ran: str, why: str) -> None:
    """RINGCOMM_DEBUG=info: automatic choice ran ``ran``, not the model's ``chosen``, and why (once
    per collective, world size and power-of-two size band)."""
    if "info" not in os.environ.get("RINGCOMM_DEBUG", "").lower().split(","):
        return
    size_class = max(0, int(nbytes) - 1).bit_length()
    key = (collective, world_size, size_class, "ran", ran)
    if key in _logged:
        return
    _logged.add(key)
    print(f"{_band(collective, world_size, size_class)}runs {ran}, not the model's {chosen}: {why}",
          file=sys.stderr, flush=True)


MODEL_MAX_RANKS = 64  # above this, building every rank's schedule takes too long for a first call


@lru_cache(maxsize=1024)
def _choose(collective, world_size, size_class, params, swap_safe=True):
    nbytes = 1 << size_class
    names = [a for a in AUTO.get(collective, ()) if a in catalogue.names(collective)]
    if collective == "all_reduce" and swap_safe:
        # Two ranks combine a op b and b op a: the same bits where the op commutes bit for bit
        # (choose's swap_safe), so one-shot's single hop is safe there, and it halves small-message
        # latency; so is recursive doubling, whose partners do the same at every stage.
        if world_size == 2:
            names.append("oneshot")
        elif nbytes <= DOUBLING_AUTO_MAX_BYTES:
            names.append("doubling")
    if world_size > MODEL_MAX_RANKS:  # NCCL's rule of thumb: trees for latency, rings for bandwidth
        pick = "tree" if "tree" in names and nbytes <= 64 * 1024 else names[0]
        return pick, {}
    times = {a: cost(collective, a, world_size, nbytes, *params) for a in names}
    return min(names, key=lambda a: (times[a], names.index(a))), times


_logged: set = set()


def _log_once(collective, world_size, size_class, algo, times, params):
    key = (collective, world_size, size_class)
    if key in _logged:
        return
    _logged.add(key)
    shown = ", ".join(f"{a} {t * 1e6:.1f} us" for a, t in sorted(times.items(), key=lambda kv: kv[1])) \
        or f"more than {MODEL_MAX_RANKS} ranks: tree up to 64 KiB, else ring, without the model"
    print(f"{_band(collective, world_size, size_class)}chose {algo} (model alpha={params[0]:.3g} s, "
          f"beta={params[1]:.3g} s/B, gamma={params[2]:.3g} s/B: {shown})", file=sys.stderr, flush=True)


def _band(collective: str, world_size: int, size_class: int) -> str:
    """The head of an INFO line: the call and its power-of-two size band."""
    lo = 1 << (size_class - 1) if size_class else 0
    return f"ringcomm INFO: {collective} on {world_size} ranks, {lo + 1 if lo else 0}..{1 << size_class} B: "
