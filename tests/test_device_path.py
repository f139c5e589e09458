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


@pytest.mark.timeout(240)
def test_recursive_doubling_carries_its_sum_in_device_memory():
    """Recursive doubling keeps its running sum in the output and carries it on (base="out" steps):
    on device buffers the kernels must start from the output, not the input. 3 ranks fold into 2,
    so every step kind of the schedule runs; AVG checks that the partial steps do not divide."""
    cases = [dict(collective="all_reduce", dtype=dt, op=op, count=count, algo="doubling", root=0,
                  inplace=inplace, seed=seed)
             for seed, (dt, op, count, inplace) in enumerate([("float32", "avg", 300, False),
                                                              ("bfloat16", "sum", 129, True),
                                                              ("int32", "max", 300, True),
                                                              ("float64", "prod", 65, False)])]
    with World(3, SIM, timeout=60) as w:
        failures = w.run(run_device_cases, cases, "numba", timeout=200)
    assert failures == [[]] * 3, "\n".join(f for per_rank in failures for f in per_rank)
