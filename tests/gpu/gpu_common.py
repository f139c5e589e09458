"""What the GPU tests and the device benchmark share: finding a GPU, and the tests folder on sys.path."""
from __future__ import annotations

import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))          # harness, cases, device_cases (spawned ranks inherit sys.path)


def unavailable() -> str | None:
    """Why the GPU path cannot run here (a skip reason), or None when it can."""
    try:
        import cupy
    except ImportError as e:
        return f"cupy is not installed ({e}): pip install 'ringcomm[cuda]'"
    try:
        import numba_cuda  # noqa: F401 - numba.cuda comes from numba-cuda since numba 0.61
    except ImportError:
        try:
            from numba import cuda  # noqa: F401
        except ImportError as e:
            return f"numba-cuda is not installed ({e}): pip install 'ringcomm[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - cupy raises CUDARuntimeError without a driver
        return f"no CUDA GPU: {type(e).__name__}: {e}"
    return None if n > 0 else "no CUDA GPU: cudaGetDeviceCount() is 0"


def gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def call_collective(comm, coll: str, x, out) -> None:
    """One call of ``coll`` as the device benchmarks time it: in place, root 0; ``out`` for the two
    collectives whose output differs in size from their input."""
    if coll == "all_reduce":
        comm.all_reduce(x)
    elif coll == "all_gather":
        comm.all_gather(x, out)
    elif coll == "reduce_scatter":
        comm.reduce_scatter(x, out)
    elif coll == "broadcast":
        comm.broadcast(x, 0)
    else:
        comm.reduce(x, 0)
