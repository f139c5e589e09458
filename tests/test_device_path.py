"""The whole device path on the CPU: numba's CUDA simulator in real rank processes.

Buffers are (simulated) numba device arrays, so every call goes through ringcomm.buffers' device views,
the DevicePath and its Executor, Links.device and the cuda_ipc transport (slots in /dev/shm as simulator
arrays, its events no-ops) and the device kernels. What the simulator cannot check -- cupy's runtime calls,
IPC handles and events, streams -- the GPU tests do (tests/gpu).
"""
from __future__ import annotations

import importlib.util

import pytest

from cases import sample_cases
from device_cases import p2p_and_world_checks, run_device_cases
from harness import World

if importlib.util.find_spec("numba_cuda") is None:      # numba >= 0.61 keeps its CUDA target (and simulator) there
    pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]' (the test extra has it)",
                allow_module_level=True)

# 256-byte device slots, 4 per FIFO: a few hundred elements cross many slices and rounds.
SIM = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "1024", "RINGCOMM_NSLOTS": "4"}
MAX_COUNT = 300          # the simulator runs one Python thread per CUDA thread: keep the data small


@pytest.fixture(autouse=True)
def _simulator_env(monkeypatch):
    # In the parent's environment, so the spawned ranks see it before anything imports numba.
    for k, v in SIM.items():
        monkeypatch.setenv(k, v)


def _cases(n, seed):
    cases = sample_cases(n, seed=seed, big=0)
    for c in cases:
        c["count"] = min(c["count"], MAX_COUNT)
    return cases


@pytest.mark.timeout(120)
def test_device_buffers_never_take_the_hosts_read_steps():
    """RINGCOMM_CMA_MIN=1 makes every host call a candidate for the CMA "read" steps, as large calls
    are on a machine with a core per rank (a 16-core H200 machine: every device call from 4 MiB took
    "read" and failed on the device executor). Device buffers keep the FIFO algorithms."""
    from device_cases import device_read_choice
    with World(2, {**SIM, "RINGCOMM_CMA_MIN": "1"}, timeout=60) as w:
        assert w.run(device_read_choice, timeout=90) == [None, None]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 3])
def test_collectives_on_device_buffers(n):
    with World(n, SIM, timeout=60) as w:
        failures = w.run(run_device_cases, _cases(n, 77 + n), "numba", timeout=200)
        assert failures == [[]] * n, "\n".join(f for per_rank in failures for f in per_rank)
        errors = w.run(p2p_and_world_checks, "numba", timeout=60)
        assert errors == [[]] * n, errors
