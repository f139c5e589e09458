"""Session set-up shared by every test module."""
from __future__ import annotations

import pytest


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`, as the README runs the suite), compile the loop once in the
    controller before the workers start: each worker's fixture below then loads it from the disk
    cache instead of both compiling it at once (~20 s of CPU each on a fresh checkout)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from ringcomm.engine_native import warm
        warm()


@pytest.fixture(scope="session", autouse=True)
def native_kernels_compiled(request):
    """Compile the native engine's loop once, here, into numba's disk cache (~20 s on a fresh
    checkout, ~1 s to load once cached), so that the ranks of every world load it instead of each
    compiling it at its first call -- which, with a short RINGCOMM_TIMEOUT, looks like a stall.

    Only where the session runs a test that may reach it: the native engine takes shm links only,
    and a session of `rdma` tests alone (CI's Soft-RoCE guest, where numba compiles under an
    emulated CPU for minutes) never does."""
    if all(item.get_closest_marker("rdma") for item in request.session.items):
        return
    from ringcomm.engine_native import warm
    warm()
    import harness
    harness.start_forkserver()  # its ranks then load the loop from what this just compiled
