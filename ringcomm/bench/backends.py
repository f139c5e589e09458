"""One rank's view of a library under test: ringcomm here, the peers (gloo, NCCL, MPI) in peers.py.

Every backend runs the same calls on the same numpy buffers, so the sweep (worker.py) is one piece
of code. ``call(...)`` returns a zero-argument function doing one collective and the array that
holds its result once ``sync()`` returned (it differs from ``out`` only where a library puts an
in-place result elsewhere, as MPI's in-place Reduce_scatter_block does).

Send / recv is measured the same way for everyone, as a ring shift with blocking calls: even ranks
send to rank + 1 and then receive from rank - 1, odd ranks the other way round (ringcomm's send is
blocking like MPI_Send, so this order is what keeps a ring of large messages from deadlocking).
"""
from __future__ import annotations

import os
import sys

import numpy as np


class Unsupported(Exception):
    """This backend cannot run this collective / dtype / op; the message says why."""


class Backend:
    name = "?"
    rank = 0
    world_size = 1

    def register(self, send_buf: np.ndarray, recv_buf: np.ndarray) -> None:
        """The sweep's two base buffers (device backends mirror them)."""

    def check(self, collective: str, dtype: np.dtype, op: str) -> None:
        """Raise Unsupported before any call if this backend cannot run the sweep."""

    def alloc(self, count: int, dtype) -> np.ndarray:
        """A buffer registered with the library (ringcomm-bench --registered); every rank calls it."""
        raise Unsupported(f"{self.name} has no registered buffers")

    def ran(self) -> str | None:
        """The algorithm the last call ran, where the library says (ringcomm); else None."""
        return None

    def call(self, collective, inp, out, op, root, in_place):
        raise NotImplementedError

    def sync(self) -> None:
        """Wait until the calls issued so far are complete (device backends are asynchronous)."""

    def upload(self, arr: np.ndarray) -> None:
        """Make the backend's copy of host array ``arr`` current (device backends)."""

    def download(self, arr: np.ndarray) -> np.ndarray:
        """The host copy of a result array (device backends copy back)."""
        return arr

    def barrier(self) -> None:
        raise NotImplementedError

    def gather_f64(self, values) -> np.ndarray:
        """Every rank's ``values`` as an (n, k) float64 array, on every rank."""
        raise NotImplementedError

    def facts(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def _ring_shift(self, send, recv, inp, out):
        """The blocking ring shift described in the module docstring."""
        n, r = self.world_size, self.rank
        to, frm = (r + 1) % n, (r - 1) % n
        if r % 2 == 0:
            def fn():
                send(inp, to)
                recv(out, frm)
        else:
            def fn():
                recv(out, frm)
                send(inp, to)
        return fn


class RingcommBackend(Backend):
    name = "ringcomm"

    def __init__(self, algo=None):
        import ringcomm
        self.comm = ringcomm.init()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.algo = algo
        self._first = None

    def ran(self) -> str | None:
        """The algorithm the last call made by call()'s function ran (automatic choice's pick included),
        from the communicator's record of known calls; None where it keeps none (sendrecv)."""
        known = self.comm._known.latest.get(id(self._first))
        return None if known is None else known.algo

    def call(self, collective, inp, out, op, root, in_place, reproducible=False):
        c, a, rp = self.comm, self.algo, reproducible
        self._first = inp   # the array comm remembers the call by (its first buffer): ran() reads it
        if rp:                      # only the reducing calls take it (ringcomm.bench.reproducible)
            kw = {"algo": a, "reproducible": True}
            if collective == "all_reduce":
                return (lambda: c.all_reduce(inp, op, out=None if in_place else out, **kw)), out
            if collective == "reduce_scatter":
                return (lambda: c.reduce_scatter(inp, out, op, **kw)), out
            return (lambda: c.reduce(inp, root, op, out=None if in_place else out, **kw)), out
        if collective == "all_reduce":
            return (lambda: c.all_reduce(inp, op, out=None if in_place else out, algo=a)), out
        if collective == "all_gather":
            return (lambda: c.all_gather(inp, out, algo=a)), out
        if collective == "reduce_scatter":
            return (lambda: c.reduce_scatter(inp, out, op, algo=a)), out
        if collective == "broadcast":
            buf = self._first = inp if self.rank == root else out  # one buffer a rank; the root's holds the data
            return (lambda: c.broadcast(buf, root, algo=a)), buf
        if collective == "reduce":
            return (lambda: c.reduce(inp, root, op, out=None if in_place else out, algo=a)), out
        if collective == "sendrecv":
            return self._ring_shift(c.send, c.recv, inp, out), out
        if collective == "all_to_all":
            return (lambda: c.all_to_all(inp, out, algo=a)), out
        if collective == "gather":  # only the root passes out
            dst = out if self.rank == root else None
            return (lambda: c.gather(inp, dst, root, algo=a)), out
        if collective == "scatter":  # only the root passes buf
            src = inp if self.rank == root else None
            self._first = out if src is None else src
            return (lambda: c.scatter(src, out, root, algo=a)), out
        raise ValueError(f"unknown collective {collective!r}")

    def alloc(self, count, dtype):
        return self.comm.alloc(count, dtype)

    def barrier(self):
        self.comm.barrier()

    def gather_f64(self, values):
        x = np.asarray(values, np.float64)
        out = np.empty(x.size * self.world_size, np.float64)
        self.comm.all_gather(x, out)
        return out.reshape(self.world_size, x.size)

    def facts(self):
        import ringcomm
        peers = {str(p): self.comm.transport_to(p) for p in range(self.world_size) if p != self.rank}
        return {"library": f"ringcomm {ringcomm.__version__}", "ringcomm": ringcomm.__version__,
                "transports_from_rank0": peers, "engine": self.comm._executor.engine,
                "env": {k: v for k, v in os.environ.items() if k.startswith("RINGCOMM_")
                        and k not in ("RINGCOMM_TOKEN",)}}

    def close(self):
        self.comm.close()


def make_backend(name: str, algo=None) -> Backend:
    """The backend ``name`` for this process; rank and world come from the launcher's environment."""
    if name == "ringcomm":
        return RingcommBackend(algo)
    from . import peers
    if name in ("gloo", "nccl"):
        return peers.TorchBackend(name)
    if name == "mpi":
        return peers.MpiBackend()
    raise ValueError(f"unknown backend {name!r}")


def python_facts() -> dict:
    return {"python": sys.version.split()[0], "numpy": np.__version__}
