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
import sys
import time
import traceback

from ringcomm.store import TCPStore
from ringcomm.transport.shm import remove_stale

SPAWN = mp.get_context("spawn")
# A fresh rank pays ~1 s of CPU before its first call (Python, numpy, ringcomm, and numba loading the
# native engine's loop from its disk cache), most of a small test's time on 2 cores. With the forkserver,
# ranks fork from one process that has paid it once (tests/rank_preload.py). conftest.py starts it
# for every session that starts ranks.
FORKSERVER = mp.get_context("forkserver")
_forkserver_env: dict | None = None  # the environment the forkserver started with
PRELOAD_ENGINE = "RINGCOMM_TESTS_PRELOAD_ENGINE"   # tells rank_preload.py whether to load the loops


def start_forkserver(engine: bool = True) -> None:
    """Start the forkserver now (before any test counts this process's fds) with the rank preload:
    with the native engine's loops, or (``engine=False``) without them, for sessions whose links
    never run it (CI's Soft-RoCE guest, where compiling them would take minutes)."""
    global _forkserver_env
    from multiprocessing import forkserver
    FORKSERVER.set_forkserver_preload(["rank_preload"])
    # Python 3.11's forkserver ignores the sys.path it is handed and swallows the ImportError, so
    # the server finds tests/ through PYTHONPATH (its own environment only: restored at once).
    here = os.path.dirname(os.path.abspath(__file__))
    server_env = {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
                  PRELOAD_ENGINE: "1" if engine else "0"}
    saved = {k: os.environ.get(k) for k in server_env}
    os.environ.update(server_env)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    _forkserver_env = dict(os.environ)


# numba reads its NUMBA_* variables when imported, and the forkserver's preload imports numba. The
# CUDA simulator's switch is the exception the ranks can set after the fork: numba.cuda, which
# reads it, is not imported by the preload, so a forked rank re-reads numba's configuration
# (_use_numba_env) and then imports the simulator (~0.2 s of CPU, where a spawned rank paid ~1 s).
SET_AFTER_FORK = {"NUMBA_ENABLE_CUDASIM"}


def _context(env: dict):
    """The forkserver, unless this world's environment differs from the server's in a variable that
    the preloaded modules read when imported (numba's NUMBA_*, but SET_AFTER_FORK): then spawn."""
    if _forkserver_env is None:
        return SPAWN
    keys = {k for k in (*env, *_forkserver_env) if k.startswith("NUMBA_") and k not in SET_AFTER_FORK}
    return FORKSERVER if all(env.get(k) == _forkserver_env.get(k) for k in keys) else SPAWN


def _use_numba_env() -> None:
    """In a rank forked from the forkserver: numba's configuration from this rank's environment."""
    if "numba" not in sys.modules:   # spawned: numba reads it when first imported
        return
    from numba.core import config
    if bool(int(os.environ.get("NUMBA_ENABLE_CUDASIM") or 0)) != bool(config.ENABLE_CUDASIM):
        assert "numba.cuda" not in sys.modules, "the forkserver imported numba.cuda: spawn such worlds"
        config.reload_config()


class WorldError(AssertionError):
    pass


def _worker(rank, n, port, token, env, conn, rank0_hosts_store=False):
    os.environ.clear()  # the test's whole environment: a forked rank starts with the forkserver's
    os.environ.update(env)
    _use_numba_env()
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


def resources() -> tuple[set[str], set[str]]:
    """(open fds, live threads by "name#ident"): a baseline for leaked_since."""
    import threading
    return open_fds(), {f"{t.name}#{t.ident}" for t in threading.enumerate()}


def leaked_since(before, grace: float = 5.0) -> str:
    """"" when no more fds and threads are open than at ``before`` (from resources()); else what
    is new, by name. A listener that stays open (the parent communicator's) may be turning away a
    stranger as we look: another test's liveness probe that reached a port reused since, which a
    handshake thread refuses within a second. So threads born since get ``grace`` seconds to end
    (joined, not slept on) before counting; a thread that truly leaked is still there."""
    import threading
    deadline = time.monotonic() + grace
    for t in threading.enumerate():
        if f"{t.name}#{t.ident}" not in before[1] and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    fds, threads = resources()
    if len(fds) <= len(before[0]) and len(threads) <= len(before[1]):
        return ""
    return f"fds {sorted(fds - before[0])}, threads {sorted(threads - before[1])}"


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


def ran_at_once(rank: int, name: str, fn):
    """A ringcomm.work.Work for ``fn`` run now, on this thread, with its error (if any) kept in the
    Work as the progress thread keeps it: a stand-in for a communicator's progress.submit in tests
    that fake the communicator."""
    from ringcomm.work import Work
    work = Work(rank, name)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the Work carries it, as the progress thread does
        work._finish(e)
    else:
        work._finish(None)
    return work
