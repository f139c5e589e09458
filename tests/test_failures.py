"""A peer that dies mid-collective gives every survivor a clear error, never a hang."""
from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "allreduce_loop.py")


def _wait_for_files(paths, deadline, proc):
    while not all(os.path.exists(p) for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early with {proc.returncode}: {proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks did not start within the deadline: {os.listdir(os.path.dirname(paths[0]))}")
        time.sleep(0.05)  # polling for files another process writes, with a deadline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sigkilled_rank_is_reported_by_every_survivor(tmp_path, transport):
    n, victim = 4, 2
    job = f"kill{os.getpid()}{transport}"
    env = dict(os.environ, RINGCOMM_TIMEOUT="10", PID_DIR=str(tmp_path), RINGCOMM_TRANSPORT=transport,
               RINGCOMM_JOB_ID=job)
    proc = subprocess.Popen([sys.executable, "-m", "ringcomm.launch", "-n", str(n), SCRIPT], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_files([str(tmp_path / f"rank{r}") for r in range(n)], time.monotonic() + 60, proc)
        pid = int((tmp_path / f"rank{victim}").read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert elapsed < 30, f"the launcher took {elapsed:.1f} s to end the job"
    for r in set(range(n)) - {victim}:
        line = next((l for l in out.splitlines() if l.startswith(f"[rank {r}] ERROR")), None)
        assert line is not None, f"rank {r} printed no error:\n{out}"
        assert re.search(rf"rank {r} \(this process\).* all_reduce #\d+ .*rank \d .*over {transport}", line), line
    assert f"rank {victim} failed first (killed by SIGKILL)" in out
    assert not glob.glob(f"/dev/shm/rc-{job}-*")
