"""The device path's failure modes, on a fake CUDA runtime (tests/fake_cuda.py) in real rank processes.

The fake runtime's streams are queues a "GPU" thread runs, so a stream can wait -- for a peer's flag, for
an event -- and faults can be injected where numba's simulator runs everything at once: a GPU that stops,
a failed allocation, an IPC handle that does not open, a sticky error, a stream under graph capture.
Kernels still run under the simulator (NUMBA_ENABLE_CUDASIM=1), so results are checked bit for bit.
"""
from __future__ import annotations

import importlib.util
import time

import pytest

import device_fault_work as work
from harness import World

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]' (the test extra has it)",
                allow_module_level=True)

SIM = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "1024", "RINGCOMM_NSLOTS": "4"}
TIMEOUT = 2.0


@pytest.fixture(autouse=True)
def _simulator_env(monkeypatch):
    for k, v in SIM.items():
        monkeypatch.setenv(k, v)


@pytest.mark.timeout(120)
def test_ipc_where_it_works_staged_where_it_cannot_and_info_says_which():
    with World(3, {**SIM, "RINGCOMM_DEBUG": "info"}, timeout=30) as w:
        w.run(work.install, ranks=[0])
        w.run(work.install, ranks=[1])                  # rank 1 cannot see the others' GPU:
        w.run(_hide_gpus, ranks=[1])                    # per-rank CUDA_VISIBLE_DEVICES
        w.run(work.install, ranks=[2])
        w.run(work.inject, "cudaIpcOpenMemHandle", "cudaErrorMapBufferObjectFailed: mapping failed", ranks=[2])
        res = w.run(work.collectives_and_paths, 300, timeout=60)
        assert [r["error"] for r in res] == [None] * 3, res
        assert set(res[0]["modes"].values()) == {1}, res[0]                      # IPC
        assert set(res[1]["modes"].values()) == {2}, res[1]                      # STAGED
        assert "not visible to this process" in res[1]["log"], res[1]["log"]
        assert 2 in res[2]["modes"].values() and "did not open here" in res[2]["log"], res[2]
        assert "cudaErrorMapBufferObjectFailed" in res[2]["log"]
        assert "IPC (device memory" in res[0]["log"]
        for r in range(3):                  # each rank names its send links too, not only its receives
            assert f"rank {r} -> rank {(r + 1) % 3}: cuda_ipc" in res[r]["log"], res[r]["log"]
        reports = w.run(work.close_and_report)
        assert all(not r["violations"] and r["caller_idle"] for r in reports), reports


def _hide_gpus(comm):
    import fake_cuda
    fake_cuda.current().visible = {"fake:1"}


@pytest.mark.timeout(120)
def test_p2p_disable_forces_the_staged_path():
    with World(2, {**SIM, "RINGCOMM_P2P_DISABLE": "1", "RINGCOMM_DEBUG": "info"}, timeout=30) as w:
        w.run(work.install)
        res = w.run(work.collectives_and_paths, 300, timeout=60)
        assert [r["error"] for r in res] == [None, None], res
        assert all(set(r["modes"].values()) == {2} and "RINGCOMM_P2P_DISABLE=1" in r["log"] for r in res), res


@pytest.mark.timeout(120)
def test_a_stuck_peer_gpu_times_out_by_name_and_close_neither_hangs_nor_frees_in_use_memory():
    with World(2, SIM, timeout=TIMEOUT) as w:
        w.run(work.install)
        assert w.run(work.collectives_and_paths, 300, timeout=60)[0]["error"] is None
        w.run(work.freeze_gpu, ranks=[1])               # rank 1's GPU never writes another flag
        res = w.run(work.call_until_error, 30.0, timeout=60)
        assert res[0]["type"] == "CollectiveTimeout", res
        assert "GPU stream has not finished all_reduce" in res[0]["error"], res[0]
        assert "rank 1's data of slice" in res[0]["error"] and "signalled" in res[0]["error"], res[0]
        assert res[0]["after"] < 3 * TIMEOUT + 5, res
        assert res[1]["type"] is not None, res          # the frozen rank fails too, by its own watch or a peer
        reports = w.run(work.close_and_report, timeout=60)
        for r in reports:
            assert r["close_s"] < 8.0, reports          # CLOSE_GRACE (5 s) bounds every close
            assert not r["violations"], reports         # nothing freed under a busy stream
        assert reports[0]["caller_idle"], reports       # rank 0's stream was released, its caller's too


@pytest.mark.timeout(120)
def test_allocation_failure_is_a_ringcomm_error_and_the_peer_learns_at_once():
    with World(2, SIM, timeout=30) as w:
        w.run(work.install)
        w.run(work.inject, "cudaMalloc", "cudaErrorMemoryAllocation: out of memory", ranks=[0])
        res = w.run(work.one_call, timeout=60)
        assert res[0]["type"] == "DeviceError", res
        assert res[1]["after"] < 3.0, res                # at once, not at its timeout (30 s)
        assert "cudaMalloc" in res[0]["error"] and "cudaErrorMemoryAllocation" in res[0]["error"], res
        assert "all_reduce #1" in res[0]["error"], res
        assert res[0]["later"] == "CommunicatorClosed", res
        assert res[1]["type"] == "PeerFailure" and "failed to set up" in res[1]["error"], res


@pytest.mark.timeout(120)
def test_a_sticky_error_breaks_the_communicator_and_cleanup_does_not_hide_it():
    with World(2, SIM, timeout=30) as w:
        w.run(work.install)
        assert w.run(work.one_call) == [{"type": None}] * 2
        w.run(work.inject, "launching", "cudaErrorIllegalAddress: an illegal memory access", True, ranks=[0])
        res = w.run(work.one_call, timeout=60)
        assert res[0]["type"] == "DeviceError" and "cudaErrorIllegalAddress" in res[0]["error"], res
        assert "launching" in res[0]["error"], res                 # the CUDA call is named
        assert res[1]["type"] in ("PeerFailure", "CollectiveTimeout"), res
        reports = w.run(work.close_and_report, timeout=60)
        assert all(r["close_s"] < 8.0 for r in reports), reports


@pytest.mark.timeout(120)
def test_a_sticky_error_while_connecting_is_reported_not_the_cleanup_it_fails():
    """A sticky error at the first cudaHostRegister of a send connection fails the cleanup's
    cudaFree too: the error is still the first call's, with what it was doing."""
    with World(2, SIM, timeout=30) as w:
        w.run(work.install)
        w.run(work.inject, "cudaHostRegister", "cudaErrorIllegalAddress: an illegal memory access", True, ranks=[0])
        res = w.run(work.one_call, timeout=60)
        assert res[0]["type"] == "DeviceError", res
        assert "cudaHostRegister(4096 bytes) (connecting to send to rank 1) failed: cudaErrorIllegalAddress" \
            in res[0]["error"], res
        assert "cudaFree" not in res[0]["error"], res


@pytest.mark.timeout(60)
def test_one_gpu_whatever_the_thread_and_clear_refusals():
    with World(1, SIM, timeout=30) as w:
        w.run(work.install)
        assert w.run(work.device_checks, timeout=40) == [[]]


@pytest.mark.timeout(60)
def test_an_async_first_call_and_a_group_run_on_the_buffers_gpu():
    with World(1, SIM, timeout=30) as w:
        w.run(work.install)
        assert w.run(work.async_first_call_and_groups, timeout=40) == [[]]


@pytest.mark.timeout(60)
def test_abort_interrupts_a_device_connect_and_the_error_names_the_collective():
    with World(2, SIM, timeout=30) as w:
        w.run(work.install)
        res = w.run(work.abort_while_connecting, 0.5, ranks=[0], timeout=30)[0]
        assert res["error"] and "aborted while connecting to rank 1" in res["error"], res
        assert "for all_reduce #1" in res["error"] and "cuda_ipc" in res["error"], res
        assert res["after"] < 0.5 + 1.5, res            # a host call stops within ~1 s of abort(); so does this


@pytest.mark.timeout(60)
def test_the_watchdog_table_shows_where_a_device_call_waits():
    with World(2, SIM, timeout=TIMEOUT) as w:
        w.run(work.install)
        assert w.run(work.one_call) == [{"type": None}] * 2
        msg = w.run(work.lone_call, ranks=[0], timeout=30)[0]
        assert "timed out" in msg and "where every rank was" in msg, msg
        row = next(line for line in msg.splitlines() if line.strip().startswith("0 "))
        assert "all_reduce #2" in row and "rank 1" in row, msg


@pytest.mark.timeout(90)
def test_a_killed_rank_makes_every_survivor_raise_within_the_deadline():
    with World(3, SIM, timeout=5.0) as w:
        w.run(work.install)
        w.start(work.die_after, 3, ranks=[2])
        w.start(work.call_until_error, 30.0, ranks=[0, 1])
        w.procs[2].join(30)                 # reaped, as a launcher does: a zombie's pid still answers kill(0)
        answers = w.collect([0, 1], 60, "call_until_error")
        res = [answers[r][1] for r in (0, 1)]
        assert all(a[0] == "ok" for a in answers.values()), answers
        assert [r["type"] for r in res] == ["PeerFailure"] * 2, res  # the death noticed, not waited out
        assert all(r["after"] < 5.0 for r in res), res            # within RINGCOMM_TIMEOUT
        reports = w.run(work.close_and_report, ranks=[0, 1], timeout=60)
        assert all(r["close_s"] < 8.0 and not r["violations"] for r in reports), reports


@pytest.mark.timeout(120)
def test_a_peer_that_fails_but_lives_on_does_not_hang_the_callers_stream():
    """Rank 1's GPU stops after a call both hosts queued; rank 1 then aborts and closes, and its process
    lives on. Rank 0's stream waits for flags rank 1 will never write: the patrol lets it go once
    they have not moved for RINGCOMM_TIMEOUT, and rank 0's next call raises CollectiveTimeout naming
    rank 1's signal (it hung until then, and the stream for ever)."""
    with World(2, {**SIM, "RINGCOMM_TIMEOUT": "3"}, timeout=30) as w:
        w.run(work.install)
        assert w.run(work.one_call) == [{"type": None}] * 2
        w.run(work.freeze_gpu, ranks=[1])
        assert w.run(work.queue_a_call, timeout=60) == [None, None]
        w.start(work.give_up_and_stay, 12.0, ranks=[1])
        (res,) = w.run(work.callers_stream_released, 9.0, ranks=[0], timeout=60)
        w.kill()                                         # rank 1 is busy staying alive: not asked to close
        assert res["idle"] and res["after"] < 3 + 2 * 0.5 + 3, res
        assert res["next"].startswith("CollectiveTimeout") and "rank 1's signal" in res["next"], res


@pytest.mark.timeout(90)
def test_a_peer_dying_while_our_stream_waits_for_it_does_not_hang_the_callers_stream():
    with World(2, SIM, timeout=30) as w:
        w.run(work.install)
        assert w.run(work.one_call) == [{"type": None}] * 2
        w.start(work.freeze_call_die, ranks=[1])
        w.start(work.call_then_wait_for_the_gpu, ranks=[0])
        w.procs[1].join(30)                 # reaped, as a launcher does: a zombie's pid still answers kill(0)
        res = w.collect([0], 60, "call_then_wait_for_the_gpu")[0]
        assert res[0] == "ok", res
        assert res[1]["drained_s"] < 5.0, res           # the patrol let our stream go, long before the timeout
        assert res[1]["next"] and "PeerFailure" in res[1]["next"] and "rank 1 died" in res[1]["next"], res


def test_a_stuck_streams_message_names_the_transports_it_really_has():
    """The progress watch's timeout says what our stream waits for by the links it has: a cuda_ipc flag that
    is behind; no peer at all over staged links (the proxy posts only what the GPU finished); never
    "over cuda_ipc" for a communicator whose links are all staged."""
    from types import SimpleNamespace

    from ringcomm.device_watch import ProgressWatch

    class Ipc:
        transport = "cuda_ipc"

        def __init__(self, behind):
            self.behind = behind

        def stuck_on(self):
            return self.behind

    staged = SimpleNamespace(transport="tcp+staged")
    links = SimpleNamespace(conns={})
    watch = ProgressWatch(None, 3, 2.0, links, None)
    watch._stop.set()                                   # no patrol: nothing here is a real link
    links.conns = {(1, "send"): staged, (1, "recv"): SimpleNamespace(transport="tcp+staged")}
    msg = watch._stuck("all_reduce #4", time.monotonic())
    assert "rank 3 (this process) timed out after 2 s" in msg and "all_reduce #4" in msg, msg
    assert "over tcp+staged it waits for no peer's signal" in msg and "cuda_ipc" not in msg, msg
    links.conns = {(1, "recv"): Ipc("rank 1's data of slice 5 on this link"), (2, "send"): staged}
    assert "over cuda_ipc it waits for rank 1's data of slice 5" in watch._stuck("x #1", time.monotonic())
    links.conns = {(1, "recv"): Ipc(None)}
    assert "over cuda_ipc no link's flag is behind: a kernel or copy" in watch._stuck("x #1", time.monotonic())
