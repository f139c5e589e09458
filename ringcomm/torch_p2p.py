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

Tags and receives from any source match as gloo's do: by (source, tag), in send order within one
(source, tag). Every send first announces itself in the group's store: its source, tag and size,
pushed on the destination's queue of announcements (c10d's queue_push: one store call, which does
not wait for an answer; over a store without queues, FileStore, two: its number in the destination's
count of announced messages, then the announcement under that number). The receiver reads the
announcements in order (one queue_pop each) into a queue per source: per source, announcement order
is send order, which is also the order the connection delivers in. A receive takes the oldest
message of its source (or, from any source, of all sources) with its tag. The messages queued
before that one, of other tags, must be received first (one connection, one order): each goes into
a stash buffer of its announced size, and a later receive with its tag takes it from there.

A receive waiting for an announcement asks the store after growing pauses and, between them,
watches the links it waits on (P2PBatch._nap): its sender announced a message before sending it, so
data on a link means the store has news.

So a batch's receives run once their messages are announced, and a batch never waits for
announcements before its sends have started: it reads what is announced (without waiting), runs its
sends and the receives that can run in one ``comm.group()``, then waits for the next announcements
and receives, until every receive has its message. Its own sends were announced before it read
any, so of two ranks each sending to the other, at least one reads the other's announcement in its
first group: a send larger than the FIFO, which waits for its receiver, never waits in a cycle.

CUDA tensors (ringcomm/torch_cuda.py) join the same batch, CPU and CUDA calls mixed as torch allows:
at each call an event is recorded on the caller's current stream; the batch runs on the group's
stream of that device, which first waits for every such event, and a CUDA call's Work makes the
waiting thread's current stream wait for the batch (ProcessGroupNCCL's stream semantics). One
communicator drives one GPU, so a batch holds CUDA tensors of one device. A CUDA tensor's message
travels on the device path's connections, a CPU tensor's on the host's: two orders per source, so an
announcement says which, and a CUDA message is stashed in device memory.

Tags: matched as above. Without announcements (RINGCOMM_ANY_SOURCE=0, or a group made from a
Communicator alone) the receiver cannot see a message's tag: messages between two ranks then match in
issue order, and a send or receive with a tag other than 0 is refused (ValueError) rather than
risk a silent swap.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from . import torch_cuda
from .errors import CollectiveTimeout, StoreTimeout


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
        self._started().get_future()  # (on a worker of torch_support.COMPLETER: hands its queue on)
        return self._future

    def synchronize(self) -> None:
        if self._cuda:   # the current stream waits for the batch (a host tensor has nothing to order)
            self.wait()


class P2PBatch:
    """The p2p calls a process group has issued and not yet started, in issue order."""

    def __init__(self, pg, store):
        self._pg, self._store = pg, store
        self.announced = store is not None  # sends announce themselves: tags and receives from any source
        self._lock = threading.Lock()  # a Work may be waited on from another thread than the caller's
        self._ops: list = []   # _Op, in issue order
        # The receiver's side, touched on the queue's thread only: the next announcement to read; per
        # (source, kind) the announced messages not yet received, in send order; per (source, kind, tag)
        # the messages received into a stash buffer that no receive has taken yet, in send order.
        self._next, self._queued, self._stash = 1, {}, {}
        self._queues = store is not None and store.has_queues()    # alike on every rank: one store

    def send(self, view, dst: int, outputs: list, cuda=None, tag: int = 0) -> DeferredWork:
        """``cuda``: None for host memory, else (device, event recorded on the caller's current stream)."""
        return self._add(True, view, dst, tag, outputs, cuda)

    def recv(self, view, src: int | None, outputs: list, cuda=None, tag: int = 0) -> DeferredWork:
        """``src``: None for a receive from any source."""
        if src is None:
            self.check_any_source()
        return self._add(False, view, src, tag, outputs, cuda)

    def check_any_source(self) -> None:
        if not self.announced:
            raise NotImplementedError("recv from any source: this group's sends do not announce themselves "
                                      "(RINGCOMM_ANY_SOURCE=0, or a group made from a Communicator alone)")

    def _add(self, is_send: bool, view, peer, tag: int, outputs: list, cuda) -> DeferredWork:
        what = "send" if is_send else "recv"
        if tag != 0 and not self.announced:
            raise ValueError(f"{what} with tag {tag}: this group's sends do not announce themselves "
                             f"(RINGCOMM_ANY_SOURCE=0, or a group made from a Communicator alone), so a receiver "
                             f"cannot see a message's tag; messages then match in issue order, and only tag 0 is "
                             f"taken (a tag would be ignored, and a swap of two messages go unnoticed)")
        work = DeferredWork(self, outputs, cuda is not None)
        with self._lock:
            held = {op.cuda[0] for op in self._ops if op.cuda is not None}
            if cuda is not None and held and cuda[0] not in held:
                raise ValueError(f"{what}: a tensor on {cuda[0]} while this group holds "
                                 f"point-to-point calls on {held.pop()}; one communicator drives one GPU")
            self._ops.append(_Op(is_send, view, peer, int(tag), work, cuda))
        return work

    def flush(self) -> None:
        """Queue the held calls as one call of the group (a no-op when none is held)."""
        with self._lock:
            ops, self._ops = self._ops, []
            if not ops:
                return
            pg, cuda, end = self._pg, [op.cuda for op in ops if op.cuda is not None], [None]

            def run():
                if not cuda:
                    return self._run(ops)
                with torch_cuda.after_callers(pg, cuda, end):  # stream rule: ringcomm/torch_cuda.py
                    self._run(ops)
            names = sorted({"send" if op.is_send else "recv" for op in ops})
            host = pg._submit_now("+".join(names), [o for op in ops for o in op.work._outputs], run)
            device = torch_cuda.CudaWork(host._inner, host._outputs, cuda[0][0], end,
                                         torch_cuda.group_stream(pg, cuda[0][0])) if cuda else None
            for op in ops:
                op.work.bind(host if op.cuda is None else device)

    # ---- on the queue's thread ---------------------------------------------------------------

    def _run(self, ops) -> None:
        """The batch: its sends and the receives whose messages are announced in one group, then the
        other receives as their messages are announced (the module docstring says why)."""
        comm = self._pg.comm
        if not self.announced:  # every tag is 0: messages between two ranks match in issue order
            return _together(comm, [(op.is_send, _call(comm, op)) for op in ops])
        # Every send announces itself before any receive looks, so a receive issued before the sends
        # of its batch never waits for its peer's, which the peer would make only after its own receive.
        for op in ops:
            if op.is_send:
                self._announce(op)
        if not all(op.is_send for op in ops):
            self._read()
        pending, errors, deadline = ops, [], None
        while True:  # a round: the receives whose messages are announced, with the sends in the first
            calls, after, still = [], [], []
            for op in pending:  # in issue order: receives alike take their messages in send order
                if op.is_send:
                    calls.append((True, _call(comm, op)))
                elif not self._take(op, calls, after, errors):
                    still.append(op)
            _together(comm, calls)
            for copy in after:
                copy()
            if not still:
                break
            if deadline is None or len(still) < len(pending):  # the timeout counts from the last progress
                deadline = time.monotonic() + comm.timeout
            pending = still
            self._wait(pending, deadline)
        if errors:
            raise ValueError(errors[0])

    def _announce(self, op) -> None:
        text = f"{self._pg.comm.rank} {op.tag} {_nbytes(op.view)} {_kind(op)}"
        if self._queues:
            self._store.queue_push(f"anysrc/{op.peer}", text)
            return
        k = self._store.add(f"anysrc/{op.peer}/count", 1)
        self._store.set(f"anysrc/{op.peer}/{k}", text)

    def _next_announcement(self) -> bytes | None:
        """The next announcement made to this rank, taken from the store; None if there is none yet."""
        me = self._pg.comm.rank
        if self._queues:
            return self._store.queue_pop(f"anysrc/{me}")
        key = f"anysrc/{me}/{self._next}"
        try:
            value = self._store.get(key, timeout=0)
        except StoreTimeout:
            return None
        self._store.delete(key)
        return value

    def _read(self, most: int | None = None) -> int:
        """Queue the announcements made so far (at most ``most``), in order, without waiting; return
        how many."""
        n = 0
        while most is None or n < most:
            value = self._next_announcement()
            if value is None:
                return n
            src, tag, nbytes, kind = value.decode().split()
            msg = _Msg(self._next, int(src), int(tag), int(nbytes), kind)
            self._queued.setdefault((msg.src, kind), deque()).append(msg)
            self._next, n = self._next + 1, n + 1
        return n

    def _wait(self, waiting, deadline: float) -> None:
        """Wait until a new announcement is read (one: a look for the next costs a store round trip, and
        the receive loop looks again while it waits); CollectiveTimeout, naming the receive, past ``deadline``."""
        pause = _POLL_FIRST_S
        while not self._read(1):
            left = deadline - time.monotonic()
            if left <= 0:
                op, comm = waiting[0], self._pg.comm
                src = "any source" if op.peer is None else f"rank {op.peer}"
                more = f" (and {len(waiting) - 1} more receives)" if len(waiting) > 1 else ""
                raise CollectiveTimeout(
                    f"rank {comm.rank} (this process): recv from {src} with tag {op.tag}{more} timed out after "
                    f"{comm.timeout:g} s waiting for a matching send to be announced (announcement "
                    f"{self._next} to rank {comm.rank} in the store); was it sent, with that tag and a "
                    f"tensor of that kind?")
            self._nap(waiting, min(pause, left))
            pause = min(_POLL_GROWTH * pause, _POLL_MAX_S)

    def _nap(self, waiting, seconds: float) -> None:
        """Sleep ``seconds`` before the store is asked again, or less: until a link that a receive
        waits on holds data. Its sender announced that message before sending it, so the store has
        it now; a look at a link costs a memory read (shm), a look at the store a round trip. Links
        are looked at every _LINK_TICK_S, or 1/16 of the pause once the pauses grow long."""
        end, tick = time.monotonic() + seconds, max(_LINK_TICK_S, seconds / 16)
        while True:
            if self._link_has_news(waiting):
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(tick, left))

    def _link_has_news(self, waiting) -> bool:
        """Whether a host link from a rank a receive waits on holds a message that no announcement
        read so far accounts for (with announced messages of that link still unreceived, what it
        holds may be one of them: no news). Links not made yet, device links and transports that
        cannot tell say nothing (Executor.has_arrived). This runs on the group's queue thread, between
        its calls, as has_arrived requires."""
        comm = self._pg.comm
        peers = set()
        for op in waiting:
            if op.cuda is None:
                peers.update(range(comm.world_size) if op.peer is None else (op.peer,))
        return any(p != comm.rank and not self._queued.get((p, "h")) and comm._executor.has_arrived(p)
                   for p in peers)

    def _take(self, op, calls: list, after: list, errors: list) -> bool:
        """Plan receive ``op`` if its message is announced (else False): to ``calls`` the receives, the
        messages queued before it into the stash; to ``after`` a copy out of the stash."""
        kind = _kind(op)
        found = self._oldest(op.peer, op.tag, kind)
        if found is None:
            return False
        msg, stashed = found
        op.work.source = msg.src
        fits = msg.nbytes == _nbytes(op.view)
        if not fits:  # gloo refuses it too; the message is received and dropped, so later ones still match
            errors.append(f"recv from rank {msg.src} with tag {op.tag}: the message has {msg.nbytes} bytes, the "
                          f"tensor {_nbytes(op.view)}; a receive takes a tensor of the sent one's size")
        if stashed is not None:
            self._pop(self._stash, (msg.src, kind, msg.tag))
            if fits:
                after.append(lambda: _copy(op.view, stashed))
            return True
        comm = self._pg.comm
        while True:  # one connection delivers in send order: the messages before this one come first
            m = self._pop(self._queued, (msg.src, kind))
            if m is msg:
                break
            buf = _scratch(op.view, m.nbytes)
            calls.append((False, lambda buf=buf, m=m: comm.recv(buf, m.src)))
            self._stash.setdefault((m.src, kind, m.tag), deque()).append((m, buf))
        into = op.view if fits else _scratch(op.view, msg.nbytes)
        calls.append((False, lambda: comm.recv(into, msg.src)))
        return True

    def _oldest(self, src, tag: int, kind: str):
        """(message, its stash buffer or None): the oldest announced message from ``src`` (None: any
        source) with ``tag`` that no receive has taken; None if there is none yet."""
        if src is None:
            sources = {s for s, k in self._queued if k == kind} | {s for s, k, _ in self._stash if k == kind}
        else:
            sources = (src,)
        best = None
        for s in sources:
            stash = self._stash.get((s, kind, tag))
            if stash:   # received already: older than any of its source's still queued
                found = stash[0]
            else:
                found = next(((m, None) for m in self._queued.get((s, kind), ()) if m.tag == tag), None)
            if found is not None and (best is None or found[0].seq < best[0].seq):
                best = found
        return best

    @staticmethod
    def _pop(table: dict, key):
        q = table[key]
        item = q.popleft()
        if not q:
            del table[key]
        return item


# A receive waiting for its message's announcement polls the store: after 0.05 ms, then 1.5 times longer
# each time, up to 20 ms (TorchStore's most, ringcomm/torch_support.py). A gentle growth: a wait of t is
# seen by t * 1.5 at the latest (doubling would allow 2 t, a ping-pong's reply seen late at every hop).
_POLL_FIRST_S, _POLL_GROWTH, _POLL_MAX_S = 0.00005, 1.5, 0.02
# Between two looks at the store, a waiting receive looks at its links this often (P2PBatch._nap).
_LINK_TICK_S = 0.00005


class _Op(NamedTuple):
    is_send: bool
    view: object        # the tensor's memory: a numpy view, or the CUDA tensor itself
    peer: int | None    # the destination or source; None for a receive from any source
    tag: int
    work: DeferredWork
    cuda: tuple | None  # None for host memory, else (device, event recorded on the caller's stream)


class _Msg(NamedTuple):
    """An announced message."""
    seq: int     # its announcement's number: receives from any source take the oldest first
    src: int
    tag: int
    nbytes: int
    kind: str    # "h": from host memory, "c": from a CUDA tensor (each kind has its own connections)


def _kind(op) -> str:
    return "h" if op.cuda is None else "c"


def _nbytes(view) -> int:
    return int(view.nbytes)


def _scratch(like, nbytes: int):
    """A stash buffer of ``nbytes`` where ``like`` lives (host memory, or its CUDA device)."""
    if isinstance(like, np.ndarray):
        return np.empty(nbytes, np.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def _copy(view, buf) -> None:
    """A stashed message into the receive's memory (on the group's stream, for a CUDA tensor)."""
    if isinstance(view, np.ndarray):
        view.reshape(-1).view(np.uint8)[...] = buf
    else:
        view.reshape(-1).view(torch.uint8).copy_(buf)


def _call(comm, op):
    return (lambda: comm.send(op.view, op.peer)) if op.is_send else (lambda: comm.recv(op.view, op.peer))


def _together(comm, calls) -> None:
    """``calls``: (is_send, function) in issue order."""
    if not calls:
        return
    if hasattr(comm, "group"):
        with comm.group():  # every call starts together: any matching set completes
            for _, call in calls:
                call()
    else:  # sends first: they do not wait for the peer while they fit its FIFO
        for _, call in sorted(calls, key=lambda c: not c[0]):
            call()
