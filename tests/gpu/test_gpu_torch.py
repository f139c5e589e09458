"""CUDA tensors through the torch.distributed backend on a real GPU, 2 ranks sharing GPU 0: ProcessGroupNCCL's
stream semantics (ringcomm/torch_cuda.py). Skipped with the reason where there is no GPU."""
from __future__ import annotations

import pytest

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import unavailable

WHY = unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=WHY or "")]


def stream_semantics(rank, n):
    """Work queued on a side stream before the call counts; Work.wait() and the Work's future's wait()
    order the side stream after it."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.zeros(1 << 22, device="cuda")
        for _ in range(20):
            x += 1                                      # queued on s, not necessarily done at the call
        work = dist.all_reduce(x, async_op=True)
        work.wait()                                     # s waits on the GPU; the host does not
        x *= 2
        z = torch.zeros(1 << 22, device="cuda")
        for _ in range(20):
            z += 1
        fut = dist.all_reduce(z, async_op=True).get_future()
        fut.wait()                                      # a CUDA-aware future: s waits, as with NCCL
        z *= 2
        y = torch.full((1 << 16,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        out = torch.empty(n * y.numel(), dtype=torch.bfloat16, device="cuda")
        dist.all_gather_into_tensor(out, y)
    s.synchronize()
    assert bool((x == 20 * n * 2).all()), x[:4]
    assert bool((z == 20 * n * 2).all()), z[:4]
    assert bool((out.view(n, -1).float() == torch.arange(1, n + 1, device="cuda").view(n, 1)).all())
    return "ok"


def _on_two_ranks(fn, *args):
    """fn(rank, n, *args) on a 2-rank torch world with the ringcomm backend; the ranks' answers."""
    pytest.importorskip("torch")
    from test_torch_backend import TorchWorld
    w = TorchWorld(2)
    try:
        return w.run(fn, *args, timeout=150)
    finally:
        w.close()


@pytest.mark.timeout(180)
def test_torch_cuda_tensors_follow_nccl_stream_semantics():
    assert _on_two_ranks(stream_semantics) == ["ok", "ok"]


def reproducible_cuda(rank, n):
    """pg.reproducible on CUDA tensors: float32 and bfloat16 all_reduce / reduce_scatter give the bits of the
    same calls on CPU tensors (the host reproducible path), bit for bit."""
    import numpy as np
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.distributed_c10d._get_default_group().reproducible = True
    g = torch.Generator().manual_seed(7 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(10007, generator=g) * torch.exp2(torch.randint(-20, 20, (10007,), generator=g))).to(dtype)
        host, dev = x.clone(), x.cuda()
        dist.all_reduce(host)
        dist.all_reduce(dev)
        rs_host, rs_dev = torch.empty(5000, dtype=dtype), torch.empty(5000, dtype=dtype, device="cuda")
        dist.reduce_scatter_tensor(rs_host, x[:10000].clone())
        dist.reduce_scatter_tensor(rs_dev, x[:10000].cuda())
        for a, b in ((host, dev), (rs_host, rs_dev)):
            a16, b16 = a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32), b.cpu()
            b16 = b16.view(a16.dtype)
            assert np.array_equal(a16.numpy(), b16.numpy()), (dtype, a[:4], b[:4])
    return "ok"


@pytest.mark.timeout(180)
def test_reproducible_cuda_tensors_give_the_host_bits():
    assert _on_two_ranks(reproducible_cuda) == ["ok", "ok"]


FIFO = 1 << 20                                          # RINGCOMM_CUDA_BUFFSIZE for the test below


def ring_shift_irecv_first(rank, n, count):
    """batch_isend_irecv with every irecv listed before its isend (pipeline order), CUDA messages 10x the device
    FIFO and a CPU one in the same batch; the sent tensor is still being written on the caller's stream at the
    call, and the received one is used on that stream after Work.wait() without any host synchronisation."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    right, left = (rank + 1) % n, (rank - 1) % n
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)                   # ~25 ms of GPU time queued before the data is written
        x = torch.full((count,), 1000.0 * rank, device="cuda")
        for _ in range(20):
            x += 1
        got, got_cpu = torch.zeros(count, device="cuda"), torch.zeros(5, dtype=torch.int64)
        ops = [dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.irecv, got_cpu, left),
               dist.P2POp(dist.isend, x, right), dist.P2POp(dist.isend, torch.full((5,), rank), right)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()                                    # s waits on the GPU for the batch
        got += 1
    s.synchronize()
    assert bool((got == 1000.0 * left + 21).all()), got[:4]
    assert got_cpu.tolist() == [left] * 5, got_cpu
    return "ok"


@pytest.mark.timeout(180)
def test_batch_isend_irecv_with_irecv_first_ten_fifos_of_cuda_tensors(monkeypatch):
    monkeypatch.setenv("RINGCOMM_CUDA_BUFFSIZE", str(FIFO))           # the spawned ranks inherit it
    assert _on_two_ranks(ring_shift_irecv_first, 10 * FIFO // 4) == ["ok", "ok"]
