"""Helpers the transports' conformance tests share: deadlines, payloads, one slice each way."""
from __future__ import annotations

import threading
import time

import numpy as np


def soon(seconds: float = 5.0) -> float:
    """A deadline ``seconds`` from now."""
    return time.monotonic() + seconds


def pattern(src: int, i: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 2654435761 + src * 977 + i * 31) >> 7).astype(np.uint8)


def send(conn, data: np.ndarray, deadline: float) -> None:
    slot = conn.acquire(deadline)
    slot[:data.size] = data
    conn.post(data.size)


def recv(conn, deadline: float) -> np.ndarray:
    data = conn.wait(deadline).copy()
    conn.release()
    return data


def run_threads(*fns, timeout=15.0):
    """Run each fn in a thread of its own (two ranks of one process); re-raise the first error,
    fail if any is still running after ``timeout`` seconds (a deadlock)."""
    errors, threads = [], []
    for fn in fns:
        def body(fn=fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        threads.append(threading.Thread(target=body))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "deadlock: a rank never finished"
    if errors:
        raise errors[0]
