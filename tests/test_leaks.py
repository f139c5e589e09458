"""Nothing leaks: file descriptors, threads and /dev/shm names are released on close and on SIGTERM."""
from __future__ import annotations

import glob
import os
import signal
import stat
import time

import numpy as np
import pytest

import ringcomm
from harness import World, leaked_since, resources


def _open_and_close(comm, transport):
    os.environ["RINGCOMM_TRANSPORT"] = transport
    before = resources()
    for _ in range(3):
        other = ringcomm.init(comm.rank, comm.world_size, store=comm._store)
        x = np.ones(100_000, np.float32)
        other.all_reduce(x)
        other.all_gather(x[:10], np.empty(10 * comm.world_size, np.float32))
        if transport == "shm":  # the single-copy paths map segments: a CMA-sized call, an allocation
            other.all_reduce(np.ones(1 << 18, np.float32))
            a = other.alloc(1 << 16, np.float32)
            other.all_reduce(a)
            del a
        other.close()
    return leaked_since(before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_close_releases_fds_and_threads(transport):
    with World(3, {"RINGCOMM_BUFFSIZE": "65536"}) as world:
        for rank, leaked in enumerate(world.run(_open_and_close, transport)):
            assert not leaked, f"rank {rank}: open after three init/close, not before: {leaked}"


def _send_and_wait_forever(comm):
    comm.send(np.ones(10, np.float32), 1)  # rank 1 never receives: rank 0 waits with its segment named


@pytest.mark.timeout(60)
def test_segments_are_private_and_unlinked_on_sigterm():
    with World(2, {"RINGCOMM_TIMEOUT": "60"}) as world:
        world.start(_send_and_wait_forever, ranks=[0])
        deadline = time.monotonic() + 30
        pattern = f"/dev/shm/rc-{world.job}-{world.procs[0].pid}-*"
        while not glob.glob(pattern):
            assert time.monotonic() < deadline, "rank 0 never created its segment"
            time.sleep(0.01)  # polling for the file with a deadline
        (segment,) = glob.glob(pattern)
        assert stat.S_IMODE(os.stat(segment).st_mode) == 0o600
        os.kill(world.procs[0].pid, signal.SIGTERM)
        world.procs[0].join(10)
        assert world.procs[0].exitcode == -signal.SIGTERM  # it still dies of SIGTERM
        assert not os.path.exists(segment), "SIGTERM left the segment in /dev/shm"
        world.kill()
