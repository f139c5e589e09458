"""comm.group() on device buffers (issue 13's groups, on the device path): a ring shift whose messages are
~10x the FIFO, several messages between the same pair matched in issue order, device and host collectives in
the same group, an all-to-all as n - 1 sends and n - 1 receives; over cuda_ipc (peers on this host) and over
tcp staged by the proxy thread (RINGCOMM_TRANSPORT=tcp: every peer "on another host"). The fake runtime's
streams really queue and wait on flags, with every kernel or copy slowed, so the GPU lags the host and an
order that would deadlock a stream hangs here too (the test's timeout would say so)."""
from __future__ import annotations

import importlib.util

import pytest

import device_group_work as work
from harness import World

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]' (the test extra has it)",
                allow_module_level=True)

# 1 KiB device FIFOs (4 slots of 256 bytes): COUNT float32 is 10 FIFOs
ENV = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "1024", "RINGCOMM_NSLOTS": "4"}
COUNT = 2560
SLOW = 0.002            # seconds per kernel or copy on the fake GPU


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp+staged"])
def test_device_groups_complete_any_matching_set(transport, monkeypatch):
    env = dict(ENV, **({"RINGCOMM_TRANSPORT": "tcp"} if transport == "tcp+staged" else {}))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with World(3, env, timeout=30) as w:
        w.run(work.install, SLOW)
        assert w.run(work.first_contact_mixed, ranks=[0, 1], timeout=60) == [[]] * 2
        assert w.run(work.ring_shift_pairs_and_collectives, COUNT, timeout=120) == [[]] * 3
        assert w.run(work.all_to_all_by_pairs, COUNT, timeout=120) == [[]] * 3


@pytest.mark.timeout(120)
def test_a_device_group_that_stalls_times_out_naming_the_peer_and_the_transport(monkeypatch):
    """The group polls staged links through the proxy (never blocking in acquire): a peer that never receives
    still makes it raise after the timeout, naming the call, the peer and the transport."""
    env = dict(ENV, RINGCOMM_TRANSPORT="tcp")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with World(2, env, timeout=2.0) as w:
        w.run(work.install, 0.0)
        w.run(work.connect)
        w.start(work.group_outruns_the_peer, COUNT, ranks=[0])
        err = w.collect([0], 60, "the stalled group")[0][1]["error"]
        assert err and err.startswith("CollectiveTimeout"), err
        assert "timed out after 2 s in a group" in err and "recv #" in err, err
        assert "rank 1 over tcp+staged" in err, err


@pytest.mark.timeout(120)
def test_a_device_send_waits_for_a_late_receivers_slot_placement(monkeypatch):
    """Outside a group: a blocking device send whose receiver has not connected yet waits for it (the
    first acquire's wait for the slot placement), then delivers."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    with World(2, ENV, timeout=30) as w:
        w.run(work.install, 0.0)
        assert w.run(work.late_receiver, timeout=60) == [[]] * 2
