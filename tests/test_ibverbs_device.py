"""Device buffers between ranks over ibverbs: each device slice staged through the ibverbs connection's own
registered host slots (transport/cuda_staged.py), the kernels under numba's CUDA simulator. Marked ``rdma``:
it runs where ibverbs has an active port (.ci/rdma runs it in the Soft-RoCE guest); skipped with the reason
elsewhere, and where numba-cuda (the simulator) is missing."""
from __future__ import annotations

import importlib.util

import pytest

from harness import World
from ringcomm.transport import ibverbs

WHY_NOT = ibverbs.unavailable()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(WHY_NOT is not None, reason=f"no RDMA here: {WHY_NOT}")]
ENV = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_TRANSPORT": "ibverbs", "RINGCOMM_CUDA_BUFFSIZE": "16384",
       "RINGCOMM_NSLOTS": "4"}


def reduce_and_gather(comm) -> str | None:
    import numpy as np
    from numba import cuda
    n, r = comm.world_size, comm.rank
    x = cuda.to_device(np.arange(5000, dtype=np.float32) + r)
    comm.all_reduce(x)
    whole = cuda.to_device(np.zeros(300 * n, np.int32))
    comm.all_gather(cuda.to_device(np.full(300, r, np.int32)), whole)
    kinds = {type(c).__name__ + " " + c.transport for c in comm._device.links.conns.values()}
    if not np.array_equal(x.copy_to_host(), np.arange(5000, dtype=np.float32) * n + n * (n - 1) / 2):
        return f"rank {r}: all_reduce wrong"
    if not np.array_equal(whole.copy_to_host(), np.repeat(np.arange(n, dtype=np.int32), 300)):
        return f"rank {r}: all_gather wrong"
    if kinds != {"StagedSend ibverbs+staged", "StagedRecv ibverbs+staged"}:
        return f"rank {r}: device links {kinds}"
    return None


@pytest.mark.timeout(300)
def test_device_buffers_over_ibverbs_under_the_simulator():
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda (numba's CUDA simulator) is not installed here")
    with World(2, ENV, timeout=120) as w:
        assert w.run(reduce_and_gather, timeout=240) == [None, None]
