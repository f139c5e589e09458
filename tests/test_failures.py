"""A peer that dies mid-collective gives every survivor a clear error, never a hang."""
from __future__ import annotations

import glob
import os
import re

import pytest

import jobs

@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sigkilled_rank_is_reported_by_every_survivor(tmp_path, transport):
    n, victim = 4, 2
    job = f"kill{os.getpid()}{transport}"
    env = dict(os.environ, RINGCOMM_TIMEOUT="10", PID_DIR=str(tmp_path), RINGCOMM_TRANSPORT=transport,
               RINGCOMM_JOB_ID=job)
    proc = jobs.launch(n, env)
    with jobs.running([proc]):
        jobs.wait_for_ranks(tmp_path, range(n), [proc], timeout=60)
        jobs.kill_rank(tmp_path, victim)
        (out,), elapsed = jobs.finish([proc], timeout=60)
    assert proc.returncode != 0
    assert elapsed < 30, f"the launcher took {elapsed:.1f} s to end the job"
    for r, line in jobs.survivor_errors(out, set(range(n)) - {victim}).items():
        assert re.search(rf"rank {r} \(this process\).* all_reduce #\d+ .*rank \d .*over {transport}", line), line
    assert f"rank {victim} failed first (killed by SIGKILL)" in out
    assert not glob.glob(f"/dev/shm/rc-{job}-*")
