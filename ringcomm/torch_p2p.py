"""Point-to-point for the torch backend: isend / irecv that never block the group's other calls.

torch issues p2p calls one at a time (batch_isend_irecv on a Python process group is a loop of
isend / irecv; pipeline schedules post an irecv before the isend that will feed its peer). Run one
after another on the group's ordered queue, an irecv posted before its matching isend would wait
for ever: the peer's isend sits behind the peer's own irecv. So the calls are held here as they
are issued, and run together as one batch -- inside ``with comm.group():``, where any matching set
completes whatever its order and message sizes -- at the latest when any of them is waited on or
polled, when the group makes any other call, or when it shuts down. A communicator without
groups runs the batch's sends before its receives (each in issue order, so messages between a
pair still match in order): enough whenever the sends fit the FIFO.

Tags: messages between two ranks match in issue order, so a receive's tag must follow the same
order as the sends' (true of torch's own tests and of pipeline schedules); see the README.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist


class DeferredWork(dist.Work):
    """A p2p call held in its group's batch; waiting on it (or polling it) starts the batch."""

    def __init__(self, batch: P2PBatch, outputs: list):
        super().__init__()
        self._batch, self._outputs = batch, outputs
        self._real = None
        self._future = torch.futures.Future()

    def _started(self):
        if self._real is None:
            self._batch.flush()
        return self._real

    def bind(self, real) -> None:
        """The queued Work of the batch this call ran in; its future completes ours."""
        self._real = real

        def done(fut):
            try:
                fut.wait()
            except Exception as e:  # noqa: BLE001 - the error belongs to whoever waits on us
                self._future.set_exception(e)
            else:
                self._future.set_result(self._outputs)
        real.get_future().add_done_callback(done)

    def wait(self, timeout=None):
        return self._started().wait() if timeout is None else self._started().wait(timeout)

    def is_completed(self) -> bool:
        return self._started().is_completed()

    def is_success(self) -> bool:
        return self._started().is_success()

    def exception(self):
        return self._started().exception()

    def result(self) -> list:
        self.wait()
        return self._outputs

    def get_future(self):
        self._started()
        return self._future

    def synchronize(self) -> None:
        pass


class P2PBatch:
    """The p2p calls a process group has issued and not yet started, in issue order."""

    def __init__(self, pg):
        self._pg = pg
        self._lock = threading.Lock()  # a Work may be waited on from another thread than the caller's
        self._ops: list = []   # (is_send, run, DeferredWork)

    def add(self, is_send: bool, run, outputs: list) -> DeferredWork:
        work = DeferredWork(self, outputs)
        with self._lock:
            self._ops.append((is_send, run, work))
        return work

    def flush(self) -> None:
        """Queue the held calls as one call of the group (a no-op when none is held)."""
        with self._lock:
            ops, self._ops = self._ops, []
            if not ops:
                return
            comm = self._pg.comm

            def run():
                if hasattr(comm, "group"):
                    with comm.group():  # every call starts together: any matching set completes
                        for _, fn, _ in ops:
                            fn()
                else:  # sends first: they do not wait for the peer while they fit its FIFO
                    for _, fn, _ in sorted(ops, key=lambda op: not op[0]):
                        fn()
            names = sorted({"send" if s else "recv" for s, _, _ in ops})
            real = self._pg._submit_now("+".join(names), [o for _, _, w in ops for o in w._outputs], run)
            for _, _, work in ops:
                work.bind(real)
