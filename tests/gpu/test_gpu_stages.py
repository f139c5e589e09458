"""Device check stages C1 (the slot protocol under lag) and C4 (a rank killed mid-collective) on a real GPU,
ranks sharing GPU 0. Skipped with the reason where there is no GPU (tests/gpu/run_on_device.sh runs them)."""
from __future__ import annotations

import pytest

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import unavailable

from harness import World  # noqa: E402
import gpu_work  # noqa: E402

WHY = unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=WHY or "")]
SMALL_FIFO = {"RINGCOMM_CUDA_BUFFSIZE": str(256 << 10), "RINGCOMM_NSLOTS": "4"}


@pytest.mark.timeout(120)
def test_c1_slot_protocol_under_lag():
    with World(2, SMALL_FIFO, timeout=60) as w:
        w.run(gpu_work.use_gpu, False)
        res = w.run(gpu_work.lag, 1 << 24, 1, timeout=90)         # 64 MiB through 4 slots of 64 KiB
        print(res)
        assert all(r["wrong"] == 0 for r in res), res
        assert res[1]["busy_at_return"], res        # the host returned while its GPU still lagged
        assert all(r["slices"] >= 4 * 200 for r in res), res      # each slot reused 200 times and more


@pytest.mark.timeout(120)
def test_c1_staged_over_tcp_under_lag():
    """Every peer "on another host" (RINGCOMM_TRANSPORT=tcp): device slices go through the tcp connection's
    registered host slots, posted by the proxy thread once the GPU's event for each has completed. Under the
    lag a post that did not wait for its event would send stale bytes: bit-exact, or the ordering is wrong.
    (Here the host cannot return before the lagging GPU: the peer needs its bytes over the network.)"""
    with World(2, {**SMALL_FIFO, "RINGCOMM_TRANSPORT": "tcp"}, timeout=60) as w:
        w.run(gpu_work.use_gpu, False)
        res = w.run(gpu_work.lag, 1 << 22, 1, timeout=90)         # 16 MiB through 64 KiB slots
        print(res)
        assert all(r["wrong"] == 0 for r in res), res
        assert all(r["slices"] >= 200 for r in res), res


@pytest.mark.timeout(120)
def test_c4_killed_rank_survivors_raise_and_close():
    with World(3, {**SMALL_FIFO, "RINGCOMM_TIMEOUT": "20"}, timeout=20) as w:
        w.run(gpu_work.use_gpu, False)
        w.start(gpu_work.loop_until_error, 60.0, 5, ranks=[2])
        w.start(gpu_work.loop_until_error, 60.0, None, ranks=[0, 1])
        w.procs[2].join(60)                 # reaped, as a launcher does: a zombie's pid still answers kill(0)
        answers = w.collect([0, 1], 90, "loop_until_error")
        w.broken = True                                          # rank 2 is gone: do not ask it to close
        res = [answers[r][1] for r in (0, 1)]
        print(res)
        assert all(a[0] == "ok" for a in answers.values()), answers
        assert all(r["error"] for r in res), res
        assert all(r["after_last_ok_s"] < 20 + 10 for r in res), res      # within RINGCOMM_TIMEOUT of rank 2's death
        assert all(r["close_s"] < 8.0 for r in res), res          # close() did not hang on the GPU
        assert all(r["stream_idle"] for r in res), res            # nor did the survivors' streams
