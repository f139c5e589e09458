"""Building a Communicator on a store: what ringcomm.init(), comm.split() and comm.shrink() share.

The class is passed in (init hands ``Communicator``, split and shrink their parent's class), so
this module and ringcomm.subcomm import neither init nor comm and the core imports no circle.
"""
from __future__ import annotations

import os
import threading
import time

from ringcomm.transport.base import LinkContext

from . import check
from .core_balance import CoreBalance
from .env import env_number, oversubscribed
from .errors import RingcommError
from .executor import Executor
from .links import Links
from .roster import Roster
from .watchdog import Watchdog

DEFAULT_BUFFSIZE = 4 * 1024 * 1024  # bytes of FIFO per connection, like NCCL_BUFFSIZE
DEFAULT_NSLOTS = 8                  # like NCCL_STEPS
DEFAULT_SLICE = 256 * 1024          # the native engine's slice, measured per size: docs/06, "Slice size"
ENGINES = ("native", "python")
# A rank with a core of its own keeps it while it waits: handing it to a busy process costs a
# scheduler slice (measured: 8-byte all_reduce 18 -> 78 us with two nice-10 hogs). It polls,
# PAUSE between polls, in the native loop in rounds of 200 us with one sched_yield between them
# (a peer that the scheduler put on this same core must still get to run), NATIVE_SPIN_S in all;
# then in Python for SPINS_ALONE polls (~0.5 ms); only then does it yield and sleep
# (transport.base.Backoff). Measured under load: yielding every 50 us handed the core to the
# hogs (8-byte all_reduce ~1 ms in some runs); 1 ms rounds cost ranks that the scheduler
# stacked on one core ~1 ms per hand-off (64 KiB all_reduce 1.4 ms); 200 us rounds: 5.3 us.
NATIVE_SPIN_S = 2e-3
SPINS_ALONE = 2000


def spins(world_size: int) -> int:
    """RINGCOMM_SPINS, else 0 when this host's ranks outnumber its usable cores (a spinning
    rank then holds the core the rank it waits for needs: measured on 4 ranks on 2 cores,
    8-byte all_reduce 179 -> 124 us), else SPINS_ALONE (see above)."""
    raw = os.environ.get("RINGCOMM_SPINS")
    if raw:
        return int(env_number("RINGCOMM_SPINS", SPINS_ALONE, int))
    return 0 if oversubscribed(world_size) else SPINS_ALONE


def engine() -> str:
    """RINGCOMM_ENGINE: "native" (the default) runs calls whose links are all shm in compiled
    code; "python" runs everything in the reference engine."""
    name = os.environ.get("RINGCOMM_ENGINE", "").strip().lower() or "native"
    if name not in ENGINES:
        raise ValueError(f"RINGCOMM_ENGINE={name!r}: choose one of {', '.join(ENGINES)}")
    return name


def assemble(cls, rank, world_size, local_rank, store, owns_store, timeout, token, deadline=None):
    """A ``cls`` (Communicator) for ``rank`` of ``world_size`` that meets its peers through ``store``.

    Returns once every rank has published its roster entry (its meeting address, read by shrink
    after the store may be gone), or raises StoreError / StoreTimeout by ``deadline`` (a
    time.monotonic() value; default: now + timeout) naming the ranks that did not come.
    """
    # Every rank creates its communicators in the same order, so the k-th one of
    # each rank gets the same k: a key prefix no other communicator uses.
    k = store.add(f"ringcomm/comms/{rank}", 1)
    buffsize = env_number("RINGCOMM_BUFFSIZE", DEFAULT_BUFFSIZE, int)
    nslots = env_number("RINGCOMM_NSLOTS", DEFAULT_NSLOTS, int)
    if nslots < 2:  # a step holds its incoming slot until it has an outgoing one: one slot deadlocks
        raise ValueError(f"RINGCOMM_NSLOTS={nslots} must be at least 2: with one slot every ring "
                         f"deadlocks (ringcomm.verify shows the cycle)")
    slot_bytes = max(64, buffsize // nslots // 64 * 64)
    watchdog = Watchdog(rank, world_size, store, f"c{k}")
    ctx = LinkContext(rank=rank, world_size=world_size, store=store, prefix=f"c{k}", token=token,
                      nslots=nslots, slot_bytes=slot_bytes, abort=threading.Event(), watchdog=watchdog,
                      spins=spins(world_size))
    links = Links(ctx, timeout)
    how = engine()
    slice_bytes = env_number("RINGCOMM_SLICE", DEFAULT_SLICE, int)
    roster = None
    if world_size > 1:
        roster = Roster(rank, world_size, links.me)
        try:
            roster.join(store, ctx.prefix, time.monotonic() + timeout if deadline is None else deadline,
                        settings(how, nslots, slot_bytes, slice_bytes))
            links.roster = roster   # who lives where, and who is known dead
            problem = settings_differ(roster.entries, rank)
            if problem:
                # Every rank read the same entries and raises the same error; the rank that hosts
                # the store keeps it up until all have read them (else they would report a lost store).
                try:
                    store.arrive(f"{ctx.prefix}/settings_read", world_size,
                                 wait=min(timeout, 10.0) if owns_store else None)
                except (RingcommError, OSError):
                    pass
                raise ValueError(problem)
        except BaseException:
            roster.close()
            links.close()
            raise
    executor = Executor(rank, world_size, links, timeout, slot_bytes, nslots, engine=how,
                        slice_bytes=slice_bytes, spin_s=NATIVE_SPIN_S if ctx.spins else 0.0)
    executor.watchdog, watchdog.position = watchdog, executor.position
    if roster is not None:
        executor.balance = CoreBalance.for_host(roster.entries, rank)
    return cls(rank, world_size, local_rank, store, links, executor,
               timeout=timeout, owns_store=owns_store, prefix=ctx.prefix, roster=roster)


def settings(how: str, nslots: int, slot_bytes: int, slice_bytes: int) -> dict:
    """What every rank of a communicator must set alike, as this rank has it: how a call is cut
    into slices and slots (a peer that cuts it otherwise reads a slice of the wrong size), the
    forced algorithm, where plain buffers switch to CMA reads (a collective probe) and the debug
    check (an extra collective per call). Keyed by the knobs that set them; "engine" is only said."""
    cut = min(slice_bytes or slot_bytes, slot_bytes) if how == "native" else slot_bytes
    return {"RINGCOMM_BUFFSIZE, RINGCOMM_NSLOTS": f"{nslots} slots of {slot_bytes} bytes",
            # compared as the slice they give: a python and a native engine with equal slices agree
            "RINGCOMM_ENGINE, RINGCOMM_SLICE": f"slices of {cut} bytes on shm",
            "RINGCOMM_ALGO": os.environ.get("RINGCOMM_ALGO", "").strip().lower() or "(automatic)",
            "RINGCOMM_CMA_MIN": str(env_number("RINGCOMM_CMA_MIN", None, int) or "(default)"),
            "RINGCOMM_DEBUG=check": "on" if check.enabled() else "off",
            "engine": how}


def settings_differ(entries: list[dict], rank: int) -> str | None:
    """If the ranks' settings() differ, the error every rank raises: the knobs, and the first rank
    whose values are not rank 0's."""
    first = entries[0].get("settings", {})
    for r, entry in enumerate(entries[1:], 1):
        theirs = entry.get("settings", {})
        differ = [k for k in first if k != "engine" and theirs.get(k) != first[k]]
        if differ:
            said = [f"{k} (rank 0: {first[k]}; rank {r}: {theirs.get(k)})" for k in differ]
            if "RINGCOMM_ENGINE, RINGCOMM_SLICE" in differ:
                said.append(f"engines: rank 0 {first.get('engine')}, rank {r} {theirs.get('engine')}")
            return (f"rank {rank} (this process): every rank of a communicator must set these alike, "
                    f"and rank {r} does not: {'; '.join(said)}")
    return None
