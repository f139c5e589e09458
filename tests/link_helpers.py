"""Helpers the transports' conformance tests share: deadlines, payloads, one slice each way."""
from __future__ import annotations

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
