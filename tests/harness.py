"""Real multi-process worlds for tests.

A World is N spawned processes, each holding a Communicator, that run test
functions on request: starting Python, numpy and the connections once per world
instead of once per case keeps the collective matrix inside the time budget.
The test process hosts the store, unless ``rank0_hosts_store`` asks for rank 0 to host it as
under ringcomm-run (so that killing rank 0 kills the store). Every call has a deadline; a world that
misses one is killed. Closing a world checks that its ranks left no segment in
/dev/shm.
"""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import secrets
import time
import traceback

from ringcomm.store import TCPStore
from ringcomm.transport.shm import remove_stale

SPAWN = mp.get_context("spawn")
# A fresh rank pays ~1 s of CPU before its first call (Python, numpy, ringcomm, and numba loading the
# native engine's loop from its disk cache), most of a small test's time on 2 cores. With the forkserver,
# ranks fork from one process that has paid it once (tests/rank_preload.py). conftest.py starts it
# for sessions that compile the loop anyway; elsewhere (CI's Soft-RoCE guest) ranks are spawned.
FORKSERVER = mp.get_context("forkserver")
_forkserver_env: dict | None = None  # the environment the forkserver started with


def start_forkserver() -> None:
    """Start the forkserver now (before any test counts this process's fds) with the rank preload."""
    global _forkserver_env
    from multiprocessing import forkserver
    FORKSERVER.set_forkserver_preload(["rank_preload"])
    # Python 3.11's forkserver ignores the sys.path it is handed and swallows the ImportError, so
    # the server finds tests/ through PYTHONPATH (its own environment only: restored at once).
    here, saved = os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    _forkserver_env = dict(os.environ)


def _context(env: dict):
    """The forkserver, unless this world's environment differs from the server's in a variable that
    the preloaded modules read when imported (numba's NUMBA_*, e.g. its CUDA simulator): then spawn."""
    if _forkserver_env is None:
        return SPAWN
    keys = {k for k in (*env, *_forkserver_env) if k.startswith("NUMBA_")}
    return FORKSERVER if all(env.get(k) == _forkserver_env.get(k) for k in keys) else SPAWN


class WorldError(AssertionError):
    pass


def _worker(rank, n, port, token, env, conn, rank0_hosts_store=False):
    os.environ.clear()  # the test's whole environment: a forked rank starts with the forkserver's
    os.environ.update(env)
    import ringcomm
    if rank0_hosts_store:  # MASTER_ADDR, MASTER_PORT and RINGCOMM_TOKEN are in env
        store = None
        comm = ringcomm.init(rank, n)
    else:
        store = TCPStore("127.0.0.1", port, is_server=False, token=token, timeout=60)
        comm = ringcomm.init(rank, n, store=store)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args = msg
            try:
                conn.send(("ok", fn(comm, *args)))
            except BaseException as e:  # noqa: BLE001 - report everything to the test
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        comm.close()
        if store is not None:
            store.close()


class World:
    def __init__(self, n: int, env: dict | None = None, timeout: float = 60.0, rank0_hosts_store=False):
        self.n = n
        self.job = "t" + secrets.token_hex(4)
        self.token = secrets.token_hex(8)
        env = {**os.environ, "RINGCOMM_JOB_ID": self.job, "RINGCOMM_TIMEOUT": str(timeout), **(env or {})}
        if rank0_hosts_store:
            from ringcomm.launch import free_port
            self.store, port = None, free_port("127.0.0.1")
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RINGCOMM_TOKEN=self.token)
        else:
            self.store = TCPStore("127.0.0.1", 0, is_server=True, token=self.token, timeout=timeout)
            port = self.store.port
        self.procs, self.conns = [], []
        ctx = _context(env)
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, n, port, self.token, env, child, rank0_hosts_store),
                              daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.broken = False

    def run(self, fn, *args, timeout: float = 60.0, ranks=None):
        """fn(comm, *args) on every rank (or those in ``ranks``); returns the per-rank results."""
        ranks = range(self.n) if ranks is None else ranks
        self.start(fn, *args, ranks=ranks)
        answers = self.collect(ranks, timeout, fn.__name__)
        errors = [f"rank {r}: {value}" for r, (status, value) in answers.items() if status != "ok"]
        if errors:
            raise WorldError("\n".join(errors))
        return [answers[r][1] for r in ranks]

    def start(self, fn, *args, ranks=None):
        if self.broken:
            raise WorldError("this world was killed by an earlier failure")
        for r in range(self.n) if ranks is None else ranks:
            self.conns[r].send((fn, args))

    def collect(self, ranks, timeout: float, what: str = "its call") -> dict:
        """{rank: ("ok", value) | ("err", text)} for each rank, all within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        answers = {}
        for r in ranks:
            if not self.conns[r].poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise WorldError(f"rank {r} gave no answer within {timeout} s running {what}")
            answers[r] = self.conns[r].recv()
        return answers

    def kill(self):
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self._reap()

    def close(self):
        if not self.broken:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(10)
        self.kill()
        if self.store is not None:
            self.store.close()

    def _reap(self):
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()
        remove_stale(self.job)  # what ringcomm-run does for a job whose rank was SIGKILLed

    def leftovers(self) -> list[str]:
        return glob.glob(f"/dev/shm/rc-{self.job}-*")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        left = self.leftovers()
        for path in left:
            os.unlink(path)
        if left and exc[0] is None:
            raise WorldError(f"segments left in /dev/shm: {left}")


def open_fds() -> set[str]:
    """This process's open fds with their targets ("12->socket:[...]"), after freeing garbage.
    Compare sets, not counts: an earlier test's garbage may be freed meanwhile, and only what a
    test opened may not stay open."""
    import gc
    gc.collect()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the fd listdir itself used, gone by now
            pass
    return fds
