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

Receives from any source (gloo has them): every send first announces itself in the group's store
-- its number in the destination's count of announced messages, and its source (two store calls).
A receive from any source reads the next announcement whose message no directed receive has taken
(messages from one source arrive in send order, so the count per source tells) and receives from
that source. Announcements are read in the order the sends made them, so any-source receives take
messages first come, first served.

CUDA tensors (ringcomm/torch_cuda.py) join the same batch, CPU and CUDA calls mixed as torch allows:
at each call an event is recorded on the caller's current stream; the batch runs on the group's
stream of that device, which first waits for every such event, and a CUDA call's Work makes the
waiting thread's current stream wait for the batch (ProcessGroupNCCL's stream semantics). One
communicator drives one GPU, so a batch holds CUDA tensors of one device.

Tags: messages between two ranks match in issue order, so a receive's tag must follow the same
order as the sends' (true of torch's own tests and of pipeline schedules); see the README.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import torch_cuda


class DeferredWork(dist.Work):
    """A p2p call held in its group's batch; waiting on it (or polling it) starts the batch.
    For a CUDA tensor it is bound to the batch's CudaWork: wait() and synchronize() then make the
    waiting thread's current stream wait for the batch, as ProcessGroupNCCL's do."""

    def __init__(self, batch: P2PBatch, outputs: list, cuda: bool = False):
        super().__init__()
        self._batch, self._outputs, self._cuda = batch, outputs, cuda
        self._real = None
        self._future = torch.futures.Future()
        self.source = -1  # the sender, once a receive from any source has run

    def _source_rank(self) -> int:
        self.wait()
        return self.source

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
        if self._cuda:   # the current stream waits for the batch (a host tensor has nothing to order)
            self.wait()


class P2PBatch:
    """The p2p calls a process group has issued and not yet started, in issue order."""

    def __init__(self, pg, store):
        self._pg, self._store = pg, store
        self.announced = store is not None  # sends announce themselves, for receives from any source
        self._lock = threading.Lock()  # a Work may be waited on from another thread than the caller's
        self._ops: list = []   # _Op, in issue order
        # Receiver side of any-source, touched on the queue's thread only: the next announcement
        # to read, and per source how many of its messages were announced / taken by a receive.
        self._next, self._announced, self._taken = 1, {}, {}

    def _add(self, is_send: bool, run, outputs: list, cuda, announce=None) -> DeferredWork:
        work = DeferredWork(self, outputs, cuda is not None)
        with self._lock:
            held = {op.cuda[0] for op in self._ops if op.cuda is not None}
            if cuda is not None and held and cuda[0] not in held:
                raise ValueError(f"{'send' if is_send else 'recv'}: a tensor on {cuda[0]} while this group holds "
                                 f"point-to-point calls on {held.pop()}; one communicator drives one GPU")
            self._ops.append(_Op(is_send, announce, lambda: run(work), work, cuda))
        return work

    def send(self, view, dst: int, outputs: list, cuda=None) -> DeferredWork:
        """``cuda``: None for host memory, else (device, event recorded on the caller's current stream)."""
        comm = self._pg.comm

        def announce():
            k = self._store.add(f"anysrc/{dst}/count", 1)
            self._store.set(f"anysrc/{dst}/{k}", str(comm.rank).encode())
        return self._add(True, lambda work: comm.send(view, dst), outputs, cuda,
                         announce if self.announced else None)

    def recv(self, view, src: int | None, outputs: list, cuda=None) -> DeferredWork:
        if src is None:
            self.check_any_source()
        comm = self._pg.comm

        def run(work):
            work.source = self._next_source() if src is None else src
            self._taken[work.source] = self._taken.get(work.source, 0) + 1
            comm.recv(view, work.source)
        return self._add(False, run, outputs, cuda)

    def check_any_source(self) -> None:
        if not self.announced:
            raise NotImplementedError("recv from any source: this group's sends do not announce themselves "
                                      "(RINGCOMM_ANY_SOURCE=0, or a group made from a Communicator alone)")

    def _next_source(self) -> int:
        """The sender of the oldest announced message no receive has taken yet."""
        me = self._pg.comm.rank
        while True:
            key = f"anysrc/{me}/{self._next}"
            src = int(self._store.get(key, timeout=self._pg.comm.timeout))
            self._store.delete(key)
            self._next += 1
            self._announced[src] = self._announced.get(src, 0) + 1
            if self._announced[src] > self._taken.get(src, 0):
                return src

    def flush(self) -> None:
        """Queue the held calls as one call of the group (a no-op when none is held)."""
        with self._lock:
            ops, self._ops = self._ops, []
            if not ops:
                return
            pg, cuda, end = self._pg, [op.cuda for op in ops if op.cuda is not None], [None]

            def run():
                # Every send announces itself before any receive looks for one, so an any-source
                # receive issued before the sends of its batch never waits for its peer's, which
                # the peer would make only after its own such receive.
                for op in ops:
                    if op.announce is not None:
                        op.announce()
                if not cuda:
                    return _together(pg.comm, ops)
                with torch_cuda.after_callers(pg, cuda, end):  # stream rule: ringcomm/torch_cuda.py
                    _together(pg.comm, ops)
            names = sorted({"send" if op.is_send else "recv" for op in ops})
            host = pg._submit_now("+".join(names), [o for op in ops for o in op.work._outputs], run)
            device = torch_cuda.CudaWork(host._inner, host._outputs, cuda[0][0], end) if cuda else None
            for op in ops:
                op.work.bind(host if op.cuda is None else device)


class _Op(NamedTuple):
    is_send: bool
    announce: object    # None, or the send's announcement for receives from any source
    run: object
    work: DeferredWork
    cuda: tuple | None  # None for host memory, else (device, event recorded on the caller's stream)


def _together(comm, ops) -> None:
    if hasattr(comm, "group"):
        with comm.group():  # every call starts together: any matching set completes
            for op in ops:
                op.run()
    else:  # sends first: they do not wait for the peer while they fit its FIFO
        for op in sorted(ops, key=lambda op: not op.is_send):
            op.run()
