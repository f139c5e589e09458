"""Sub-communicators: comm.split(color, key) and comm.shrink(exclude) (MPI_Comm_split, ncclCommShrink).

A new communicator is independent of its parent: its own store, links, timeouts and close().
Its store is hosted by its own rank 0 (split: the first rank of the colour by (key, rank);
shrink: the lowest surviving rank, which led the meeting), exactly as init's rank 0 hosts the
world's, so either communicator may be closed first and the parent's store host may die.

split agrees through the parent's own all_gather (it is a collective of the parent). shrink
cannot use the parent (a failure may have broken it, and its store may have died with its rank
0): the survivors meet through the roster sockets every communicator's ranks exchange when it
is made (ringcomm.roster, ringcomm.meet).
"""
from __future__ import annotations

import time

import numpy as np

from ringcomm.transport.tcp import local_address

from .assemble import assemble
from .errors import CommunicatorClosed, StoreError
from .meet import meet
from .store import HashStore, TCPStore

ADDRESS_BYTES = 128  # one rank's "host:port" in split's all_gather, NUL padded
INT64 = (-(1 << 63), (1 << 63) - 1)


def _int(value, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if not INT64[0] <= value <= INT64[1]:
        raise ValueError(f"{what} {value} does not fit in 64 bits")
    return value


def check_split(color, key) -> tuple[int | None, int]:
    if color is not None:
        color = _int(color, "split color")
        if color < 0:
            raise ValueError(f"split color must be >= 0 (or None to take no part), got {color}")
    return color, _int(key, "split key")


def check_exclude(exclude, rank: int, world_size: int) -> frozenset:
    if exclude is None:
        return frozenset()
    if isinstance(exclude, (str, bytes)) or not hasattr(exclude, "__iter__"):
        raise TypeError(f"shrink exclude must be a list of ranks, got {type(exclude).__name__} {exclude!r}")
    ranks = [_int(r, "shrink exclude entry") for r in exclude]
    for r in ranks:
        if not 0 <= r < world_size:
            raise ValueError(f"shrink exclude: rank {r} is out of range for world_size {world_size}")
    if rank in ranks:
        raise ValueError(f"shrink exclude holds rank {rank}, this rank itself: excluded ranks do not call shrink")
    return frozenset(ranks)


def split(comm, color, key):
    color, key = check_split(color, key)
    n = comm.world_size
    every = np.empty(2 * n, np.int64)
    comm.all_gather(np.array([-1 if color is None else color, key], np.int64), every)
    ranks = [r for _, r in sorted((int(k), r) for r, (c, k) in enumerate(every.reshape(n, 2))
                                  if color is not None and c == color)]
    hosted, address = _exchange_store_address(comm, ranks)
    if color is None:
        return None
    what = f"split(color={color}, key={key})"
    deadline = time.monotonic() + comm.timeout
    if len(ranks) == 1:
        return _make(comm, ranks, HashStore(comm.timeout), deadline, what)
    if not address:
        raise StoreError(f"rank {comm.rank} (this process): {what}: rank {ranks[0]}, the new "
                         f"communicator's rank 0, could not start its store")
    return _make(comm, ranks, hosted or _dial(comm, address, deadline, what), deadline, what)


def _exchange_store_address(comm, ranks: list[int]) -> tuple[TCPStore | None, str]:
    """(the store this rank hosts, if any; the "host:port" of its colour's store, "" if none).

    The first rank of each colour of several ranks starts the new communicator's store and
    tells the others where, in a second all_gather of the parent that every rank (colour None
    too) takes part in, so the parent stays in step even when a store cannot start.
    """
    hosted, mine = None, ""
    if len(ranks) > 1 and ranks[0] == comm.rank:
        try:
            hosted = _serve(comm)
            mine = f"{hosted.host}:{hosted.port}"
        except (StoreError, OSError):
            pass  # the members read an empty address and say so
    blob = np.zeros(ADDRESS_BYTES, np.uint8)
    blob[:len(mine)] = np.frombuffer(mine.encode(), np.uint8)
    every = np.empty(ADDRESS_BYTES * comm.world_size, np.uint8).reshape(comm.world_size, ADDRESS_BYTES)
    try:
        comm.all_gather(blob, every.reshape(-1))
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    if not ranks:
        return None, ""
    return hosted, every[ranks[0]].tobytes().rstrip(b"\0").decode()


def shrink(comm, exclude):
    excluded = check_exclude(exclude, comm.rank, comm.world_size)
    if comm._closed:
        raise CommunicatorClosed(f"rank {comm.rank}: shrink on a closed communicator")
    if comm._forked:  # the roster would count this process as the parent's rank
        raise CommunicatorClosed(f"rank {comm.rank}: shrink in a forked child: {comm._broken}")
    deadline = time.monotonic() + comm.timeout
    what = f"shrink(exclude={sorted(excluded)})"
    if comm.world_size == 1:
        return _make(comm, [0], HashStore(comm.timeout), deadline, what)
    hosted = []

    def serve(members):  # on the leader only, once the members are decided
        if len(members) == 1:
            return ""
        hosted.append(_serve(comm))
        return f"{hosted[0].host}:{hosted[0].port}"

    members, address = meet(comm._roster, excluded, _token(comm), deadline, serve)
    if len(members) == 1:
        store = HashStore(comm.timeout)
    else:
        store = hosted[0] if hosted else _dial(comm, address, deadline, what)
    return _make(comm, members, store, deadline, what)


def _token(comm) -> str:
    return comm._links.ctx.token


def _serve(comm) -> TCPStore:
    """A store server for a new communicator, on an address the other hosts can reach."""
    return TCPStore(local_address(), 0, is_server=True, token=_token(comm), timeout=comm.timeout)


def _dial(comm, address: str, deadline: float, what: str) -> TCPStore:
    host, port = address.rsplit(":", 1)
    try:  # connect within what is left of the call; later requests get the communicator's timeout
        store = TCPStore(host, int(port), is_server=False, token=_token(comm),
                         timeout=max(deadline - time.monotonic(), 1e-3))
    except StoreError as e:
        raise type(e)(f"rank {comm.rank} (this process): {what} could not reach the new "
                      f"communicator's store: {e}") from None
    store.timeout = comm.timeout
    return store


def _make(comm, members: list[int], store, deadline: float, what: str):
    """The new communicator, this rank being members.index(comm.rank); it owns ``store``."""
    try:
        return assemble(type(comm), members.index(comm.rank), len(members), comm.local_rank, store,
                        True, comm.timeout, _token(comm), deadline)
    except StoreError as e:
        store.close()
        raise type(e)(f"rank {comm.rank} (this process): {what} could not set up the new "
                      f"communicator of old ranks {members}: {e}") from None
    except BaseException:
        store.close()
        raise
