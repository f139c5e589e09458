"""What the ranks of tests/test_torch_cuda_p2p.py's simulator test run (by name, in spawned processes): the
torch backend's held p2p batch (ringcomm/torch_p2p.py) fed numba device arrays and numpy arrays, on the fake
runtime (tests/fake_cuda.py), whose streams really queue and wait on flags."""
from __future__ import annotations

import numpy as np

import fake_cuda


def install(comm, delay: float):
    fake_cuda.install(delay=delay)


def _batch(comm):
    from ringcomm.torch import ProcessGroupRingcomm
    from ringcomm.torch_p2p import P2PBatch

    class Group:                        # what P2PBatch reads of a ProcessGroupRingcomm
        _submit_now = ProcessGroupRingcomm._submit_now
    pg = Group()
    pg.comm = comm
    return P2PBatch(pg, None)


def ring_shift_irecv_first(comm, count: int) -> list[str]:
    """Every rank posts its receives from rank - 1 (a device array of ``count`` floats, many FIFOs, then a
    host array) before its sends to rank + 1, as batch_isend_irecv and pipeline schedules do; waiting on
    the first receive starts the batch."""
    from numba import cuda
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    batch = _batch(comm)
    got_dev, got_host = cuda.to_device(np.zeros(count, np.float32)), np.zeros(5, np.int64)
    works = [batch.recv(got_dev, left, []), batch.recv(got_host, left, []),
             batch.send(cuda.to_device(np.arange(count, dtype=np.float32) + 1000 * r), right, []),
             batch.send(np.full(5, r, np.int64), right, [])]
    works[0].wait()
    for w in works:
        assert w.wait() and w.is_completed()
    fake_cuda.current().synchronize(0)           # the device results are ready on the caller's stream
    checks = {"device": (got_dev.copy_to_host(), np.arange(count, dtype=np.float32) + 1000 * left),
              "host": (got_host, np.full(5, left, np.int64))}
    return [f"rank {r}: {name} message wrong: {got[:4]} want {want[:4]}" for name, (got, want) in checks.items()
            if not np.array_equal(got, want)]
