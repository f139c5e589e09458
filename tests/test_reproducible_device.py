"""Reproducible sums on device buffers without a GPU: the kernels compiled to PTX for sm_90, run under
numba's CUDA simulator against the host kernels (tests/device_sim_repro_checks.py, in a subprocess
started first), and the whole device path in real rank processes under the simulator."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from exact import bits, simulated
from harness import World

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM_TIMEOUT = 300
if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]' (the test extra has it)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def simulator_run():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
           str(ROOT / "tests" / "device_sim_repro_checks.py")]
    proc = subprocess.Popen(cmd, cwd=ROOT / "tests", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.timeout(300)
def test_reproducible_kernels_compile_to_ptx_for_sm_90(simulator_run):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1 in this process: compile_ptx needs the real numba.cuda")
    from numba import cuda
    from numba.cuda.cudadrv import nvvm
    if not nvvm.is_available():
        pytest.skip("NVVM (libnvvm) not found: pip install 'numba-cuda[cu12]', which brings nvidia-cuda-nvcc-cu12")
    from ringcomm.kernels import device_reproducible as DR
    from ringcomm.kernels import reproducible as R
    for dt in R.DTYPES:
        for name in ("codes", "encode", "decode", "canon"):
            fn, sig = DR.kernel_source(name, dt)
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
            assert ".target sm_90" in ptx and ptx.count(".entry ") == 1, (dt, name)
            assert (name == "decode") == ("clz.b64" in ptx), (dt, name)    # integer arithmetic only
            assert not any(f in ptx for f in ("add.f32", "add.f64", "cvt.rn.f")), (dt, name)


@pytest.mark.timeout(SIM_TIMEOUT + 30)
def test_reproducible_kernels_under_cuda_simulator(simulator_run):
    try:
        out, _ = simulator_run.communicate(timeout=SIM_TIMEOUT)
    except subprocess.TimeoutExpired:
        simulator_run.kill()
        out, _ = simulator_run.communicate()
        pytest.fail(f"the simulator checks took over {SIM_TIMEOUT} s:\n{out[-4000:]}")
    assert simulator_run.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]


def _device_calls(comm, xs):
    """all_reduce, reduce_scatter and reduce(root 1) of this rank's input, on simulated device buffers."""
    from numba import cuda
    x = xs[comm.rank]
    c = x.size // comm.world_size
    ar = cuda.to_device(x)
    comm.all_reduce(ar, "sum", reproducible=True)
    rs = cuda.to_device(np.zeros(c, x.dtype))
    comm.reduce_scatter(cuda.to_device(x), rs, reproducible=True)
    rd = cuda.to_device(np.zeros(x.size, x.dtype))
    comm.reduce(cuda.to_device(x), 1, out=rd, reproducible=True, algo="tree")
    return [bits(a.copy_to_host()).copy() for a in (ar, rs, rd)]


@pytest.mark.timeout(240)
def test_device_buffers_give_the_host_bits():
    sim = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "1024", "RINGCOMM_NSLOTS": "4"}
    rng = np.random.default_rng(5)
    xs = [(rng.standard_normal(60) * 2.0 ** rng.integers(-20, 20, 60)).astype(np.float32) for _ in range(3)]
    want = bits(simulated(xs))
    with World(3, sim, timeout=60) as w:                 # 3: the limbs' path (2 ranks add once)
        got = w.run(_device_calls, xs, timeout=200)
    for r, (ar, rs, rd) in enumerate(got):
        assert np.array_equal(ar, want)
        assert np.array_equal(rs, want[r * 20:(r + 1) * 20])
        assert np.array_equal(rd, want) if r == 1 else not rd.any()
