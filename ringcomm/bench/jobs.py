"""Start one backend's ranks, follow rank 0's reports with a deadline, and always clean up.

ringcomm, gloo and nccl ranks get torchrun's environment (as ringcomm-run gives them), ringcomm's with
a store this process already serves (host_store); MPI ranks are
started by the mpiexec that belongs to the MPI that mpi4py loads (the `mpich` wheel puts it beside
this Python). Only rank 0 writes to a pipe; every rank's stderr goes to a file, whose last lines
explain a failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ringcomm.init import STORE_HOSTED_ENV
from ringcomm.launch import free_port, remove_shm

from .worker import PREFIX

EXTRA_HINT = "pip install 'ringcomm[bench]'"
GRACE_S = 10.0  # after one rank fails, how long the others get to report before they are stopped


class JobFailed(Exception):
    """A backend's job ended without finishing its sweep; the message says why, in one line."""


class PeerUnsupported(JobFailed):
    """The backend cannot run this sweep (dtype, op, no GPU...)."""


def skip_reason(e: JobFailed) -> str:
    """Why a peer's figures are missing, in one line: what it cannot do, or how its job failed."""
    return str(e) if isinstance(e, PeerUnsupported) else f"its job failed: {e}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (deliberately hidden)
        return False


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the `mpich` wheel's) first, else the first on PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which("mpiexec", path=here) or shutil.which("mpiexec")


def missing_reason(peer: str) -> str | None:
    """Why ``peer`` cannot run here, in one line, or None. Cheap: imports nothing heavy but for nccl."""
    if peer in ("gloo", "nccl") and not _importable("torch"):
        return f"torch is not installed ({EXTRA_HINT})"
    if peer == "mpi":
        if not _importable("mpi4py"):
            return f"mpi4py is not installed ({EXTRA_HINT})"
        if find_mpiexec() is None:
            return f"no mpiexec found beside {sys.executable} or on PATH ({EXTRA_HINT} brings MPICH's)"
    if peer == "nccl":
        import torch
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible here (torch.cuda.is_available() is False); NCCL needs GPUs"
    if peer not in ("gloo", "mpi", "nccl"):
        return f"unknown peer {peer!r} (use gloo, mpi or nccl)"
    return None


def _commands(backend: str, n: int, cfg: dict, token: str, store) -> tuple[list[list[str]], list[dict]]:
    """(one command per process to start, its environment); ``store``: the ringcomm job's store,
    served here (host_store), None for the other backends."""
    worker = [sys.executable, "-m", "ringcomm.bench.worker", backend, json.dumps(cfg)]
    base = dict(os.environ, PYTHONUNBUFFERED="1")
    if backend == "mpi":
        return [[find_mpiexec(), "-n", str(n)] + worker], [base]
    job = dict(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
               RINGCOMM_TOKEN=token, RINGCOMM_JOB_ID=cfg["job_id"])
    if store is not None:
        job.update(MASTER_PORT=str(store.port), **{STORE_HOSTED_ENV: "1"})
    else:  # torch's rank 0 binds it (env://): the window free_port() describes stays open for gloo
        job["MASTER_PORT"] = str(free_port("127.0.0.1"))
    if cfg.get("transport"):
        job["RINGCOMM_TRANSPORT"] = cfg["transport"]
    if cfg.get("engine"):
        job["RINGCOMM_ENGINE"] = cfg["engine"]
    job.setdefault("RINGCOMM_TIMEOUT", os.environ.get("RINGCOMM_TIMEOUT", str(cfg["timeout"])))
    envs = [dict(base, **job, RANK=str(r), LOCAL_RANK=str(r)) for r in range(n)]
    return [worker] * n, envs


def host_store(cfg: dict, token: str):
    """The store a ringcomm job's ranks meet through, served by this process on a port it binds
    itself; its ranks are told so (STORE_HOSTED_ENV), and ringcomm.init makes each a client. A port
    that free_port() picks and rank 0 binds a moment later can be taken in between by any process
    that binds port 0, and with --alternate gloo's and MPICH's ranks start at that moment: once in
    a few hundred jobs a sweep failed with "could not start the store server ...: Address already
    in use"."""
    from ringcomm.store import TCPStore
    return TCPStore("127.0.0.1", 0, is_server=True, token=token, timeout=cfg["timeout"])


class Job:
    """The processes of one backend's sweep. Iterate events(); close() in a finally."""

    def __init__(self, backend: str, n: int, cfg: dict):
        self.backend, self.timeout = backend, cfg["timeout"]
        self.job_id = cfg["job_id"]
        self.procs, self.logs, self.lines = [], [], queue.Queue()
        token = secrets.token_hex(16)
        self.store = host_store(cfg, token) if backend == "ringcomm" else None
        cmds, envs = _commands(backend, n, cfg, token, self.store)
        try:
            for i, (cmd, env) in enumerate(zip(cmds, envs)):
                log = tempfile.TemporaryFile()
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stderr=log, start_new_session=True,
                    stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL))
        except OSError as e:  # those already started must not outlive the failure
            self.close()
            raise JobFailed(f"could not start {cmds[len(self.procs)][0]}: {e}") from None
        threading.Thread(target=self._read, args=(self.procs[0].stdout,), daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _read(self, pipe) -> None:
        with pipe:
            for raw in pipe:
                line = raw.decode("utf-8", errors="replace")
                if line.startswith(PREFIX):
                    self.lines.put(json.loads(line[len(PREFIX):]))
        self.lines.put(None)

    def events(self):
        """Rank 0's events until `done` (see next_event)."""
        while True:
            ev = self.next_event()
            yield ev
            if ev["event"] == "done":
                return

    def next_event(self) -> dict:
        """Rank 0's next event; JobFailed (one line) on an error, a death or a silence longer than
        the timeout (counted from this call)."""
        deadline, failed_at = time.monotonic() + self.timeout, None
        while True:
            try:
                ev = self.lines.get(timeout=0.5)
            except queue.Empty:
                ev = "wait"
            now = time.monotonic()
            if ev is None:
                raise JobFailed(self._explain("its rank 0 stopped without finishing the sweep"))
            if isinstance(ev, dict):
                if ev["event"] == "unsupported":
                    raise PeerUnsupported(ev["message"])
                if ev["event"] == "error":
                    raise JobFailed(ev["message"])
                return ev
            dead = [p for p in self.procs if p.poll() not in (None, 0)]
            if dead and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > GRACE_S:
                raise JobFailed(self._explain(f"a process exited with status {dead[0].returncode}",
                                              first=self.procs.index(dead[0])))
            if now > deadline:
                raise JobFailed(self._explain(f"no report for {self.timeout:g} s (--timeout)"))

    def _explain(self, what: str, first: int = 0) -> str:
        """``what``, plus the most telling line a rank wrote to stderr (rank ``first``'s, if any)."""
        for log in self.logs[first:] + self.logs[:first]:
            log.seek(0)
            text = log.read().decode("utf-8", errors="replace").strip().splitlines()
            errs = [l.strip() for l in text if l.strip() and not l.startswith((" ", "Traceback"))]
            if errs:
                return f"{what}: {errs[-1][:300]}"
        return what

    def close(self, wait_s: float = 0.0) -> None:
        """Give the processes ``wait_s`` to exit on their own (after a finished sweep they are closing
        their communicators), then stop what still runs (process groups: mpiexec's ranks too) and
        remove this job's shared-memory segments."""
        until = time.monotonic() + wait_s
        for p in self.procs:
            try:
                p.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait(5.0)
        for log in self.logs:
            log.close()
        if self.store is not None:
            self.store.close()
        remove_shm(self.job_id)
