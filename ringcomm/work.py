"""Work: the handle of a call made with ``async_op=True`` (see ringcomm/progress.py for where it runs).

Its buffers belong to the communicator until wait() returns True; wait(timeout) returns False while
the call still runs; the call's error is raised again by wait() and returned by exception().
"""
from __future__ import annotations

import threading
import traceback

import numpy as np

from .errors import RingcommError

POLL_S = 0.5  # Work.wait() wakes at once when its call ends; between, it checks the thread is alive


class Work:
    """The handle of a call made with ``async_op=True``. The call's buffers belong to the
    communicator until wait() returns True: do not read or write them before."""

    def __init__(self, rank: int, name: str, progress: "Progress | None" = None):
        self.rank, self.name, self.seq = rank, name, None
        self._progress = progress
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list = []

    def wait(self, timeout: float | None = None) -> bool:
        """True once the call has completed; its error, raised again, if it failed; False if
        ``timeout`` seconds passed first (the call goes on). Without a timeout the call's own
        waits (each bounded by the communicator's timeout) bound this one."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
                raise TypeError(f"Work.wait timeout must be a number of seconds or None, got {timeout!r}")
            if not timeout >= 0:
                raise ValueError(f"Work.wait timeout must be >= 0, got {timeout!r}")
            if not self._done.wait(float(timeout)):
                return False
        if not self._done.is_set() and self._progress is not None and self._progress.on_thread():
            raise RingcommError(f"rank {self.rank} (this process): {self} is queued behind the call the "
                                f"progress thread is running now; waiting for it there would never return")
        while not self._done.wait(POLL_S):
            if self._progress is not None and not self._progress.alive():
                raise RingcommError(f"rank {self.rank} (this process): {self} can never finish: the "
                                    f"communicator's progress thread has stopped")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """The call's error once it failed; None while it runs or after it succeeded."""
        return self._error if self._done.is_set() else None

    def add_done_callback(self, fn) -> None:
        """``fn(work)`` once the call ends (at once if it has): on the thread that ran the call."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a failing callback must not stop later calls
                traceback.print_exc()

    def __repr__(self):
        state = "running" if not self._done.is_set() else "failed" if self._error else "completed"
        return f"<ringcomm.Work {self}: {state}>"

    def __str__(self):
        return self.name if self.seq is None else f"{self.name} #{self.seq}"
