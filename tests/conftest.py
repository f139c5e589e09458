"""Session set-up shared by every test module."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def native_kernels_compiled(request):
    """Compile the native engine's loop once, here, into numba's disk cache (~45 s of CPU on a
    fresh checkout, ~1 s to load once cached), so that the ranks of every world load it instead of each
    compiling it at its first call -- which, with a short RINGCOMM_TIMEOUT, looks like a stall.
    Then start the forkserver that the worlds' ranks fork from (tests/harness.py).

    Only where the session runs a test that may reach the loop: the native engine takes shm links
    only, so a session of `rdma` tests alone (CI's Soft-RoCE guest, where numba compiles under an
    emulated CPU for minutes) never does; its ranks fork from a server without the loop. A session
    of `no_ranks` tests (the CUDA simulator's kernel checks, which test_kernels_device.py runs in a
    pytest of their own) starts no ranks at all."""
    items = request.session.items
    if all(item.get_closest_marker("no_ranks") for item in items):
        return
    import harness
    if all(item.get_closest_marker("rdma") or item.get_closest_marker("no_ranks") for item in items):
        harness.start_forkserver(engine=False)
        return
    from ringcomm.engine_native import warm
    from ringcomm.kernels.host import SUPPORTED_DTYPES
    # Under pytest-xdist (`-n 2`, as the README runs the suite) the two workers go through the
    # element types in opposite orders: on a fresh checkout they compile different types side by
    # side, each under its own lock (warm_once), and load what the other compiled (46 s -> ~25 s).
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    order = list(SUPPORTED_DTYPES)
    warm(order[::-1] if int(worker[2:] or 0) % 2 else order)
    _compile_what_ranks_share()
    harness.start_forkserver()  # its ranks then load the loop from what this just compiled


def _compile_what_ranks_share():
    """numba's other disk-cached kernels, compiled here too: on a fresh checkout each rank of a
    world compiled them at its first use, all at once (the 16-bit float loop: 2.6 s of CPU a rank,
    eight at a time in the 8-rank worlds; the reproducible mode's 16 kernels ~0.2 s each)."""
    import numpy as np

    from ringcomm import stream_copy
    from ringcomm.kernels import host, reproducible
    for dt in (np.float16, host.BFLOAT16):
        a = np.ones(4, dt)
        host.reduce_copy(np.empty_like(a), a, a, "sum")
    if stream_copy.kernel():
        stream_copy.kernel()(np.zeros(64, np.uint8), np.ones(64, np.uint8))
    for dt in reproducible.DTYPES:
        reproducible.compile_host(dt)
