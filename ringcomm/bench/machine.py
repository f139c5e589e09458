"""Facts a figure needs beside it (which CPU, how many cores, which versions) and the memcpy ceiling."""
from __future__ import annotations

import os
import platform
import socket
import sys
import time

import numpy as np

MEMCPY_BYTES = 64 << 20  # far beyond the caches: the memory bandwidth one core can drive


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


DAMON_KDAMONDS = "/sys/kernel/mm/damon/admin/kdamonds"


def damon_schemes(root: str = DAMON_KDAMONDS) -> list[str]:
    """The actions of the running DAMON monitors (e.g. ["paddr pageout"]); [] where none runs or
    the kernel has none.

    DAMON's kernel thread (kdamond) wakes on its own schedule and takes a core for as long as its
    quota allows. With a busy rank on every core it preempts one of them: on the 2-core dev VM a
    rank lost its core for ~1 ms every ~0.51 s (perf's sched_switch, docs/06 "Slow runs"), which
    is a run of 30 small calls made 10x slower. A table that shows such runs names the cause."""
    running = [base for base in _subdirs(root) if _text(os.path.join(base, "state")) == "on"]
    contexts = [ctx for base in running for ctx in _subdirs(os.path.join(base, "contexts"))]
    return [" ".join(filter(None, [_text(os.path.join(ctx, "operations")),
                                   *(_text(os.path.join(s, "action")) for s in _subdirs(os.path.join(ctx, "schemes")))]))
            for ctx in contexts]


def _text(path: str) -> str | None:
    """A sysfs file's text, stripped; None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _subdirs(path: str) -> list[str]:
    """The numbered entries of a DAMON sysfs directory (its nr_* files left out)."""
    try:
        return [os.path.join(path, n) for n in sorted(os.listdir(path), key=lambda n: (len(n), n)) if n.isdigit()]
    except OSError:
        return []


PROC_STAT = "/proc/stat"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def steal_seconds(path: str = PROC_STAT) -> float | None:
    """CPU time the hypervisor has taken from this VM's vCPUs since boot, all CPUs together, in
    seconds (/proc/stat's "steal", kept by the kernel in nanoseconds and shown in clock ticks of
    10 ms); None where the file or the column is missing (not Linux, an old kernel).

    A vCPU the host deschedules stops whatever ran on it, and the guest's scheduler cannot see it:
    a rank looks on its CPU the whole time (perf's sched_switch shows nothing). So a run slower
    than its median with no guest thread to blame may be the host's doing, and the bench reads
    this before and after each run's timed calls to say so (runs.slow_lines)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) * _TICK_S


def facts() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    import ringcomm
    return {"host": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "cores_usable": usable, "machine": platform.machine(), "os": platform.platform(),
            "python": sys.version.split()[0], "numpy": np.__version__, "ringcomm": ringcomm.__version__,
            "loadavg_at_start": load, "damon": damon_schemes()}


def memcpy_gbps(nbytes: int = MEMCPY_BYTES, repeat: int = 5) -> float:
    """Best of ``repeat`` copies of ``nbytes`` between two touched buffers, in GB/s (10^9 B/s)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / 1e9 / best


class Progress:
    """A one-line bar on stderr while a sweep runs. Where stderr is not a terminal (a log, a pipe) the
    bar is a line of its own at each quarter of the sweep, and each finished job is a line."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done, self.stream = max(1, total), 0, stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()

    def step(self, label: str) -> None:
        before, self.done = self.done, self.done + 1
        width = 30
        fill = int(width * self.done / self.total)
        bar = "[%s%s] %3d/%d %-40s" % ("#" * fill, "." * (width - fill), self.done, self.total, label[:40])
        if self.tty:
            self.stream.write("\r" + bar)
            self.stream.flush()
        elif self.enabled and 4 * self.done // self.total > 4 * before // self.total:
            self.stream.write("ringcomm-bench: " + bar.rstrip() + "\n")
            self.stream.flush()

    def note(self, text: str, always: bool = False) -> None:
        """A line of its own (a finished job; with ``always``, even without progress: a skipped peer),
        kept above the bar."""
        if not (self.enabled or always):
            return
        if self.tty:
            self.stream.write("\r" + " " * 80 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
