"""What the ranks of tests/test_device_group.py run (by name, in spawned processes): comm.group() on device
buffers, on the fake runtime (tests/fake_cuda.py), whose streams really queue and wait on flags, so an order
that would deadlock a GPU stream hangs here too."""
from __future__ import annotations

import numpy as np

import fake_cuda


def install(comm, delay: float):
    fake_cuda.install(delay=delay)


def _dev(a):
    from numba import cuda
    return cuda.to_device(a)


def first_contact_mixed(comm) -> list[str]:
    """Ranks 0 and 1, links not connected yet: rank 0 issues a device receive then a host send, rank 1 a host
    receive then a device send. Connecting in issue order would have each wait for the other's send."""
    r, peer = comm.rank, 1 - comm.rank
    dev, host = _dev(np.full(300, r, np.float32)), np.full(300, r, np.int64)
    with comm.group():
        if r == 0:
            comm.recv(dev, peer)
            comm.send(host, peer)
        else:
            comm.recv(host, peer)
            comm.send(dev, peer)
    fake_cuda.current().synchronize(0)
    got = (dev.copy_to_host() if r == 0 else host)
    return [] if (got == peer).all() else [f"rank {r}: got {got[:4]} from rank {peer}"]


def ring_shift_pairs_and_collectives(comm, count: int) -> list[str]:
    """One group: every rank sends to rank + 1 *before* receiving from rank - 1, ``count`` floats (many FIFOs),
    then two more messages to the same peer of other sizes and dtypes (matched in issue order), with a device
    all_reduce issued between them and a host all_reduce last (both collectives still run first)."""
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    big = _dev(np.arange(count, dtype=np.float32) + 1000 * r)
    small, odd = _dev(np.full(7, r, np.int32)), _dev(np.arange(count // 2 + 1, dtype=np.float64) * (r + 1))
    got_big, got_small = _dev(np.zeros(count, np.float32)), _dev(np.zeros(7, np.int32))
    got_odd = _dev(np.zeros(count // 2 + 1, np.float64))
    x, h = _dev(np.full(count, r + 1, np.float32)), np.full(5, r + 1, np.float64)
    with comm.group():
        comm.send(big, right)
        comm.send(small, right)
        comm.all_reduce(x)
        comm.send(odd, right)
        comm.recv(got_big, left)
        comm.recv(got_small, left)
        comm.recv(got_odd, left)
        comm.all_reduce(h)
    fake_cuda.current().synchronize(0)          # the caller's stream: every result is ready after it
    total = n * (n + 1) / 2
    checks = {
        "big": (got_big.copy_to_host(), np.arange(count, dtype=np.float32) + 1000 * left),
        "small": (got_small.copy_to_host(), np.full(7, left, np.int32)),
        "odd": (got_odd.copy_to_host(), np.arange(count // 2 + 1, dtype=np.float64) * (left + 1)),
        "device all_reduce": (x.copy_to_host(), np.full(count, total, np.float32)),
        "host all_reduce": (h, np.full(5, total)),
    }
    return [f"rank {r}: {name} wrong: {got[:4]} want {want[:4]}" for name, (got, want) in checks.items()
            if not np.array_equal(got, want)]


def all_to_all_by_pairs(comm, count: int) -> list[str]:
    """An all-to-all written as n - 1 sends then n - 1 receives (blocks of ``count``, each many FIFOs)."""
    n, r = comm.world_size, comm.rank
    peers = [p for p in range(n) if p != r]
    out = {p: _dev(np.arange(count, dtype=np.int32) * n + r * 100000 + p) for p in peers}
    got = {p: _dev(np.zeros(count, np.int32)) for p in peers}
    with comm.group():
        for p in peers:
            comm.send(out[p], p)
        for p in peers:
            comm.recv(got[p], p)
    fake_cuda.current().synchronize(0)
    return [f"rank {r}: block from rank {p} wrong: {got[p].copy_to_host()[:4]}" for p in peers
            if not np.array_equal(got[p].copy_to_host(), np.arange(count, dtype=np.int32) * n + p * 100000 + r)]


def connect(comm) -> None:
    """Rank 1 sends one device message to rank 0: the link is connected before the peer goes quiet."""
    x = _dev(np.ones(4, np.float32))
    comm.send(x, 0) if comm.rank == 1 else comm.recv(x, 1)
    fake_cuda.current().synchronize(0)


def group_outruns_the_peer(comm, count: int) -> dict:
    """Rank 0 receives in a group, rank 1 never sends: the group times out naming the peer, the call and
    the transport."""
    x = _dev(np.ones(count, np.float32))
    try:
        with comm.group():
            comm.recv(x, 1)
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(e).__name__}: {e}"}


def late_receiver(comm) -> list[str]:
    """Rank 0 sends a device buffer at once (blocking, no group); rank 1 calls recv only once rank 0's send end
    is published, so rank 0's first acquire waits for the receiver's slot placement."""
    x = _dev(np.arange(300, dtype=np.float32) + 10 * comm.rank)
    if comm.rank == 0:
        comm.send(x, 1)
    else:
        comm._store.wait([f"{comm._prefix}/device/cuda_ipc/0->1"], comm.timeout)
        comm.recv(x, 0)
    fake_cuda.current().synchronize(0)
    got = x.copy_to_host()
    return [] if np.array_equal(got, np.arange(300, dtype=np.float32)) else [f"rank {comm.rank}: got {got[:4]}"]
