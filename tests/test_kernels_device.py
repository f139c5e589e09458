"""Device kernels without a GPU: every kernel compiled to PTX for sm_90, and all of them run under numba's
CUDA simulator against the host kernels (tests/device_sim_checks.py, in a subprocess started first so
that it runs while this process compiles).
"""
import itertools
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM_TIMEOUT = 300


@pytest.fixture(scope="module", autouse=True)
def simulator_run():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    # The simulator runs kernels as numpy scalar code, which warns when integers wrap; the device does not.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
           str(ROOT / "tests" / "device_sim_checks.py")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _compiler():
    """numba.cuda.compile_ptx, or a skip that says what is missing."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1 in this process: compile_ptx needs the real numba.cuda")
    try:
        from numba import cuda
        from numba.cuda.cudadrv import nvvm
    except ImportError as e:
        pytest.skip(f"numba-cuda is not installed ({e}): pip install 'numba-cuda[cu12]' (the test extra has it)")
    if not nvvm.is_available():
        pytest.skip("NVVM (libnvvm) not found: pip install 'numba-cuda[cu12]', which brings nvidia-cuda-nvcc-cu12")
    return cuda.compile_ptx


@pytest.mark.timeout(300)
def test_every_kernel_compiles_to_ptx_for_sm_90():
    compile_ptx = _compiler()
    from ringcomm.kernels import device as D

    compiled = {}
    for code, dt in itertools.product(range(5), D.SUPPORTED_DTYPES):
        fn, sig = D.kernel_source(code, dt)
        ptx, _ = compile_ptx(fn, sig, cc=(9, 0))
        assert ".target sm_90" in ptx and ptx.count(".entry ") == 1, (code, dt)
        if dt.kind == "f" and dt.itemsize > 2:
            assert ".ftz" not in ptx, f"{dt} kernel {code} flushes subnormals"    # no fast-math
            if code == D.DIV:
                assert f"div.rn.f{8 * dt.itemsize}" in ptx, f"{dt} AVG must divide exactly rounded"
        compiled[(code, dt)] = ptx
    # Every entry point of the public API, for every op and dtype, launches one of these kernels.
    used = set()
    for entry, op, dt in itertools.product(("reduce", "reduce_copy", "postprocess"), D.OPS, D.SUPPORTED_DTYPES):
        used |= {(code, np.dtype(dt)) for code in D.entry_kernels(entry, op, dt)}
    assert used == set(compiled)


@pytest.mark.timeout(SIM_TIMEOUT + 30)
def test_kernels_under_cuda_simulator(simulator_run):
    try:
        out, _ = simulator_run.communicate(timeout=SIM_TIMEOUT)
    except subprocess.TimeoutExpired:
        simulator_run.kill()
        out, _ = simulator_run.communicate()
        pytest.fail(f"the simulator checks took over {SIM_TIMEOUT} s:\n{out[-4000:]}")
    assert simulator_run.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]
