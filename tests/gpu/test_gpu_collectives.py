"""The GPU path on a real GPU: every collective x dtype on cupy, numba and torch buffers, 2 and 4 ranks
sharing one GPU (CUDA IPC between processes on one device) and, where there are several GPUs, one rank per
GPU; NCCL's stream rule; clear errors. Skipped with the reason where there is no GPU (run them with
tests/gpu/run_on_device.sh).
"""
from __future__ import annotations

import pytest

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import gpu_count, unavailable

from cases import sample_cases  # noqa: E402
from device_cases import p2p_and_world_checks, run_device_cases  # noqa: E402
from harness import World  # noqa: E402
import gpu_work  # noqa: E402

WHY = unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=WHY or "")]
# Small device slots as well as the default, so that big inputs cross many slices and rounds.
FIFOS = {"small": {"RINGCOMM_CUDA_BUFFSIZE": str(1 << 20), "RINGCOMM_NSLOTS": "4"}, "default": {}}


@pytest.fixture(scope="module", params=[(2, "small"), (4, "small"), (4, "default")],
                ids=["n2-small", "n4-small", "n4-default"])
def shared(request):
    n, fifo = request.param
    with World(n, FIFOS[fifo], timeout=120) as w:
        w.run(gpu_work.use_gpu, False)
        yield w


def _check(results):
    bad = [r for r in results if r]
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["cupy", "numba", "torch"])
def test_collectives_on_one_shared_gpu(shared, kind):
    pytest.importorskip(kind if kind != "numba" else "numba.cuda")
    cases = sample_cases(shared.n, seed=31 + shared.n, big=1 if kind == "cupy" else 0)
    failures = shared.run(run_device_cases, cases, kind, timeout=540)
    assert failures == [[]] * shared.n, "\n".join(f for per_rank in failures for f in per_rank)


@pytest.mark.timeout(300)
def test_p2p_and_mixed_buffers(shared):
    _check(e for per_rank in shared.run(p2p_and_world_checks, "cupy", timeout=240) for e in per_rank)


@pytest.mark.timeout(300)
def test_stream_rule_cupy_stream(shared):
    _check(shared.run(gpu_work.stream_order, timeout=240))


@pytest.mark.timeout(300)
def test_stream_rule_torch_default_stream(shared):
    pytest.importorskip("torch")
    _check(shared.run(gpu_work.torch_default_stream, timeout=240))


@pytest.mark.timeout(600)
def test_one_rank_per_gpu():
    n = min(gpu_count(), 4)
    if n < 2:
        pytest.skip(f"one rank per GPU needs 2 GPUs; this machine has {n}")
    with World(n, FIFOS["small"], timeout=120) as w:
        w.run(gpu_work.use_gpu, True)
        failures = w.run(run_device_cases, sample_cases(n, seed=7, big=1), "cupy", timeout=540)
        assert failures == [[]] * n, "\n".join(f for per_rank in failures for f in per_rank)


@pytest.mark.timeout(300)
def test_buffer_on_another_gpu_is_refused():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {gpu_count()}")
    with World(1, {}, timeout=60) as w:
        _check(w.run(gpu_work.wrong_device, timeout=120))
