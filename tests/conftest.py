"""Session set-up shared by every test module."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def native_kernels_compiled(request):
    """Compile the native engine's loop once, here, into numba's disk cache (~10 s on a fresh
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
