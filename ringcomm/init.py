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

from .assemble import assemble
from .comm import Communicator
from .env import env_number, env_switch
from .errors import StoreError

DEFAULT_TIMEOUT = 300.0
# Set (to 1) by a launcher that serves the store at MASTER_ADDR:MASTER_PORT itself, on a port it
# bound before starting the ranks (ringcomm-bench: jobs.host_store): rank 0 then joins it as a
# client, like every other rank, instead of serving it.
STORE_HOSTED_ENV = "RINGCOMM_STORE_HOSTED"

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
    try:
        if store is None:
            from .store import HashStore, TCPStore
            if world_size == 1:
                store = HashStore()
            else:
                host, port = _store_address()
                hosted = STORE_HOSTED_ENV in os.environ and env_switch(STORE_HOSTED_ENV)
                store = TCPStore(host, port, is_server=rank == 0 and not hosted, token=token, timeout=timeout)
        return _join(rank, world_size, local_rank, store, owns_store, timeout, token)
    except StoreError as e:  # a StoreTimeout stays one: the same words, with this rank's name
        if owns_store and store is not None:
            store.close()
        raise type(e)(f"rank {rank} (this process) could not join the job through the store: {e}") from None


def _join(rank, world_size, local_rank, store, owns_store, timeout, token) -> Communicator:
    return assemble(Communicator, rank, world_size, local_rank, store, owns_store, timeout, token)
