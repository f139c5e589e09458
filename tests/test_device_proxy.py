"""The proxy thread (ringcomm/proxy.py) that stages device slices to peers on other hosts, on the fake CUDA
runtime (tests/fake_cuda.py), whose streams really lag: every peer is made "remote" with
RINGCOMM_TRANSPORT=tcp, so every device link is a tcp connection staged through registered host slots.
Kernels run under numba's simulator, so results are checked bit for bit. Between real network namespaces
the same path runs in tests/test_two_hosts.py, and over ibverbs in tests/test_ibverbs_device.py."""
from __future__ import annotations

import importlib.util
import re

import pytest

import device_fault_work
import device_proxy_work as work
from harness import World

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]' (the test extra has it)",
                allow_module_level=True)

ENV = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "4096", "RINGCOMM_NSLOTS": "4",
       "RINGCOMM_TRANSPORT": "tcp"}
SLOW = 0.02             # seconds per kernel or copy on the fake GPU: the caller returns well ahead of it


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


@pytest.mark.timeout(120)
def test_the_caller_runs_ahead_of_a_slow_gpu_and_closes_with_slices_in_flight():
    with World(2, {**ENV, "RINGCOMM_DEBUG": "info"}, timeout=30) as w:
        w.run(work.install_slow, SLOW)
        res = w.run(work.ahead_of_a_slow_gpu, timeout=90)
        for r in res:
            assert r["right"], res
            assert "tcp+staged, device slices staged through its registered host slots by the proxy" in r["log"], r
            assert "GPUDirect RDMA not available" in r["log"] and "not used" in r["log"], r["log"]
            assert r["gpu_behind"], res                 # the call returned before our GPU was done
            assert r["caller_queried"] == [], res       # the caller's thread never polled a stream ...
            assert "cudaEventQuery" in r["proxy_calls"], res               # ... the proxy watched the events
        res = w.run(work.call_then_close, timeout=90)
        for r in res:
            assert r["right"] and not r["violations"], res
            assert r["close_s"] < 8.0 and not r["proxy_alive"], res
        assert any(r["queued_at_close"] for r in res), res                  # close really found work queued


@pytest.mark.timeout(120)
def test_abort_ends_a_call_whose_proxy_waits_for_the_gpu():
    with World(2, ENV, timeout=30) as w:
        w.run(device_fault_work.install)
        w.start(work.abort_while_the_proxy_waits, 0.5, ranks=[0])
        w.start(work.wait_for_error, ranks=[1])
        answers = w.collect([0, 1], 60, "abort")
        r0, r1 = answers[0][1], answers[1][1]
        assert r0["error"] and "aborted" in r0["error"] and "tcp+staged" in r0["error"], r0
        assert r0["after"] < 0.5 + 1.5, r0
        assert r1["error"] and r1["after"] < 10, r1     # the peer learns from the closed links, not its timeout
        reports = w.run(device_fault_work.close_and_report, timeout=60)
        assert all(r["close_s"] < 8.0 and not r["violations"] for r in reports), reports


@pytest.mark.timeout(120)
def test_a_gpu_that_never_finishes_times_out_in_the_proxy_by_name():
    with World(2, ENV, timeout=2.0) as w:
        w.run(device_fault_work.install)
        w.start(work.stuck_gpu_timeout, ranks=[0])
        w.start(work.wait_for_error, ranks=[1])
        answers = w.collect([0, 1], 60, "stuck")
        r0, r1 = answers[0][1], answers[1][1]
        assert r0["error"] and r0["error"].startswith("CollectiveTimeout"), r0
        # the proxy's own deadline, or the caller's while the proxy still waits for the GPU: either names it
        assert re.search(r"GPU (stream )?has not finished", r0["error"]) and "rank 1" in r0["error"], r0
        assert "all_reduce #" in r0["error"] and "tcp+staged" in r0["error"], r0
        assert "cuda_ipc" not in r0["error"], r0            # only staged links: the message says so
        assert r0["after"] < 3 * 2.0 + 3, r0
        assert r1["error"], r1
        reports = w.run(device_fault_work.close_and_report, timeout=60)
        assert all(r["close_s"] < 8.0 and not r["violations"] for r in reports), reports


@pytest.mark.timeout(90)
def test_a_killed_rank_makes_every_survivor_raise_within_the_deadline():
    with World(3, ENV, timeout=5.0) as w:
        w.run(device_fault_work.install)
        w.start(device_fault_work.die_after, 3, ranks=[2])
        w.start(device_fault_work.call_until_error, 30.0, ranks=[0, 1])
        w.procs[2].join(30)
        answers = w.collect([0, 1], 60, "call_until_error")
        res = [answers[r][1] for r in (0, 1)]
        assert all(a[0] == "ok" for a in answers.values()), answers
        assert all(r["type"] in ("PeerFailure", "CollectiveTimeout") for r in res), res
        assert all(r["after"] < 5.0 + 3.0 for r in res), res        # within the deadline
        assert any(r["type"] == "PeerFailure" and "rank 2" in r["error"] for r in res), res
