"""Hostile or confused peers: random and mutated frames against the store and the TCP transport.

Whatever arrives, the server must keep serving well-behaved clients: refuse, log, close
that one connection, never crash or stall the job.
"""
from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringcomm.store import HashStore, TCPStore
from ringcomm.store_wire import HEADER, MAGIC, VERSION, Msg, pack_fields
from ringcomm.transport.base import LinkContext
from ringcomm.transport.tcp import TcpTransport

TOKEN = "fuzz-token"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _blast(port: int, data: bytes) -> None:
    """Send ``data`` on a fresh connection, read whatever comes back briefly, hang up."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        try:
            s.sendall(data)
            s.settimeout(0.05)
            s.recv(4096)
        except OSError:
            pass  # the server may close on us mid-send: that is the point


def _valid_hello() -> bytes:
    payload = pack_fields(TOKEN.encode())
    return HEADER.pack(MAGIC, VERSION, Msg.HELLO, len(payload)) + payload


def _mutate(frame: bytes, pos: int, byte: int) -> bytes:
    pos %= len(frame)
    return frame[:pos] + bytes([byte]) + frame[pos + 1:]


@pytest.fixture(scope="module")
def store_server():
    server = TCPStore("127.0.0.1", 0, is_server=True, token=TOKEN, timeout=10)
    yield server
    server.close()


def _store_still_works(server, key):
    with TCPStore("127.0.0.1", server.port, is_server=False, token=TOKEN, timeout=10) as client:
        client.set(key, b"v")
        assert client.get(key, timeout=5) == b"v"
        assert client.add(key + "/n", 1) == 1


@pytest.mark.timeout(120)
@FUZZ
@given(junk=st.binary(min_size=0, max_size=300))
def test_store_survives_random_bytes(store_server, junk):
    _blast(store_server.port, junk)
    _store_still_works(store_server, f"random/{junk.hex()[:40]}/{time.monotonic_ns()}")


@pytest.mark.timeout(120)
@FUZZ
@given(pos=st.integers(0, 1000), byte=st.integers(0, 255), extra=st.binary(max_size=64),
       length=st.sampled_from([None, 0, 1, 2**31, 2**32 - 1, (64 << 20) + 1]))
def test_store_survives_mutated_frames(store_server, pos, byte, extra, length):
    """Valid hello, then a SET whose bytes are flipped, truncated, padded or whose length lies."""
    payload = pack_fields(b"key", b"value")
    frame = HEADER.pack(MAGIC, VERSION, Msg.SET, len(payload) if length is None else length) + payload
    _blast(store_server.port, _valid_hello() + _mutate(frame, pos, byte) + extra)
    _blast(store_server.port, _mutate(_valid_hello(), pos, byte) + extra)
    _store_still_works(store_server, f"mutated/{pos}/{byte}/{time.monotonic_ns()}")


@pytest.mark.timeout(60)
def test_store_refuses_another_jobs_token_and_silent_connections(store_server):
    silent = socket.create_connection(("127.0.0.1", store_server.port))  # says nothing at all
    half = socket.create_connection(("127.0.0.1", store_server.port))
    half.sendall(_valid_hello()[:5])  # a truncated frame, then silence
    try:
        with pytest.raises(Exception, match="wrong RINGCOMM_TOKEN"):
            TCPStore("127.0.0.1", store_server.port, is_server=False, token="other-job", timeout=5)
        _store_still_works(store_server, "after-silence")
    finally:
        silent.close()
        half.close()


@pytest.fixture(scope="module")
def tcp_pair():
    store = HashStore(timeout=10)
    ctxs = [LinkContext(rank=r, world_size=2, store=store, prefix="fuzz", token=TOKEN, nslots=4, slot_bytes=4096)
            for r in (0, 1)]
    transports = [TcpTransport(c) for c in ctxs]
    host, port = store.get("fuzz/tcp/1", timeout=5).decode().rsplit(":", 1)
    yield transports, int(port)
    for t in transports:
        t.close()


@pytest.mark.timeout(120)
@FUZZ
@given(junk=st.binary(min_size=0, max_size=200))
def test_tcp_listener_survives_random_hellos(tcp_pair, junk):
    _, port = tcp_pair
    _blast(port, junk)


@pytest.mark.timeout(60)
def test_tcp_pair_still_moves_data_after_the_fuzzing(tcp_pair):
    """Runs after the fuzz test in this module: the listener that took all that garbage still
    connects a real peer and moves real slices."""
    (t0, t1), port = tcp_pair
    deadline = time.monotonic() + 10
    send = t0.connect_send(1, deadline)
    recv = t1.connect_recv(0, deadline)
    for i in range(20):
        slot = send.acquire(deadline)
        slot[:8] = np.frombuffer(struct.pack("<q", i), np.uint8)
        send.post(8)
        got = recv.wait(deadline)
        assert struct.unpack("<q", got.tobytes())[0] == i
        recv.release()
