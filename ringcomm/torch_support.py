"""The pieces under ringcomm.torch: tensor views, ops, the store adapter and Work.

Only ringcomm.torch imports this module (it needs torch, an optional extra).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque
from datetime import timedelta

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

import ringcomm
import ringcomm.work
from .errors import CollectiveTimeout, StoreError, StoreTimeout
from .store import Store

# torch dtypes ringcomm's kernels reduce, and their numpy twins. Data movement
# (broadcast, all_gather, send/recv) takes any dtype: it moves bytes.
REDUCIBLE = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32,
             torch.float64: np.float64, torch.int8: np.int8, torch.uint8: np.uint8, torch.int32: np.int32,
             torch.uint32: np.uint32, torch.int64: np.int64, torch.uint64: np.uint64}

_RED = dist.ReduceOp.RedOpType
OPS = {_RED.SUM: ringcomm.SUM, _RED.PRODUCT: ringcomm.PROD, _RED.MIN: ringcomm.MIN,
       _RED.MAX: ringcomm.MAX, _RED.AVG: ringcomm.AVG}
# TorchStore polls a missing key after 1 ms, doubling up to 20 ms: a peer's key is seen within
# 20 ms of its set, for at most 50 round trips a second to the store per waiting rank.
_CHECK_FIRST_S, _CHECK_MAX_S = 0.001, 0.02


def ring_op(op, collective: str):
    """torch's ReduceOp (or its RedOpType) as ringcomm's op; NotImplementedError for the others."""
    kind = getattr(op, "op", op)
    if kind not in OPS:
        name = getattr(kind, "name", str(kind))
        raise NotImplementedError(f"{collective}: the ringcomm backend does not support ReduceOp.{name}; "
                                  f"it has SUM, PRODUCT, MIN, MAX and AVG")
    return OPS[kind]


# bool reduces as its 0/1 bytes under the logical op its arithmetic stands for, as gloo and NCCL
# (through uint8) give it: SUM is "any", PRODUCT "all". MAX and MIN, which never wrap the way a
# uint8 sum of 256 Trues would.
BOOL_OPS = {ringcomm.SUM: ringcomm.MAX, ringcomm.PROD: ringcomm.MIN, ringcomm.MIN: ringcomm.MIN,
            ringcomm.MAX: ringcomm.MAX}


def tensor_op(red, t, collective: str):
    """The ringcomm op that reduces tensor ``t`` as torch's ``red`` means: ring_op's answer, or for
    a bool tensor its logical twin (BOOL_OPS)."""
    op = ring_op(red, collective)
    if t.dtype != torch.bool:
        return op
    if op not in BOOL_OPS:
        raise NotImplementedError(f"{collective}: {str(op).upper()} of a bool tensor has no meaning here; "
                                  f"SUM (any), PRODUCT (all), MIN and MAX do")
    return BOOL_OPS[op]


def check_tensor(t, what: str) -> None:
    """A dense CPU tensor, or the error that says why the backend cannot take it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        # ringcomm's GPU path exists, but this backend does not yet carry the caller's CUDA
        # device and current stream over to the progress thread, which that path's stream rule needs.
        raise NotImplementedError(f"{what} is on {t.device}: the ringcomm torch backend takes CPU tensors only "
                                  f"for now; move the tensor to the CPU, or give CUDA tensors a group of "
                                  f"their own (dist.new_group(backend='nccl'))")
    if t.layout != torch.strided:
        raise NotImplementedError(f"{what} has layout {t.layout}; the ringcomm backend takes dense tensors")


def host_view(t, what: str, *, reduce: bool = False, elementwise: bool = False) -> np.ndarray:
    """A flat numpy view of a CPU tensor's own memory (no copy).

    ``reduce``: typed, for the collectives that do arithmetic (bfloat16 through ml_dtypes,
    which shares torch's bit layout); otherwise the raw bytes, so any dtype can move.
    ``elementwise``: for the calls whose result at an element depends on that element alone
    (all_reduce, reduce, broadcast, send/recv), a dense tensor in any order of its dimensions
    (channels_last, a transpose) is taken too, in the order of its memory, as gloo takes it: every
    rank is expected to pass the same layout (NCCL, which flattens memory alike, expects the same).
    """
    check_tensor(t, what)
    if t.is_contiguous():
        flat = t.detach().reshape(-1)  # a view: the tensor is contiguous
    elif elementwise and _dense(t):
        flat = t.detach().as_strided((t.numel(),), (1,))  # its memory, from its first element
    else:
        raise ValueError(f"{what} is not contiguous (strides {tuple(t.stride())}); pass tensor.contiguous()")
    if not reduce or t.dtype == torch.bool:   # bool: its 0/1 bytes, reduced as tensor_op says
        return flat.view(torch.uint8).numpy()
    if t.dtype not in REDUCIBLE:
        names = ", ".join(str(d).removeprefix("torch.") for d in (*REDUCIBLE, torch.bool))
        raise NotImplementedError(f"{what} has dtype {t.dtype}, which the ringcomm backend does not "
                                  f"reduce; supported: {names}")
    if t.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return flat.numpy()


def read_view(t, what: str, *, reduce: bool = False):
    """(numpy view, fill) for an input the call only reads. A contiguous tensor is its own memory
    and fill() does nothing; another is read, as gloo reads it, from a contiguous copy that fill()
    makes when the call runs (not at the call: a call queued before it may still write t). An
    output must be its tensor's own memory (host_view)."""
    check_tensor(t, what)
    if t.is_contiguous():
        return host_view(t, what, reduce=reduce), _nothing
    staging = torch.empty(t.shape, dtype=t.dtype)
    return host_view(staging, what, reduce=reduce), lambda: staging.copy_(t.detach())


def _nothing():
    pass


def _dense(t) -> bool:
    """Whether t's elements fill one run of memory with no gaps or overlaps, in some order of its
    dimensions (positive strides that are, sorted, the running products of their sizes)."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def same_kind(a, b, what: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: dtypes differ ({a.dtype} and {b.dtype}); the ringcomm backend does not convert")


_QUEUE_EMPTY = getattr(dist, "QueueEmptyError", None)     # torch >= 2.6: what queue_pop raises when empty


class TorchStore(Store):
    """ringcomm's Store interface over torch's c10d Store (the one init_process_group hands a backend)."""

    def __init__(self, store, timeout: float = 300.0):
        self._store, self.timeout = store, float(timeout)

    def _set(self, key, value, timeout):   # c10d's store bounds its own calls
        self._call("set", [key], self._store.set, key, value)

    def _get(self, key, timeout):
        self._wait([key], timeout)
        return bytes(self._call("get", [key], self._store.get, key))

    def _wait(self, keys, timeout):
        # Polled with check(), never c10d's own wait: ringcomm waits in short pieces (to hear an
        # abort or the watchdog between them), and on a short timeout c10d's wait misbehaves --
        # TCPStore logs two "waitForInput ... timed out" warnings per piece, FileStore raises a
        # plain RuntimeError, and a zero timeout means "forever". check() answers at once.
        deadline = time.monotonic() + max(timeout, 0.0)
        pause = _CHECK_FIRST_S
        while not self._call("wait", keys, self._store.check, keys):
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"torch store wait timed out after {timeout:g} s waiting for {keys!r}")
            time.sleep(min(pause, left))  # a poll, not a synchronisation: check() decides
            pause = min(2 * pause, _CHECK_MAX_S)

    def _add(self, key, amount, timeout):
        return int(self._call("add", [key], self._store.add, key, amount))

    def has_queues(self) -> bool:
        """Whether the c10d store keeps queues (queue_push / queue_pop: TCPStore and HashStore do,
        FileStore does not)."""
        if _QUEUE_EMPTY is None:
            return False
        try:
            self._store.queue_len("ringcomm/queue-probe")
        except (NotImplementedError, AttributeError):
            return False
        return True

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._call("queue_push", [key], self._store.queue_push, key, value)

    def queue_pop(self, key: str) -> bytes | None:
        """The queue's oldest value, taken; None (at once) if it is empty."""
        def pop():
            try:
                return bytes(self._store.queue_pop(key, block=False))
            except _QUEUE_EMPTY:        # a DistStoreError: caught before _call names it a failure
                return None
        return self._call("queue_pop", [key], pop)

    def _delete(self, key, timeout):
        return bool(self._call("delete", [key], self._store.delete_key, key))

    def _call(self, op, keys, fn, *args):
        try:
            return fn(*args)
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise StoreTimeout(f"torch store {op} timed out waiting for {keys!r}: {e}") from None
            raise StoreError(f"torch store {op} of {keys!r} failed: {e}") from e
        except RuntimeError as e:  # FileStore raises plain RuntimeErrors, timeouts included
            if "timeout" in str(e).lower():
                raise StoreTimeout(f"torch store {op} timed out waiting for {keys!r}: {e}") from None
            raise StoreError(f"torch store {op} of {keys!r} failed: {e}") from e


class Completer:
    """Completes the torch futures of finished calls off the progress thread, in call order.

    A torch future runs its callbacks on the thread that completes it, and a callback may make a
    call and wait for it (DDP's PowerSGD hook does). Completed on the progress thread, that call
    could never run: it waits in the queue behind the callback that waits for it. So a worker here
    takes the completions, one at a time and in call order, so that callbacks run in that order
    too; a callback that makes a call or takes a Work's future (what it may then wait for) first
    hands the queue on to another worker (hand_off), so the completion it waits for is not queued
    behind it, however deeply such callbacks nest. A worker idle for IDLE_S leaves, unless it is
    the last."""

    IDLE_S = 5.0

    def __init__(self):
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has none of our workers

    def _reset(self) -> None:
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._active = None          # the worker taking completions now
        self._workers = self._idle = 0
        self._local = threading.local()

    def submit(self, fn) -> None:
        with self._cv:
            self._queue.append(fn)
            self._start()

    def hand_off(self) -> None:
        """On a worker, inside a callback: the completions after this one go to another worker."""
        if getattr(self._local, "worker", False):
            with self._cv:
                if self._active is threading.current_thread():
                    self._active = None
                    if self._queue:
                        self._start()

    def _start(self) -> None:
        """(lock held) Make sure a worker will take the queue."""
        if self._active is not None:
            return
        if self._idle:
            self._cv.notify()
        else:
            self._workers += 1
            threading.Thread(target=self._work, name="ringcomm-futures", daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        self._local.worker = True
        with self._cv:
            while True:
                while self._active is not None or not self._queue:
                    self._idle += 1
                    woken = self._cv.wait(self.IDLE_S)
                    self._idle -= 1
                    if not woken and (self._active is not None or not self._queue) and self._workers > 1:
                        self._workers -= 1
                        return
                self._active = me
                while self._queue and self._active is me:
                    fn = self._queue.popleft()
                    self._cv.release()
                    try:
                        fn()
                    except Exception:  # noqa: BLE001 - said, and the worker goes on: had it died here,
                        # still the active one, every later completion would wait for it for ever
                        print("ringcomm: completing a torch Work's future failed (the next ones go on):\n"
                              + traceback.format_exc(), file=sys.stderr, flush=True)
                    finally:
                        self._cv.acquire()
                if self._active is me:
                    self._active = None
                elif self._queue:
                    self._start()


COMPLETER = Completer()   # one for the process: its workers are shared by every group


class Work(dist.Work):
    """One queued call of the process group, run by its communicator's progress thread
    (ringcomm/progress.py) in call order. get_future() completes once it ran, holding the call's
    output tensors, on a worker of COMPLETER, where its callbacks run (DDP copies the reduced bucket
    back into the grads). wait() returns (or raises the call's error) after that, as gloo's does:
    the future is done and its callbacks have run."""

    def __init__(self, inner: ringcomm.work.Work, outputs: list):
        super().__init__()
        self._inner, self._outputs = inner, outputs
        self._future = self._new_future()
        self._completed = threading.Event()  # the future is set and its callbacks have run
        COMPLETER.hand_off()                   # made in a callback, which may wait for it
        inner.add_done_callback(self._finish)  # on the progress thread, or now if it already ran

    def _new_future(self):
        return torch.futures.Future()

    def _finish(self, inner) -> None:
        COMPLETER.submit(self._complete)

    def _complete(self, error: BaseException | None = None) -> None:
        """Set the future (the call's error, or ``error`` where completing it failed) and mark it
        completed, whatever happens on the way: a waiter must never hang on it."""
        try:
            error = error or self._inner.exception()
            if error is None:
                self._future.set_result(self._outputs)
            else:
                self._future.set_exception(error)
        finally:
            self._completed.set()

    def wait(self, timeout=timedelta(0)) -> bool:
        """Block until the call ends. A positive timeout bounds the wait (CollectiveTimeout, as
        torch's backends raise); without one the call's own waits (each with ringcomm's timeout)
        bound it, and a stopped progress thread is reported."""
        COMPLETER.hand_off()  # waited for in a callback: its completion must not queue behind it
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        if limit > 0:
            end = time.monotonic() + limit
            if not (self._inner.wait(limit) and self._completed.wait(max(0.0, end - time.monotonic()))):
                raise CollectiveTimeout(f"rank {self._inner.rank} (this process) timed out after {limit:g} s "
                                        f"in Work.wait() for {self._inner} of the ringcomm torch backend")
        done = self._inner.wait()
        self._completed.wait()  # local: a completion queued on COMPLETER, whose callbacks are the user's
        return done

    def is_completed(self) -> bool:
        return self._completed.is_set()

    def is_success(self) -> bool:
        return self._completed.is_set() and self._inner.exception() is None

    def exception(self):
        return self._inner.exception()

    def result(self) -> list:
        self.wait()
        return self._outputs

    def get_future(self):
        COMPLETER.hand_off()  # asked for in a callback, which may wait for it
        return self._future

    def synchronize(self) -> None:
        pass  # CPU tensors: nothing to order against a stream
