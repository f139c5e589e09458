"""The proxy: one thread per communicator that moves device slices between the GPU and the network.

A device call whose peer is on another host is staged through the tcp or ibverbs connection's own host
slots, registered with cudaHostRegister so our kernels write and read them directly (NCCL's proxy thread,
transport/net.cc, with the host slots as the "device" end). The caller's thread only queues GPU work and
records events; this thread does everything that must wait for the GPU or the network:

    send:  proxy acquires network slots ahead -> caller: kernels write the slot, record an event, hand it
           back -> proxy: once the event completes, post() it
    recv:  proxy takes arrived slices ahead  -> caller: kernels read the slot, record an event, hand it
           back -> proxy: once the event completes, release() it

so up to ``nslots`` slices per connection are in flight and the GPU runs ahead of the network. The caller
waits only when the proxy has no slot ready for it: flow control, as on any transport, never a query of
the GPU.

Why its own thread and not the communicator's progress thread (ringcomm/progress.py): that thread *runs*
calls, one at a time, and while it runs a device call it is the caller's thread here; the proxy must
work concurrently with whoever runs the call (NCCL's proxy beside its host thread). It is started at the
first staged connection, so a communicator that never stages has none.

Every wait has a deadline: a slice handed to the proxy must be done by the GPU within the communicator's
timeout, and a caller waiting for a slot gives up at its own deadline. abort() stops both. The first
failure (a dead peer, a GPU that does not finish, a CUDA error) is kept and raised in the caller's thread
at its next wait, as the error the connection itself would have raised, so the executor names the ranks,
the collective and the transport as for any connection.
"""
from __future__ import annotations

import os
import threading
import time

from ringcomm.transport import cuda_rt
from ringcomm.transport.base import PATROL_PERIOD, Aborted, PeerTimeout, TransportError
from ringcomm.transport.cuda_rt import CudaError

CLOSE_GRACE = 5.0       # how long a closing link lets the proxy post what its GPU finished


def _detailed(e: TransportError, detail: str) -> TransportError:
    """``detail``: what the executor adds to a timeout's message (it names ranks, call and transport itself)."""
    e.detail = detail
    return e


def _fresh(e: BaseException) -> BaseException:
    """A new instance of a kept error (raising one object twice piles up its tracebacks)."""
    if isinstance(e, TransportError):
        return _detailed(type(e)(str(e), peer=e.peer, transport=e.transport), getattr(e, "detail", ""))
    if isinstance(e, CudaError):
        return CudaError(e.call, e.error, e.code)
    return e


class Proxy:
    def __init__(self, rt, device: int, rank: int, timeout: float, abort, watchdog=None):
        self.rt, self.device, self.rank, self.timeout = rt, device, rank, timeout
        self.abort, self.watchdog = abort, watchdog
        self.cv = threading.Condition()  # guards every link's queues; callers and the thread wait on it
        self.lock = threading.Lock()     # held while the thread touches connections: close takes it to detach
        self.links: list = []
        self.error: BaseException | None = None     # the first failure of the thread's own work
        self._stop = False
        self._flush_by: float | None = None         # when closing links stop waiting for the proxy
        self._thread: threading.Thread | None = None

    # ---- the caller's side ------------------------------------------------------------------------

    def add(self, link) -> None:
        with self.cv:
            self.links.append(link)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"ringcomm-proxy-rank{self.rank}")
                self._thread.start()
            self.cv.notify_all()

    def take(self, link, deadline: float, what: str):
        """The next slot the proxy has ready on ``link`` (a network slot to fill, or an arrived slice).

        While none is ready the caller helps: if the proxy is not touching the connections right now, it
        takes what the network has itself (never blocking, never asking the GPU), which saves the hand-off
        to the proxy and back on every slice that arrives while the caller waits for it."""
        link.deadline = deadline
        pause, next_patrol = 0.0, time.monotonic() + PATROL_PERIOD
        while True:
            if self.error is not None:
                raise _fresh(self.error)
            if link.in_hand:                # only this thread pops; appends come under self.lock
                return link.in_hand.popleft()
            if link.error is not None:
                raise _fresh(link.error)
            if self._take_ahead_if_free(link):
                continue
            now = time.monotonic()
            if self.abort is not None and self.abort.is_set():
                raise Aborted(f"rank {self.rank}: abort requested while waiting for {what} over "
                              f"{link.transport}", peer=link.peer, transport=link.transport)
            if now > deadline:
                with self.cv:
                    behind = self._behind(now)
                raise _detailed(PeerTimeout(f"rank {self.rank} (this process) timed out waiting for {what} "
                                            f"over {link.transport}{'; ' + behind if behind else ''}",
                                            peer=link.peer, transport=link.transport), behind)
            with self.cv:
                if not link.wanted:         # the proxy polls while a caller wants something: wake it once
                    link.wanted = True
                    self.cv.notify_all()
                self.cv.wait(min(pause, deadline - now))
            pause = min(max(2 * pause, 1e-5), 1e-3)
            if self.watchdog is not None and time.monotonic() >= next_patrol:
                self.watchdog()
                next_patrol = time.monotonic() + PATROL_PERIOD

    def _take_ahead_if_free(self, link) -> bool:
        """Take arrived slices (or free slots) for ``link`` in this thread when the proxy is not touching
        the connections right now (never blocks); whether that left something in hand or an error."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            link.take_ahead()
        finally:
            self.lock.release()
        return bool(link.in_hand) or link.error is not None

    def poll(self, link) -> bool:
        """Whether take(link, ...) would return or raise at once: the non-blocking half of take (a group's
        loop polls its connections). Otherwise the proxy is told a caller wants a slot, once, and the slots
        it takes ahead from then on make a later poll true."""
        if self.error is not None or link.in_hand or link.error is not None:
            return True
        link.deadline = time.monotonic() + self.timeout     # a send link takes slots once a call needs them
        if self._take_ahead_if_free(link):
            return True
        if not link.wanted:
            with self.cv:
                link.wanted = True
                self.cv.notify_all()
        return False

    def _behind(self, now: float) -> str:
        """What the GPU still owes the proxy (with cv held): a slow GPU here may be why the peer is late."""
        queued = [item[2] - self.timeout for link in self.links for item in link.queue]
        if not queued:
            return ""
        return (f"meanwhile this rank's GPU has not finished its work on {len(queued)} slot(s) handed to the "
                f"proxy, the oldest queued {now - min(queued):.1f} s ago")

    def give(self, link, item) -> None:
        """Hand back a slot with the event recorded after the GPU work on it: the proxy finishes it."""
        with self.cv:
            link.queue.append(item)
            self.cv.notify_all()

    def detach(self, link, flush: bool) -> None:
        """Stop serving ``link``; first (``flush``) let the proxy finish what was handed to it, within
        CLOSE_GRACE (one window for all the links a close detaches) and unless a failure or an abort makes
        that pointless."""
        with self.cv:
            if self._flush_by is None:
                self._flush_by = time.monotonic() + CLOSE_GRACE
            deadline = self._flush_by
            while flush and link.queue and self.error is None and link.error is None and self.alive() \
                    and not (self.abort is not None and self.abort.is_set()) and time.monotonic() < deadline:
                self.cv.wait(0.01)
        with self.lock:                 # the thread is not touching the link's connection now
            with self.cv:
                if link in self.links:
                    self.links.remove(link)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (after the links are detached); never waits past CLOSE_GRACE."""
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_GRACE)

    # ---- the thread --------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with cuda_rt.on_device(self.rt, self.device):   # one communicator, one GPU, in every thread
                self._serve()
        except BaseException as e:  # noqa: BLE001 - e.g. a failing cudaSetDevice: the callers raise it
            with self.cv:
                self.error = self.error or e
                self.cv.notify_all()

    def _serve(self) -> None:
        pause, next_patrol = 0.0, time.monotonic() + PATROL_PERIOD
        while True:
            with self.cv:
                if self._stop:
                    return
                busy = self.error is None and any(link.busy() for link in self.links)
                if not busy:            # nothing to do until a caller asks: sleep until notified
                    self.cv.wait(PATROL_PERIOD)
                    pause = 0.0
                    continue
            patrol = time.monotonic() >= next_patrol    # time for ibverbs' liveness probes
            moved = self._round(patrol)
            if patrol:
                next_patrol = time.monotonic() + PATROL_PERIOD
            if moved:
                pause = 0.0
                with self.cv:
                    self.cv.notify_all()
            elif pause < 2e-5:          # spin briefly, then yield the core, then sleep (see Backoff)
                pause += 1e-6
                os.sched_yield()
            else:
                with self.cv:
                    self.cv.wait(pause)
                pause = min(2 * pause, 1e-3)

    def _round(self, patrol: bool) -> bool:
        """One pass over the links: what the GPU finished goes out, what the network has comes in."""
        aborting = self.abort is not None and self.abort.is_set()
        moved = False
        with self.lock:
            for link in list(self.links):
                try:
                    if aborting:
                        raise Aborted(f"rank {self.rank}: abort requested while the proxy served rank "
                                      f"{link.peer}", peer=link.peer, transport=link.transport)
                    moved |= link.pump(time.monotonic(), patrol)
                except (TransportError, CudaError) as e:
                    with self.cv:
                        self.error = self.error or e
                        self.cv.notify_all()
                    return True
        return moved
