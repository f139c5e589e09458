"""Watching the GPU's progress on the device path against RINGCOMM_TIMEOUT, without blocking in CUDA.

The host queues a call's work and returns; the GPU runs it later. If a peer dies between moving a host
counter and its GPU writing the flag our stream waits for, our stream would wait for ever, and nobody
would know. So every call ends with an event on our stream (the one the caller's stream then waits on),
kept here with the call's name and the time it was queued:

- at the start of every device call the finished events are recycled; the oldest unfinished one older
  than the timeout raises CollectiveTimeout, and so does one that keeps more than MAX_PENDING calls
  queued ahead of the GPU past the timeout (the host waits, polling, for the oldest to finish first:
  that bounds how far the host runs ahead of a GPU that is merely slow);
- the error names what the stream waits on: the link, the peer and the flag value it waits for, read
  from the host-mapped flag words (cuda_ipc's ``stuck_on``);
- a patrol thread (every PATROL seconds, also while the host makes no call at all) lets our stream go
  when it waits for a flag of a peer whose process is gone, or for a flag that has not moved for
  RINGCOMM_TIMEOUT (a peer alive but failed: its GPU stuck, or its communicator aborted with work
  still queued): it writes RELEASE into that flag, so neither our stream nor the caller's (chained
  after it) hangs. What the stream computes from then on is not valid: the next call raises
  PeerFailure naming the dead peer, or CollectiveTimeout naming the flag that did not move.

Queries only: cudaEventQuery / cudaStreamQuery never block, so neither does a check, whatever the GPU does.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from ringcomm.transport import cuda_rt

from .errors import CollectiveTimeout, PeerFailure, RingcommError

MAX_PENDING = 8          # calls the host may queue ahead of the GPU before it waits for the oldest
CLOSE_GRACE = 5.0
PATROL = 0.5             # seconds between the patrol's looks at the flags our stream waits on


class ProgressWatch:
    def __init__(self, rt, rank: int, timeout: float, links, abort):
        self.rt, self.rank, self.timeout, self.links, self.abort = rt, rank, timeout, links, abort
        self.pending: deque = deque()   # (event, "all_reduce #7", time queued), oldest first
        self.spare: list = []           # finished events, for reuse
        self.lost: str | None = None    # set by the patrol: a peer died while our stream waited for it
        self.lost_as = PeerFailure      # ... or CollectiveTimeout: a flag did not move for the timeout
        self._behind: dict = {}         # id(link) -> (flag value, value waited for, since when) while behind
        self._stop = threading.Event()
        threading.Thread(target=self._patrol, daemon=True, name=f"ringcomm-gpu-watch-rank{rank}").start()

    def finished(self, stream: int, label: str) -> int:
        """Record the end of a call's work on ``stream``; the event, for the caller's stream to wait on."""
        event = self.spare.pop() if self.spare else self.rt.event_create()
        self.rt.event_record(event, stream)
        self.pending.append((event, label, time.monotonic()))
        return event

    def check(self, next_label: str) -> None:
        """Before queuing ``next_label``: forget what the GPU has finished, raise if it is stuck."""
        if self.lost:
            raise self.lost_as(self.lost)
        while self.pending:
            event, label, queued = self.pending[0]
            if self.rt.event_done(event):
                self.spare.append(self.pending.popleft()[0])
                continue
            if len(self.pending) < MAX_PENDING and time.monotonic() - queued <= self.timeout:
                return
            if not self._poll(event, queued + self.timeout, next_label):
                raise CollectiveTimeout(self._stuck(label, queued))

    def _poll(self, event: int, deadline: float, next_label: str) -> bool:
        pause = 1e-5
        while not self.rt.event_done(event):
            if self.abort is not None and self.abort.is_set():
                raise RingcommError(f"rank {self.rank} (this process) was aborted while {next_label} waited for "
                                    f"its GPU to finish earlier calls")
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return True

    def _stuck(self, label: str, queued: float) -> str:
        return (f"rank {self.rank} (this process) timed out after {self.timeout:g} s: its GPU stream has not "
                f"finished {label} {time.monotonic() - queued:.1f} s after the host queued it; "
                f"{self._waits_for()}")

    def _waits_for(self) -> str:
        """What our stream may wait for, by transport. Only cuda_ipc links make it wait on a peer (a flag);
        a staged link's stream never does (the proxy posts and releases only what the GPU finished)."""
        conns = list(self.links.conns.values())
        waits = [w for w in (c.stuck_on() for c in conns if hasattr(c, "stuck_on")) if w]
        if waits:
            return f"over cuda_ipc it waits for {'; '.join(waits)}"
        names = sorted({c.transport for c in conns})
        over = f"over {', '.join(names)} " if names else ""
        if any(n != "cuda_ipc" for n in names):     # staged links: the stream waits for no peer at all
            return (f"{over}it waits for no peer's signal (a staged link's stream never does; its proxy "
                    f"posts only what the GPU finished): a kernel or copy of its own is slow")
        return f"{over}no link's flag is behind: a kernel or copy of its own is slow"

    def _patrol(self) -> None:
        while not self._stop.wait(PATROL):
            try:
                conns = list(self.links.conns.values())
            except RuntimeError:                # the caller's thread added a link meanwhile: next time
                continue
            for conn in conns:
                if getattr(conn, "seg", None) is None or conn.seg.words is None or not conn.waited:
                    continue                    # not a cuda_ipc link, closed, or never waited on
                flag = conn.waited_flag()
                have, want = int(flag.host[0]), conn.waited
                if have >= want:
                    self._behind.pop(id(conn), None)
                    continue
                if conn.peer_dead():
                    flag.release()
                    self._lose(PeerFailure, f"rank {conn.peer} died while this rank's GPU stream waited for "
                                            f"its signal {have + 1} over cuda_ipc")
                    continue
                seen = self._behind.get(id(conn))
                now = time.monotonic()
                if seen is None or seen[:2] != (have, want):
                    self._behind[id(conn)] = (have, want, now)     # behind, and moving: wait on
                elif now - seen[2] > self.timeout:
                    flag.release()
                    self._lose(CollectiveTimeout, f"timed out after {self.timeout:g} s: this rank's GPU stream waited "
                                                  f"for rank {conn.peer}'s signal {have + 1} over cuda_ipc, which "
                                                  f"did not move for {now - seen[2]:.1f} s (the peer's GPU is "
                                                  f"stuck, or it stopped with work queued)")

    def _lose(self, kind, what: str) -> None:
        """The patrol let our stream go: the next call raises ``kind`` saying why (the first reason)."""
        if self.lost is None:
            self.lost_as = kind
            self.lost = (f"rank {self.rank} (this process): {what}; the stream was let go, so the device "
                         f"results of the calls still queued then are not valid")

    def close(self, stream: int) -> bool:
        """Whether ``stream`` drained within CLOSE_GRACE; if so the events are destroyed (else leaked)."""
        self._stop.set()
        if not cuda_rt.drain(self.rt, stream, time.monotonic() + CLOSE_GRACE, abort=None):
            return False
        try:
            for event in [e for e, _, _ in self.pending] + self.spare:
                self.rt.event_destroy(event)
        except cuda_rt.CudaError:
            pass
        self.pending.clear()
        self.spare.clear()
        return True
