"""Whole jobs under ringcomm-run for the failure tests: start, wait for the ranks, kill one, read.

The ranks run tests/scripts/allreduce_loop.py, which writes its pid to $PID_DIR/rank<R> once its
first collective is done, so "every rank is inside the loop" is a file check, not a sleep.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

LOOP = os.path.join(os.path.dirname(__file__), "scripts", "allreduce_loop.py")


def launch(n: int, env: dict, *launcher_args: str, prefix: tuple = (), script: str = LOOP) -> subprocess.Popen:
    """``ringcomm-run -n N [launcher_args] script`` (allreduce_loop.py unless said), optionally behind
    ``prefix`` (e.g. ``ip netns exec NS``), output merged into one text pipe."""
    cmd = [*prefix, sys.executable, "-m", "ringcomm.launch", "-n", str(n), *launcher_args, script]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_ranks(pid_dir, ranks, procs, timeout: float) -> None:
    """Until every rank has written its pid file; fails at once if a launcher exits early."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(pid_dir, f"rank{r}")) for r in ranks):
        for p in procs:
            assert p.poll() is None, f"launcher exited early with {p.returncode}: {p.stdout.read()}"
        assert time.monotonic() < deadline, f"ranks did not start within {timeout} s: {os.listdir(pid_dir)}"
        time.sleep(0.05)  # polling for files another process writes, with a deadline


@contextlib.contextmanager
def running(procs):
    """Whatever happens inside, no launcher (and so no rank) outlives the block."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def finish(procs, timeout: float) -> tuple[list[str], float]:
    """Each launcher's output once it has exited, and the seconds that took. One still running
    after ``timeout`` is killed, so the caller's time limit, not a TimeoutExpired, reports it."""
    t0 = time.monotonic()
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(0.0, t0 + timeout - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return outs, time.monotonic() - t0


def kill_rank(pid_dir, victim: int) -> None:
    with open(os.path.join(pid_dir, f"rank{victim}")) as f:
        os.kill(int(f.read()), signal.SIGKILL)


def survivor_errors(out: str, ranks) -> dict[int, str]:
    """The ``[rank R] ERROR ...`` line of each rank in ``ranks``; fails naming a rank that printed none."""
    lines = {}
    for r in ranks:
        line = next((x for x in out.splitlines() if x.startswith(f"[rank {r}] ERROR")), None)
        assert line is not None, f"rank {r} printed no error:\n{out}"
        lines[r] = line
    return lines
