"""ringcomm.init(): who am I, where is the store, and the Communicator that follows.

The launchers people already use set the environment: torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), Open MPI (OMPI_COMM_WORLD_*), Slurm
(SLURM_PROCID, ...). With none of them, a world of one.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading

from .comm import Communicator
from .env import env_number
from .errors import StoreError
from .executor import Executor
from .links import Links
from .watchdog import Watchdog
from ringcomm.transport.base import LinkContext

DEFAULT_TIMEOUT = 300.0
DEFAULT_BUFFSIZE = 4 * 1024 * 1024  # bytes of FIFO per connection, like NCCL_BUFFSIZE
DEFAULT_NSLOTS = 8                  # like NCCL_STEPS
DEFAULT_SLICE = 64 * 1024           # the native engine's slice: see README, "Engines"
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

_LAUNCHERS = (  # (rank, world size, local rank) variables, in order of preference
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH's Hydra
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def from_environment() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the first launcher whose variables are set."""
    env = os.environ
    for r, w, lr in _LAUNCHERS:
        if r in env and w in env:
            return int(env[r]), int(env[w]), int(env.get(lr, env[r]))
    return 0, 1, 0


def _store_address() -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("RINGCOMM_MASTER_PORT") or os.environ.get("MASTER_PORT")
    if not port:
        raise ValueError("a world of several ranks needs MASTER_ADDR and MASTER_PORT (or a store=): "
                         "start it with ringcomm-run, torchrun or mpirun")
    port = int(port)
    if "TORCHELASTIC_RUN_ID" in os.environ and "RINGCOMM_MASTER_PORT" not in os.environ:
        port += 1  # torchrun's own TCPStore listens on MASTER_PORT
    return addr, port


_cleanup_installed = False


def _clean_shm_on_exit() -> None:
    """Unlink this process's /dev/shm names at exit and on SIGTERM. A handler the program
    installed itself is left alone; ours cleans up, then dies of SIGTERM as before."""
    global _cleanup_installed
    from ringcomm.transport.shm import unlink_named

    if _cleanup_installed:
        return
    _cleanup_installed = True
    atexit.register(unlink_named)
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        unlink_named()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def init(rank=None, world_size=None, *, store=None, timeout=None) -> Communicator:
    """Join the job and return its Communicator (see README: "The API")."""
    env_rank, env_world, local_rank = from_environment()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    timeout = float(timeout) if timeout is not None else env_number("RINGCOMM_TIMEOUT", DEFAULT_TIMEOUT)
    token = os.environ.get("RINGCOMM_TOKEN", "")
    owns_store = store is None
    if world_size > 1:
        _clean_shm_on_exit()
    if store is None:
        from .store import HashStore, TCPStore
        if world_size == 1:
            store = HashStore()
        else:
            host, port = _store_address()
            store = TCPStore(host, port, is_server=rank == 0, token=token, timeout=timeout)
    try:
        return _join(rank, world_size, local_rank, store, owns_store, timeout, token)
    except StoreError as e:
        if owns_store:
            store.close()
        raise StoreError(f"rank {rank} (this process) could not join the job through the store: {e}") from None


def _spins(world_size: int) -> int:
    """RINGCOMM_SPINS, else 0 when this host's ranks outnumber its usable cores (a spinning
    rank then holds the core the rank it waits for needs: measured on 4 ranks on 2 cores,
    8-byte all_reduce 179 -> 124 us), else SPINS_ALONE (see above)."""
    raw = os.environ.get("RINGCOMM_SPINS")
    if raw:
        return int(env_number("RINGCOMM_SPINS", SPINS_ALONE, int))
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return 0 if local > len(os.sched_getaffinity(0)) else SPINS_ALONE


def _engine() -> str:
    """RINGCOMM_ENGINE: "native" (the default) runs calls whose links are all shm in compiled
    code; "python" runs everything in the reference engine."""
    name = os.environ.get("RINGCOMM_ENGINE", "").strip().lower() or "native"
    if name not in ENGINES:
        raise ValueError(f"RINGCOMM_ENGINE={name!r}: choose one of {', '.join(ENGINES)}")
    return name


def _join(rank, world_size, local_rank, store, owns_store, timeout, token) -> Communicator:
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
                      spins=_spins(world_size))
    links = Links(ctx, timeout)
    executor = Executor(rank, world_size, links, timeout, slot_bytes, nslots, engine=_engine(),
                        slice_bytes=env_number("RINGCOMM_SLICE", DEFAULT_SLICE, int),
                        spin_s=NATIVE_SPIN_S if ctx.spins else 0.0)
    executor.watchdog, watchdog.position = watchdog, executor.position
    return Communicator(rank, world_size, local_rank, store, links, executor,
                        timeout=timeout, owns_store=owns_store, prefix=ctx.prefix)
