"""Your own algorithms: register a schedule builder and call it by name, ``algo="name"``.

    def my_all_reduce(rank, n):            # -> ringcomm.schedule.step.Schedule
        ...
    ringcomm.register_algorithm("mine", "all_reduce", my_all_reduce)
    comm.all_reduce(x, algo="mine")

A builder is ``builder(rank, n)`` (``builder(rank, n, root)`` for broadcast and reduce) and
returns that rank's Schedule; ringcomm.schedule.lang.program_builder turns a chunk-flow
Program into one. The algorithm is checked twice, because a wrong schedule would otherwise
hang real processes or silently return wrong numbers:

- at registration, symbolically (schedule/simulate.check: contributions in every buffer form
  the collective allows, in place included, FIFO order, deadlock with 2 slots) for every world
  size in ``sizes`` (default 1..8) and, for rooted collectives, every root; a failure raises
  ScheduleError (``.failures`` lists them, each with its kind, rank, step and chunk) and
  nothing is registered;
- on first use at any other world size, the same check for that size (and root), once per
  process, before any byte moves. Every rank runs the same check, so all refuse together.
"""
from __future__ import annotations

import re
import threading

from . import catalogue
from .catalogue import COLLECTIVES, ROOTED, check_collective as _check_collective
from .schedule.faults import MALFORMED, Failure
from .schedule.simulate import ScheduleError, check
from .schedule.step import Schedule
from .schedule.verify import NATIVE_SLICE, Report, fifo_shapes, verify_schedules

SIZES = tuple(range(1, 9))
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_lock = threading.Lock()
_checked: set = set()  # (collective, name, n, root) already checked in this process
USER: dict = {}        # (collective, name) -> the builder as the user gave it


def register_algorithm(name: str, collective: str, builder, *, sizes=SIZES, replace: bool = False):
    """Make ``builder`` available as ``algo=name`` for ``collective`` on every Communicator."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"algorithm name must be a word like 'my_ring' (letters, digits, _ . -), "
                         f"got {name!r}")
    _check_collective(collective)
    if not callable(builder):
        raise TypeError(f"builder must be callable as builder(rank, n{', root' if collective in ROOTED else ''})"
                        f", got {type(builder).__name__}")
    if (collective, name) not in USER and name in catalogue.ALGOS[collective]:
        raise ValueError(f"{name!r} is a built-in {collective} algorithm and cannot be replaced")
    if name in catalogue.ALGOS[collective] and not replace:
        raise ValueError(f"{collective} already has an algorithm {name!r}; pass replace=True to replace it")
    sizes = tuple(sizes)
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes must be world sizes >= 1, got {sizes}")
    for n in sizes:
        for root in _roots(collective, n):
            check_algorithm(collective, builder, n, root, name=name)
    with _lock:
        _checked.difference_update({k for k in _checked if k[:2] == (collective, name)})
        _checked.update((collective, name, n, root) for n in sizes for root in _roots(collective, n))
        USER[collective, name] = builder
        catalogue.add(collective, name, _lazily_checked(collective, name, builder))


def unregister_algorithm(name: str, collective: str) -> None:
    """Remove an algorithm registered with register_algorithm (built-ins stay)."""
    _check_collective(collective)
    with _lock:
        if (collective, name) not in USER:
            raise ValueError(f"{name!r} is not a registered {collective} algorithm")
        del USER[collective, name]
        catalogue.remove(collective, name)
        _checked.difference_update({k for k in _checked if k[:2] == (collective, name)})


def algorithms(collective: str) -> list[str]:
    """The names ``algo=`` accepts for ``collective``, built-in and registered."""
    return catalogue.names(collective)


def schedules(collective: str, algo: str, n: int, root: int | None = None) -> list[Schedule]:
    """Every rank's Schedule of a named algorithm (index = rank)."""
    return catalogue.schedules(collective, algo, n, root)


def verify(collective: str, algo, world_size: int, count: int, *, root: int | None = None,
           itemsize: int = 4, buffsize: int = 4 << 20, nslots: int = 8,
           slice_bytes: int | None = NATIVE_SLICE):
    """Prove what can be proved about an algorithm without running it, and return a Report.

    ``algo`` is a registered name (``algorithms(collective)``), a builder (``builder(rank, n)``,
    ``builder(rank, n, root)`` for broadcast and reduce) or a list of ``world_size`` Schedules
    (index = rank). The Report holds:

    - the postcondition, in every buffer form the API allows (out of place, and in place:
      ``out is buf`` for all_reduce and reduce, broadcast's one buffer, all_gather's buf as
      out's own block, reduce_scatter's out as buf's own block); ``Report.failures`` lists what
      is wrong as faults.Failure records (kind, rank, step, chunk, detail), kinds in
      ringcomm.schedule.faults.KINDS: missing contribution, counted twice, misplaced block,
      unmatched send or receive, deadlock (also one at every FIFO size, with its shortest trace),
      read-after-write, data race, clobbered buffer, post-op, malformed schedule;
    - the reduction order of every output element (for ``count`` elements of ``itemsize`` bytes
      cut by a FIFO of ``buffsize`` bytes in ``nslots`` slots into slices of ``slice_bytes``
      (RINGCOMM_SLICE; ``None`` for RINGCOMM_ENGINE=python, whose slices fill whole slots), as the
      executor would cut them),
      whether all ranks share it (naming the ranks that do not) and whether it depends on the
      message size or slicing;
    - deadlock, with the shortest counterexample, for the FIFO shapes of
      ``schedule.verify.fifo_shapes(nslots)``: ``nslots`` slots with a step moving 1 to
      ``nslots // 2`` slices (the executor's small and full chunks), and 2 slots with 1 slice
      (the smallest RINGCOMM_NSLOTS); with the default ``nslots=8``: (2, 1), (8, 1), (8, 2),
      (8, 3), (8, 4). ``nslots=`` is RINGCOMM_NSLOTS: it changes both the shapes and the cut.
      A shape that could not be checked (the schedules do not match up) says "not checked".

    ``count`` is the call's element count: the buffer of all_reduce, broadcast and reduce, each
    rank's input of all_gather and gather, each rank's output of reduce_scatter and scatter, a block
    of all_to_all. A builder that raises or returns something other than a Schedule is reported as
    a failure, not raised."""
    _check_collective(collective)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if collective in ROOTED and root is None:
        root = 0
    if collective in ROOTED and not (isinstance(root, int) and 0 <= root < world_size):
        raise ValueError(f"root {root!r} out of range for world size {world_size}")
    name, scheds, failure = _schedules_of(collective, algo, world_size, root)
    if failure is not None:
        shapes = fifo_shapes(nslots)
        return Report(collective, name, world_size, count, root,
                      failures=[Failure(MALFORMED, None, None, None, failure)],
                      deadlocks={s: f"not checked: {failure}" for s in shapes})
    return verify_schedules(collective, scheds, count, root=root, algo=name, itemsize=itemsize,
                            buffsize=buffsize, nslots=nslots, slice_bytes=slice_bytes)


def _schedules_of(collective, algo, n, root):
    """(name, schedules, None), or (name, None, why there are none) for verify()."""
    if isinstance(algo, (list, tuple)):
        if len(algo) != n:
            raise ValueError(f"{len(algo)} schedules given for world size {n}: need one per rank")
        name = algo[0].algo if algo and isinstance(algo[0], Schedule) else "schedules"
        return name, list(algo), None
    if isinstance(algo, str):
        builder = USER.get((collective, algo)) or catalogue.ALGOS[collective].get(algo)
        if builder is None:
            raise ValueError(f"{collective} has no algorithm {algo!r}; choose one of {algorithms(collective)}")
        name = algo
    elif callable(algo):
        builder, name = algo, getattr(algo, "__name__", "builder")
    else:
        raise TypeError(f"algo must be an algorithm name, a builder or a list of Schedules, "
                        f"got {type(algo).__name__}")
    try:
        scheds = [builder(r, n) if root is None else builder(r, n, root) for r in range(n)]
    except Exception as e:  # noqa: BLE001 - reported, as the docstring promises
        return name, None, f"the builder failed: {type(e).__name__}: {e}"
    bad = next((r for r, s in enumerate(scheds) if not isinstance(s, Schedule)), None)
    if bad is not None:
        return name, None, f"the builder returned {type(scheds[bad]).__name__} for rank {bad}, not a Schedule"
    return name, scheds, None


def check_algorithm(collective, builder, n, root=None, *, name="custom"):
    """Build every rank's schedule with ``builder`` and check it symbolically; raise
    ScheduleError (naming the algorithm, world size and root) if it is wrong."""
    where = f"algorithm {name!r} for {collective} at world size {n}" + (
        f", root {root}" if root is not None else "")
    try:
        scheds = [builder(r, n) if root is None else builder(r, n, root) for r in range(n)]
    except ScheduleError:
        raise
    except Exception as e:  # noqa: BLE001 - a builder's own failure, explained with context
        raise ScheduleError(f"{where}: the builder failed: {type(e).__name__}: {e}") from e
    for r, s in enumerate(scheds):
        if not isinstance(s, Schedule):
            raise ScheduleError(f"{where}: the builder returned {type(s).__name__} for rank {r}, "
                                f"not a Schedule")
    try:
        check(collective, scheds, root=root, nslots=2, slices=1, rounds=2)
    except ScheduleError as e:  # keep the structured failures: e.failures
        raise ScheduleError(e.failures, prefix=f"{where}: ") from None
    return scheds


def _lazily_checked(collective, name, builder):
    def build(rank, n, *root):
        key = (collective, name, n, root[0] if root else None)
        if key not in _checked:
            check_algorithm(collective, builder, n, key[3], name=name)
            with _lock:
                _checked.add(key)
        return builder(rank, n, *root)
    build.__name__ = f"checked_{name}"
    build.__wrapped__ = builder
    return build


def _roots(collective, n):
    if collective not in ROOTED:
        return (None,)
    return tuple(range(n))
