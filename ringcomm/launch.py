"""`ringcomm-run`: start N local ranks with torchrun's environment, watch them, clean up after them.

    ringcomm-run -n N [--nnodes M --node-rank K --master-addr A --master-port P] [--grace S]
                 [--bind core] script.py [args...]
    ringcomm-run -n N ... -m module [args...]

Stdlib only, so the launcher works before (and without) the heavy optional dependencies.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from .env import HOST_CPUS_ENV   # stdlib only, like this module

KILL_AFTER_S = 5.0  # between SIGTERM and SIGKILL
# The grace when RINGCOMM_TIMEOUT is unset. Survivors learn of a dead rank at once (its link, its
# pid) and say so within a few patrols, even where the news passes from rank to rank (8 ranks:
# ~4 s); a stalled rank shows only at the library's own timeout (300 s, init.DEFAULT_TIMEOUT),
# which a job should not linger for after its first failure: set RINGCOMM_TIMEOUT to see it.
GRACE_UNSET_S = 10.0
SHM_DIR = "/dev/shm"
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.]+$")


class LaunchError(Exception):
    """A mistake in the command line or environment, reported as `ringcomm-run: error: ...`."""


def default_grace() -> float:
    """Seconds the surviving ranks get after the first failure before we stop them.

    A survivor learns of a dead peer at once (a closed link, a pid gone), but of a stalled one
    only when its own wait times out (RINGCOMM_TIMEOUT); its error message names the peer and the
    collective, which is the most useful line of the run. So the grace is that timeout plus 5 s,
    letting the survivors print it before being stopped (GRACE_UNSET_S where it is unset).
    """
    try:
        timeout = float(os.environ["RINGCOMM_TIMEOUT"])
    except (KeyError, ValueError):
        return GRACE_UNSET_S
    return max(timeout, 0.0) + 5.0


def parse_args(argv):
    p = argparse.ArgumentParser(prog="ringcomm-run", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nproc-per-node", type=int, default=1, help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None,
                   help="default: a free port (one node only)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds the other ranks get after the first failure "
                        "(default: RINGCOMM_TIMEOUT + 5, or 10 where it is unset)")
    p.add_argument("--bind", choices=("none", "core"), default="none",
                   help="core: local rank i runs on the i-th usable CPU, modulo their number "
                        "(default none: the scheduler places the ranks)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module, like python -m")
    p.add_argument("script", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc_per_node < 1 or a.nnodes < 1:
        p.error("-n and --nnodes must be at least 1")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} is outside 0..{a.nnodes - 1}")
    if a.grace is None:
        a.grace = default_grace()
    if a.grace < 0:
        p.error("--grace must not be negative")
    return a


def free_port(addr: str) -> int:
    # The port is released before rank 0's store binds it; another process could take it in
    # between (torchrun has the same window). Acceptable for one node, hence required for several.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def usable_cpus() -> list:
    """The CPUs this launcher may use, in order: what --bind core deals out."""
    return sorted(os.sched_getaffinity(0))


def core_for(local_rank: int) -> int:
    """--bind core's rule: the usable CPU for ``local_rank``, modulo their number (the bench's
    --bind binds every library's ranks by it too)."""
    cpus = usable_cpus()
    return cpus[local_rank % len(cpus)]


def bind_cpu(a, local_rank: int):
    """The CPU local rank ``local_rank`` is bound to with --bind core (None without).

    With more ranks than cores the scheduler arranges the ranks anew at each launch, and the
    arrangement holds for the launch: 4 ranks on 2 cores, three launches, medians of 300-call
    loops, 1 MiB all_reduce 455-600 us, 256 KiB all_gather 116-182, 64 KiB broadcast 18-56; bound
    (rank i on CPU i mod cores: ring neighbours on different cores) 468-483, 117-120 and 22-23,
    launch after launch. (MPICH's ranks bound alike gained nothing; README "The launcher".)"""
    return core_for(local_rank) if a.bind == "core" else None


def job_environment(a) -> dict:
    """The variables shared by every rank of this node (per-rank ones are added in rank_env)."""
    port = a.master_port
    if port is None:
        if a.nnodes > 1:
            raise LaunchError("--master-port is required when --nnodes > 1 "
                              "(every node must name the same port)")
        port = free_port(a.master_addr)
    token = os.environ.get("RINGCOMM_TOKEN")
    if not token:
        if a.nnodes > 1:
            raise LaunchError("RINGCOMM_TOKEN is not set: with --nnodes > 1 every node must export "
                              "the same RINGCOMM_TOKEN (e.g. from `python -c 'import secrets; "
                              "print(secrets.token_hex(16))'`)")
        token = secrets.token_hex(16)
    job_id = os.environ.get("RINGCOMM_JOB_ID") or secrets.token_hex(4)
    if not _JOB_ID_RE.match(job_id):
        # The job id becomes part of /dev/shm names and of the prefix we delete at the end.
        raise LaunchError(f"RINGCOMM_JOB_ID {job_id!r} may hold only letters, digits, '_' and '.'")
    return {
        "WORLD_SIZE": str(a.nnodes * a.nproc_per_node),
        "LOCAL_WORLD_SIZE": str(a.nproc_per_node),
        "GROUP_RANK": str(a.node_rank),
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(port),
        "RINGCOMM_TOKEN": token,
        "RINGCOMM_JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",  # so a rank's lines reach us (and the terminal) as it prints them
        # Bound to one CPU each, the ranks still share these: the oversubscription rules count them.
        **({HOST_CPUS_ENV: str(len(usable_cpus()))} if a.bind == "core" else {}),
    }


def rank_env(a, job_env: dict, local_rank: int) -> dict:
    env = dict(os.environ, **job_env)
    env["RANK"] = str(a.node_rank * a.nproc_per_node + local_rank)
    env["LOCAL_RANK"] = str(local_rank)
    return env


def _write_line(stream, text: str, lock: threading.Lock) -> None:
    with lock:  # one lock for both streams keeps whole lines whole on a shared terminal
        try:
            try:
                stream.write(text)
            except UnicodeEncodeError:  # e.g. an ASCII-only terminal and a replaced byte
                enc = stream.encoding or "ascii"
                stream.write(text.encode(enc, errors="replace").decode(enc))
            stream.flush()
        except (ValueError, OSError):
            # Our stream is closed (e.g. `| head`). Keep draining: a rank whose pipe fills blocks.
            pass


def _pump(pipe, stream, prefix: bytes, lock: threading.Lock) -> None:
    """Copy a child's pipe to our stream, one prefixed line at a time."""
    with pipe:
        for raw in pipe:  # binary: a partial last line arrives as a final chunk without b"\n"
            if not raw.endswith(b"\n"):
                raw += b"\n"
            _write_line(stream, (prefix + raw).decode("utf-8", errors="replace"), lock)


def signal_ranks(procs, sig) -> None:
    """Send `sig` to every rank still running, and to whatever it started (its process group)."""
    for p in procs:
        if p.returncode is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    """Starts the ranks, forwards signals to them, and stops them after the first failure.

    Deadlines are on time.monotonic(): `term_at` (grace over: SIGTERM the rest) and `kill_at`
    (SIGTERM ignored for KILL_AFTER_S: SIGKILL). The signal handler only records and forwards;
    the main loop turns that into deadlines, so nothing clever runs inside the handler.
    """

    def __init__(self, a, job_env: dict):
        self.a, self.job_env = a, job_env
        first = a.node_rank * a.nproc_per_node
        self.ranks = list(range(first, first + a.nproc_per_node))
        self.procs, self.threads, self.received = [], [], []
        self.first_failure = None  # (rank, returncode)
        self.term_at = self.kill_at = None
        self.stopping = False      # we have signalled the ranks since the first failure
        self.exits: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # the ranks' lines and ours: each written whole (_write_line)

    def say(self, message: str) -> None:
        """A line of the launcher's own on stderr, never inside a rank's line (print() writes the
        text and its newline separately, and a rank's line could land between them)."""
        _write_line(sys.stderr, f"ringcomm-run: {message}\n", self.lock)

    def on_signal(self, signum, _frame) -> None:
        self.received.append(signum)
        # A second Ctrl-C means "now": skip the polite wait.
        signal_ranks(self.procs, signal.SIGKILL if len(self.received) > 1 else signum)

    def start(self) -> None:
        a = self.a
        cmd = [sys.executable] + (["-m"] if a.module else []) + [a.script] + a.args
        for i in range(a.nproc_per_node):
            if self.received:  # stopped while starting: start no more
                break
            # A session of its own: Ctrl-C in the terminal reaches only us, and we forward it once,
            # instead of every rank getting it twice (from the terminal and from us).
            cpu = bind_cpu(a, i)
            self.procs.append(subprocess.Popen(
                cmd, env=rank_env(a, self.job_env, i), start_new_session=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                preexec_fn=None if cpu is None else (lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))))
        for rank, p in zip(self.ranks, self.procs):
            prefix = f"[rank {rank}] ".encode()
            for pipe, stream in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                self._thread(_pump, pipe, stream, prefix, self.lock)
            self._thread(lambda r, p: self.exits.put((r, p.wait())), rank, p)

    def _thread(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _tick(self) -> float:
        """Act on passed deadlines; return how long to wait for the next exit."""
        now = time.monotonic()
        if self.received and self.kill_at is None:
            self.kill_at = now + KILL_AFTER_S
        if self.term_at is not None and now >= self.term_at:
            self.stopping = True
            signal_ranks(self.procs, signal.SIGTERM)
            self.term_at = None
            self.kill_at = min(self.kill_at or float("inf"), now + KILL_AFTER_S)
        if self.kill_at is not None and now >= self.kill_at:
            signal_ranks(self.procs, signal.SIGKILL)
            self.kill_at = float("inf")
        # Wake at least once a second so a signal's new deadline is noticed promptly.
        wake = min(d for d in (self.term_at, self.kill_at, now + 1.0) if d is not None)
        return max(wake - now, 0.01)

    def _on_exit(self, rank: int, code: int) -> None:
        # Ranks dying because *we* forwarded a signal are not failures of their own.
        if code == 0 or self.received:
            return
        if self.first_failure is None:
            self.first_failure = (rank, code)
            self.say(f"rank {rank} {describe(code)}; stopping the other ranks in {self.a.grace:g} s")
            self.term_at = time.monotonic() + self.a.grace
        elif code < 0 < self.first_failure[1] and not self.stopping:
            # A rank killed by a signal nobody here sent outranks one that exited with an error: the
            # error is most likely that rank's peers reporting its death, and each rank's exit
            # reaches this queue from a thread of its own, in whatever order they were scheduled.
            self.first_failure = (rank, code)
            self.say(f"rank {rank} {describe(code)}")

    def wait(self) -> int:
        """Wait for every rank; return the launcher's exit code."""
        for _ in self.procs:
            while True:
                try:
                    self._on_exit(*self.exits.get(timeout=self._tick()))
                    break
                except queue.Empty:
                    pass
        return self.result()

    def result(self) -> int:
        if self.first_failure is not None:
            rank, code = self.first_failure
            self.say(f"rank {rank} failed first ({describe(code)})")
            return code if code > 0 else 128 - code
        if self.received:
            name = signal.Signals(self.received[0]).name
            self.say(f"stopped by {name}")
            return 128 + self.received[0]
        return 0


def remove_shm(job_id: str) -> list:
    """Delete this job's shared-memory segments; a rank killed by SIGKILL cannot do it itself."""
    prefix, removed = f"rc-{job_id}-", []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        job_env = job_environment(a)
    except LaunchError as e:
        print(f"ringcomm-run: error: {e}", file=sys.stderr)
        return 2
    sup = Supervisor(a, job_env)
    # Handlers go in before the first rank starts: a SIGTERM that arrived in between would kill
    # us and orphan ranks living in sessions of their own.
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.start()
        return sup.wait()
    finally:
        signal_ranks(sup.procs, signal.SIGKILL)  # only does anything if we got here by an exception
        for s, h in old.items():
            signal.signal(s, h)
        for t in sup.threads:
            # A grandchild that outlives its rank may hold a pipe open; don't wait on it forever.
            t.join(timeout=2.0)
        remove_shm(job_env["RINGCOMM_JOB_ID"])


if __name__ == "__main__":
    sys.exit(main())
