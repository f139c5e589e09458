"""The algorithm catalogue: every collective's algorithms by name, built-in and registered.

One module that the communicator, the cost model, the registration API, the verifier's front
end, ringcomm-viz and ringcomm-bench all read, and that imports nothing of the project but the
schedules. ``ringcomm.algorithms`` adds and removes users' algorithms through add() / remove().
"""
from __future__ import annotations

from functools import lru_cache

from .schedule import alltoall, direct, onecopy, recursive, ring, rooted, tree
from .schedule.step import Schedule

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "gather",
               "scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")

# Algorithms per collective; the first is the fallback when RINGCOMM_ALGO names
# one that the collective does not have.
ALGOS: dict[str, dict] = {
    "all_reduce": {"ring": ring.ring_all_reduce, "tree": tree.tree_all_reduce,
                   "rabenseifner": recursive.rabenseifner_all_reduce, "oneshot": direct.oneshot_all_reduce,
                   "doubling": recursive.doubling_all_reduce},
    "reduce_scatter": {"ring": ring.ring_reduce_scatter, "halving": recursive.halving_reduce_scatter},
    "all_gather": {"ring": ring.ring_all_gather, "doubling": recursive.doubling_all_gather,
                   "bruck": direct.bruck_all_gather},
    "broadcast": {"ring": ring.ring_broadcast, "tree": tree.tree_broadcast, "binomial": direct.binomial_broadcast},
    "reduce": {"ring": ring.ring_reduce, "tree": tree.tree_reduce, "binomial": direct.binomial_reduce},
    "all_to_all": {"pairwise": alltoall.pairwise_all_to_all, "bruck": alltoall.bruck_all_to_all},
    "gather": {"linear": rooted.linear_gather, "binomial": rooted.binomial_gather},
    "scatter": {"linear": rooted.linear_scatter, "binomial": rooted.binomial_scatter},
}
# One-copy algorithms on registered buffers (comm.alloc); automatic choice takes them exactly when
# buf and out come from comm.alloc (ringcomm/registered.py), and they refuse other buffers.
for _coll, _make in (("all_reduce", onecopy.read_all_reduce), ("reduce_scatter", onecopy.read_reduce_scatter),
                     ("all_gather", onecopy.read_all_gather), ("broadcast", onecopy.read_broadcast),
                     ("reduce", onecopy.read_reduce)):
    ALGOS[_coll][onecopy.ALGO] = _make
# Algorithms that run only on registered buffers (their steps read peers' memory, not FIFOs):
# tools that execute or mutate FIFO steps leave them out.
REGISTERED_ONLY = frozenset({onecopy.ALGO})


def check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def names(collective: str) -> list[str]:
    """The names ``algo=`` accepts for ``collective``, built-in and registered."""
    check_collective(collective)
    return list(ALGOS[collective])


def builder(collective: str, algo: str):
    """The builder registered as ``algo`` for ``collective``; ValueError naming the choices if none."""
    check_collective(collective)
    make = ALGOS[collective].get(algo)
    if make is None:
        raise ValueError(f"{collective} has no algorithm {algo!r}; choose one of {names(collective)}")
    return make


@lru_cache(maxsize=256)
def build_schedule(collective: str, algo: str, rank: int, n: int, root: int | None) -> Schedule:
    """One rank's schedule, cached: a repeated call builds nothing."""
    make = ALGOS[collective][algo]
    return make(rank, n) if root is None else make(rank, n, root)


def schedules(collective: str, algo: str, n: int, root: int | None = None) -> list[Schedule]:
    """Every rank's Schedule of a named algorithm (index = rank)."""
    make = builder(collective, algo)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world size must be an int >= 1, got {n!r}")
    if collective in ROOTED:
        root = 0 if root is None else root
        if not (isinstance(root, int) and 0 <= root < n):
            raise ValueError(f"root {root!r} out of range for world size {n}")
        return [make(r, n, root) for r in range(n)]
    if root is not None:
        raise ValueError(f"{collective} has no root")
    return [make(r, n) for r in range(n)]


def add(collective: str, name: str, make) -> None:
    ALGOS[collective][name] = make
    build_schedule.cache_clear()


def remove(collective: str, name: str) -> None:
    del ALGOS[collective][name]
    build_schedule.cache_clear()
