"""RINGCOMM_REPRODUCIBLE=1 in the torch backend: float SUM / AVG through dist.* give the bits of
reproducible=True (what tests/exact.py simulates); other reductions are untouched."""
from __future__ import annotations

import numpy as np
import pytest

from exact import bits, simulated

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
from test_torch_backend import TorchWorld  # noqa: E402

N, COUNT = 2, 1000


def inputs():
    rng = np.random.default_rng(21)
    return [(rng.standard_normal(COUNT) * np.exp2(rng.integers(-30, 30, COUNT))).astype(np.float32)
            for _ in range(N)]


def _calls(rank, n, xs):
    import torch.distributed as dist
    from ringcomm.kernels import host
    x = torch.from_numpy(xs[rank].copy())
    dist.all_reduce(x)
    half = COUNT // n
    rs = torch.empty(half)
    dist.reduce_scatter_tensor(rs, torch.from_numpy(xs[rank].copy()))
    avg = torch.from_numpy(xs[rank].copy())
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    m = torch.tensor([rank, 7 - rank], dtype=torch.int32)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)                      # not a sum: plain, as before
    want_avg = host.postprocess(x.numpy().copy(), "avg", n)
    tie = torch.tensor([1.0 if rank == 0 else 2.0 ** -53 + 2.0 ** -104], dtype=torch.float64)
    dist.all_reduce(tie)                  # float64 on two ranks takes the limbs: the window's bits
    return (bits(x.numpy()).copy(), bits(rs.numpy()).copy(), bool(np.array_equal(bits(avg.numpy()), bits(want_avg))),
            m.tolist(), tie.item())


@pytest.mark.timeout(180)
def test_torch_group_with_reproducible_env(monkeypatch):
    monkeypatch.setenv("RINGCOMM_REPRODUCIBLE", "1")      # the spawned ranks inherit it
    xs = inputs()
    want = bits(simulated(xs))
    world = TorchWorld(N)
    try:
        got = world.run(_calls, xs)
    finally:
        world.close()
    for rank, (ar, rs, avg_ok, m, tie) in enumerate(got):
        assert np.array_equal(ar, want)
        assert np.array_equal(rs, want[rank * (COUNT // N):(rank + 1) * (COUNT // N)])
        assert avg_ok and m == [1, 7] and tie == 1.0


def test_bad_env_value_names_the_variable(monkeypatch):
    from ringcomm.torch import reproducible_from_env
    monkeypatch.setenv("RINGCOMM_REPRODUCIBLE", "yes")
    with pytest.raises(ValueError, match="RINGCOMM_REPRODUCIBLE='yes'"):
        reproducible_from_env()


def test_cuda_reductions_follow_the_groups_reproducible_setting(monkeypatch):
    """ringcomm/torch_cuda.py without a GPU: a CUDA tensor's float SUM / AVG reaches the Communicator with
    reproducible=True when the group asks for it (bfloat16 included), other reductions and dtypes without it,
    as on the host path (whose bfloat16 views, numpy kind "V", take it too)."""
    import torch.distributed as dist

    import ringcomm
    from ringcomm import torch_cuda
    from ringcomm.torch import ProcessGroupRingcomm
    from ringcomm.torch_support import host_view
    calls = []

    class Comm:
        def all_reduce(self, t, op, **kw):
            calls.append(("all_reduce", op, t.dtype, kw))

        def reduce(self, t, root, op, **kw):
            calls.append(("reduce", op, t.dtype, kw))

        def reduce_scatter(self, x, y, op, **kw):
            calls.append(("reduce_scatter", op, x.dtype, kw))

    class Group:                        # what torch_cuda reads of a ProcessGroupRingcomm
        comm, reproducible, _rp = Comm(), True, ProcessGroupRingcomm._rp
    monkeypatch.setattr(torch_cuda, "_run", lambda pg, name, tensors, outputs, body: body())  # no streams here

    def opts(cls, op, root=None):
        o = cls()
        o.reduceOp = op
        if root is not None:
            o.rootRank = root
        return o
    pg, on = Group(), {"reproducible": True}
    torch_cuda.allreduce(pg, [torch.ones(4)])
    torch_cuda.allreduce(pg, [torch.ones(4, dtype=torch.bfloat16)], opts(dist.AllreduceOptions, dist.ReduceOp.AVG))
    torch_cuda.allreduce(pg, [torch.ones(4)], opts(dist.AllreduceOptions, dist.ReduceOp.MAX))
    torch_cuda.allreduce(pg, [torch.ones(4, dtype=torch.int32)])
    torch_cuda.reduce(pg, [torch.ones(4, dtype=torch.float16)], opts(dist.ReduceOptions, dist.ReduceOp.SUM, 1))
    torch_cuda.reduce_scatter_single(pg, torch.ones(2, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
                                     opts(dist.ReduceScatterOptions, dist.ReduceOp.SUM))
    pg.reproducible = False
    torch_cuda.allreduce(pg, [torch.ones(4)])
    assert calls == [("all_reduce", ringcomm.SUM, torch.float32, on), ("all_reduce", ringcomm.AVG, torch.bfloat16, on),
                     ("all_reduce", ringcomm.MAX, torch.float32, {}), ("all_reduce", ringcomm.SUM, torch.int32, {}),
                     ("reduce", ringcomm.SUM, torch.float16, on), ("reduce_scatter", ringcomm.SUM, torch.float64, on),
                     ("all_reduce", ringcomm.SUM, torch.float32, {})], calls
    pg.reproducible = True
    assert pg._rp(ringcomm.SUM, host_view(torch.ones(2, dtype=torch.bfloat16), "x", reduce=True)) == on
