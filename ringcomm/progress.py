"""The progress thread: where every call of a communicator runs, in the order it was issued.

A communicator's calls behave like work on one CUDA stream: blocking or not, they run one at a
time in issue order, so every rank meets its peers in the same order. Three ways in:

- a blocking call issued while nothing is queued or running runs inline, on the caller's thread:
  no hand-off, so a small collective costs what it did before there was a progress thread (a
  wake-up across cores costs ~100 us here, more than the collective);
- ``async_op=True`` checks the arguments on the caller's thread (TypeError / ValueError at once,
  before any byte moves), queues what the call would run and returns a ``Work``; a blocking call
  issued behind queued work queues too and waits for its own Work;
- ``Progress.submit(name, fn)`` queues any function (the torch backend's calls).

One thread, started at the first queued call, runs the queue. Whoever runs calls -- that thread
or an inline caller -- holds ``token``; calls the thread makes while it runs one (a torch call, a
Work's callback) run inline: they are next in order by construction.

How a public method opts in: decorate it with ``@asyncable``. Its body checks the arguments on
the caller's thread, then hands each data movement to ``comm._execute(sched, call)``, which runs
it now, queues it, or gives it to an open ``comm.group()`` (ringcomm/group.py). Work that must run
in order with the data but is not one schedule -- RINGCOMM_DEBUG=check's comparison, a multi-pass
call whose later passes read what earlier ones moved -- goes in ``comm._progress.later(fn)``; fn
runs where the data moves (inside a group: before the group's members) and may call
``comm._execute_now`` directly. Code after ``_execute`` in the body must not read what it moved.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections import deque

import numpy as np

from .errors import CommunicatorClosed
from .work import Work

CLOSE_GRACE = 5.0   # after an abort, how long close() waits for the call in flight to notice it


class _Capture:
    """What an async call leaves to run later: its steps, in order."""

    def __init__(self):
        self.steps: list = []
        self.seq = None

    def execute(self, run_now, sched, call) -> None:
        self.seq = call.seq if self.seq is None else self.seq
        self.steps.append(functools.partial(run_now, sched, call))

    def later(self, fn) -> None:
        self.steps.append(fn)

    def __call__(self) -> None:
        for step in self.steps:
            step()


class Progress:
    """One communicator's queue of calls, its progress thread, and the inline fast path."""

    def __init__(self, rank: int, run_now, on_overdue):
        self.rank = rank
        self._run_now = run_now        # comm._execute_now(sched, call): moves the bytes
        self._on_overdue = on_overdue  # comm.abort: what close() does when queued work overruns
        self.token = threading.Lock()  # held by whoever runs calls now: the thread or an inline caller
        self._issue = threading.Lock()  # one capture at a time: queue order is issue order
        self._cv = threading.Condition()  # guards _queue, _captures, _closing, idle; wakes the thread
        self._queue: deque = deque()
        self._captures: dict = {}  # thread id -> its open capture (_Capture or Group)
        self.capturing = False     # _captures is not empty: execute() must look
        self._closing: str | None = None
        # The fast path's one test: nothing queued, no capture open, not closing. Read without
        # the lock, so the fast path re-reads it once it holds the token.
        self.idle = True
        self._thread: threading.Thread | None = None
        self._ident = None  # the progress thread's id: calls it makes while running one go inline

    def _update(self) -> None:  # with _cv held
        self.capturing = bool(self._captures)
        self.idle = not self._queue and not self.capturing and self._closing is None

    # ---- issuing ----------------------------------------------------------------------------

    def capture(self):
        """The capture open on this thread (a Group, while a group block runs), or None."""
        return self._captures.get(threading.get_ident()) if self._captures else None

    def set_capture(self, capture) -> None:
        with self._cv:
            if capture is None:
                self._captures.pop(threading.get_ident(), None)
            else:
                self._captures[threading.get_ident()] = capture
            self._update()

    def issue(self, method, comm, args, kwargs, async_op: bool):
        """A call that cannot take the fast path: inside a group, async, behind queued work, or
        made by the progress thread itself."""
        capture = self.capture()
        if capture is not None:  # a group is open on this thread: it records the call
            if async_op:
                raise ValueError(f"{method.__name__}(async_op=True) inside comm.group(): the group's calls "
                                 f"all complete when the block exits; issue them without async_op")
            return method(comm, *args, **kwargs)
        if not async_op and threading.get_ident() == self._ident:
            return method(comm, *args, **kwargs)  # the thread runs a call (a torch call): this is its part
        work, capture = Work(self.rank, method.__name__, self), _Capture()
        with self._issue:
            self.set_capture(capture)
            try:
                value = method(comm, *args, **kwargs)
            finally:
                self.set_capture(None)
            work.seq = capture.seq
            self._enqueue(work, capture)
        if async_op:
            return work
        work.wait()
        return value

    def execute(self, sched, call) -> None:
        """The one place a call's bytes start moving: now, later, or with its group."""
        if self._captures:
            capture = self._captures.get(threading.get_ident())
            if capture is not None:
                capture.execute(self._run_now, sched, call)
                return
        self._run_now(sched, call)

    def later(self, fn) -> None:
        """Run ``fn`` where the call's data movement runs, just before it (e.g. a debug check)."""
        capture = self.capture()
        if capture is None:
            fn()
        else:
            capture.later(fn)

    def submit(self, name: str, fn) -> Work:
        """Queue ``fn()`` behind every call issued so far; its Work completes when it has run."""
        work = Work(self.rank, name, self)
        with self._issue:
            self._enqueue(work, fn)
        return work

    def run(self, name: str, fn) -> None:
        """Run ``fn()`` as a blocking call: inline if nothing is queued, else in turn."""
        if threading.get_ident() == self._ident:
            return fn()
        if self.idle and self.token.acquire(blocking=False):
            try:
                if self.idle:
                    return fn()
            finally:
                self.token.release()
        self.submit(name, fn).wait()

    def _enqueue(self, work: Work, fn) -> None:
        with self._cv:
            if self._closing is not None:
                raise CommunicatorClosed(f"rank {self.rank}: {work} was issued while the communicator "
                                         f"was {self._closing}")
            self._queue.append((work, fn))
            self._update()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"ringcomm-progress-rank{self.rank}")
                self._thread.start()
            self._cv.notify_all()

    # ---- the thread ---------------------------------------------------------------------------

    def on_thread(self) -> bool:
        """Whether the caller is the progress thread (running a call or a Work's callback)."""
        return threading.get_ident() == self._ident

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        while True:
            with self._cv:
                while not self._queue and self._closing is None:
                    self._cv.wait()
                if not self._queue:
                    return
            with self.token:  # waits out a blocking call that runs inline on its caller's thread
                with self._cv:
                    item = self._queue.popleft() if self._queue else None  # abort() may have emptied it
                    self._update()
                if item is not None:
                    self._run_item(*item)
            with self._cv:
                self._cv.notify_all()  # close() may be waiting for the queue to drain

    def _run_item(self, work: Work, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the error belongs to the caller, via wait()
            error = e
        else:
            error = None
        work._finish(error)  # callbacks run here, holding the token: their calls run inline

    # ---- ending -----------------------------------------------------------------------------

    def fail_queued(self, why: str) -> None:
        """Finish every call still queued with CommunicatorClosed: none of them will run."""
        with self._cv:
            items = list(self._queue)
            self._queue.clear()
            self._update()
        for work, _ in items:
            work._finish(CommunicatorClosed(f"rank {self.rank}: {work} was still queued when {why}; it never ran"))

    def close(self, timeout: float) -> None:
        """Let queued calls finish for up to ``timeout`` seconds; past that, abort the one in
        flight and fail the rest. Then stop the thread. Never waits for ever."""
        with self._cv:
            self._closing = "closing"
            self._update()
            self._cv.notify_all()
            thread = self._thread
        if thread is threading.current_thread():
            self.fail_queued("close() was called from inside one of the communicator's calls")
            return
        if not self._drained(timeout):
            self._on_overdue()
            self.fail_queued(f"close() gave the queue {timeout:g} s to drain")
            if not self._drained(CLOSE_GRACE):
                sys.stderr.write(f"ringcomm: rank {self.rank}: a call was still running {CLOSE_GRACE:g} s "
                                 f"after close() aborted it\n")
        if thread is not None:
            thread.join(CLOSE_GRACE)

    def _drained(self, timeout: float) -> bool:
        """Nothing queued and nobody running a call, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if not self._queue and self.token.acquire(blocking=False):
                    self.token.release()
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))  # an inline caller does not notify: look again soon


# The wrapper @asyncable writes for a method, with the method's own parameters (as dataclasses
# writes __init__): a generic ``*args, **kwargs`` wrapper costs ~0.15 us more per call, a few per
# cent of a small collective. Its own names start with "_", which no parameter of the API does.
_WRAPPER = """def {name}(self, {decl}):
    _p = self._progress
    # The fast path: a blocking call on an idle communicator runs here, on the caller's thread.
    # Holding the token, nothing can be dequeued; idle says nothing is queued or recording.
    if async_op is False and _p.token.acquire(False):
        if _p.idle:
            try:
                return _method(self, {passing})
            finally:
                _p.token.release()  # the progress thread, if it waits for the token, goes on
        _p.token.release()
    return _slow(self, ({positional}), dict({keywords}), async_op)
"""


def asyncable(method):
    """Give a public Communicator method ``async_op=False``: blocking, it runs inline when the
    communicator is idle, else in turn; with ``async_op=True`` it returns a Work (see above)."""
    name = method.__name__

    def slow(self, args, kwargs, async_op):
        if not isinstance(async_op, (bool, np.bool_)):
            raise TypeError(f"{name}: async_op must be True or False, got {async_op!r}")
        return self._progress.issue(method, self, args, kwargs, bool(async_op))

    P = inspect.Parameter
    params = list(inspect.signature(method).parameters.values())[1:]  # after self
    if any(p.kind not in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) or p.name.startswith("_") for p in params):
        raise TypeError(f"@asyncable: {name} may have only plain and keyword-only parameters, none "
                        f"starting with '_'")
    star = next((i for i, p in enumerate(params) if p.kind is P.KEYWORD_ONLY), len(params))
    decl = [p.name if p.default is P.empty else f"{p.name}=_d_{p.name}" for p in params]
    pos, kw = [p.name for p in params[:star]], [f"{p.name}={p.name}" for p in params[star:]]
    src = _WRAPPER.format(name=name, decl=", ".join(decl[:star] + ["*"] + decl[star:] + ["async_op=False"]),
                          passing=", ".join(pos + kw), positional="".join(a + ", " for a in pos),
                          keywords=", ".join(kw))
    namespace = {"_method": method, "_slow": slow}
    namespace.update((f"_d_{p.name}", p.default) for p in params if p.default is not P.empty)
    exec(src, namespace)  # noqa: S102 - our own source, from the signature above
    call = functools.update_wrapper(namespace[name], method)
    del call.__wrapped__  # so inspect.signature shows async_op
    return call
