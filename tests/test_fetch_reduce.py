"""fetch_reduce: a reducing step's compiled loop gives the host kernels' bits, whichever way it builds
the output, at any alignment and length. The "peers" here are this process: process_vm_readv of
one's own pid reads one's own memory, the same system call a peer's buffer takes."""
import contextlib
import ctypes
import mmap
import os

import numpy as np
import pytest

from ringcomm import fetch_reduce, stream_copy
from ringcomm.kernels import host
from ringcomm.transport import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv in this libc (not Linux)")

PIECE = 1000   # elements: pieces, a short last one, and lines that straddle them


def _want(ops, op, dtype):
    fn = host.elementwise(op, dtype)
    acc = np.empty_like(ops[0])
    fn(ops[0], ops[1], out=acc)
    for x in ops[2:]:
        fn(acc, x, out=acc)
    return acc


# (how the output is built, where this rank's input is among the operands: -1 nowhere); INTO_OUT
# never has it third: that is read_engine's SCRATCH case (the first operation would overwrite the
# input before it is read)
WAYS = [(b, j) for b in ("INTO_OUT", "SCRATCH", "STREAM") for j in (-1, 0, 2) if (b, j) != ("INTO_OUT", 2)]


@pytest.mark.parametrize("build, own_j", WAYS)
@pytest.mark.parametrize("dtype, op", [("float32", "sum"), ("float16", "max"), ("int8", "prod"), ("float64", "min")])
@pytest.mark.parametrize("size, shift", [(1, 0), (17, 1), (2 * PIECE + 5, 3), (3 * PIECE, 0)])
def test_each_way_of_building_the_output_gives_the_host_kernels_bits(build, own_j, dtype, op, size, shift):
    if build == "STREAM" and not stream_copy.enabled():
        pytest.skip("streamed stores are x86-64 only, and RINGCOMM_STREAM_COPY=0 turns them off")
    rng = np.random.default_rng(size + shift + own_j + len(build))
    ops = [(rng.standard_normal(size) * 50).astype(dtype) for _ in range(3)]
    where = np.zeros(size + shift + 32, dtype)
    out = where[shift:shift + size]           # off a 64-byte line by `shift` elements
    pids = np.array([0 if j == own_j else os.getpid() for j in range(3)], np.int64)
    addrs = np.array([0 if j == own_j else ops[j].ctypes.data for j in range(3)], np.int64)
    scratch = np.zeros((4, PIECE), dtype)
    into = next(j for j in range(3) if j != own_j) if build == "INTO_OUT" else -1
    failed = fetch_reduce.run(out, ops[own_j] if own_j >= 0 else None, own_j, pids, addrs, scratch, PIECE, op, into,
                              getattr(fetch_reduce, build), np.empty(4, np.int64))
    assert failed == -1
    want = _want(ops, op, np.dtype(dtype))
    np.testing.assert_array_equal(out.view(f"u{out.itemsize}"), want.view(f"u{want.itemsize}"))
    assert not where[:shift].any() and not where[shift + size:].any()   # nothing outside


@contextlib.contextmanager
def _one_good_piece(fill: float, prot: int):
    """Two pages of float32 (``fill``), the second one protected to ``prot`` while inside: the
    address of the last piece (PIECE elements) before the protected page. The mapping goes when
    the last view of it does."""
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    mem = np.frombuffer(m, np.float32)
    mem[:] = fill
    libc = ctypes.CDLL(None, use_errno=True)
    second = ctypes.c_void_p(mem.ctypes.data + page)
    assert libc.mprotect(second, ctypes.c_size_t(page), prot) == 0
    try:
        yield mem, mem.ctypes.data + page - PIECE * 4
    finally:
        libc.mprotect(second, ctypes.c_size_t(page), mmap.PROT_READ | mmap.PROT_WRITE)


def test_a_read_that_fails_hands_back_its_piece_with_the_pieces_before_it_done():
    with _one_good_piece(2, 0) as (_, piece):   # one readable piece, then none (PROT_NONE)
        own = np.full(3 * PIECE, 1, np.float32)
        out = np.zeros(3 * PIECE, np.float32)
        pids = np.array([0, os.getpid()], np.int64)
        addrs = np.array([0, piece], np.int64)
        build = fetch_reduce.STREAM if stream_copy.enabled() else fetch_reduce.SCRATCH
        failed = fetch_reduce.run(out, own, 0, pids, addrs, np.zeros((3, PIECE), np.float32), PIECE, "sum", -1,
                                  build, np.empty(4, np.int64))
    assert failed == PIECE
    assert (out[:PIECE] == 3).all() and not out[PIECE:].any()


@pytest.mark.parametrize("build, own_j", [("INTO_OUT", 0), ("INTO_OUT", -1), ("SCRATCH", 2), ("STREAM", 1)])
def test_each_built_piece_is_written_into_every_push_target(build, own_j):
    # all_reduce's write_out_copy, taken with the reducing step: each target gets the output's bits
    if build == "STREAM" and not stream_copy.enabled():
        pytest.skip("streamed stores are x86-64 only, and RINGCOMM_STREAM_COPY=0 turns them off")
    size, shift = 2 * PIECE + 7, 1
    rng = np.random.default_rng(7 + own_j)
    ops = [rng.integers(-100, 100, size).astype(np.int32) for _ in range(3)]
    out = np.zeros(size, np.int32)
    targets = [np.zeros(size + shift + 16, np.int32) for _ in range(2)]
    pids = np.array([0 if j == own_j else os.getpid() for j in range(3)], np.int64)
    addrs = np.array([0 if j == own_j else ops[j].ctypes.data for j in range(3)], np.int64)
    into = next(j for j in range(3) if j != own_j) if build == "INTO_OUT" else -1
    push_addrs = np.array([t.ctypes.data + shift * 4 for t in targets], np.int64)
    own = ops[own_j] if own_j >= 0 else None
    failed = fetch_reduce.run(out, own, own_j, pids, addrs, np.zeros((4, PIECE), np.int32),
                              PIECE, "sum", into, getattr(fetch_reduce, build), np.empty(4, np.int64),
                              np.full(2, os.getpid(), np.int64), push_addrs)
    assert failed == -1
    assert np.array_equal(out, ops[0] + ops[1] + ops[2])
    for t in targets:
        assert np.array_equal(t[shift:shift + size], out)
        assert not t[:shift].any() and not t[shift + size:].any()   # nothing outside the span


def test_a_write_that_fails_stops_the_writes_not_the_reduction():
    # in place a piece cannot be reduced twice: the step goes on reducing, and says where its
    # writes stopped (-2 - that piece's offset), with the pieces before it written
    with _one_good_piece(0, mmap.PROT_READ) as (mem, piece):   # one writable piece, then none
        own = np.full(3 * PIECE, 1, np.float32)
        peer = np.full(3 * PIECE, 2, np.float32)
        pids = np.array([0, os.getpid()], np.int64)
        addrs = np.array([0, peer.ctypes.data], np.int64)
        failed = fetch_reduce.run(own, own, 0, pids, addrs, np.zeros((3, PIECE), np.float32), PIECE, "sum", -1,
                                  fetch_reduce.INTO_OUT, np.empty(4, np.int64), np.array([os.getpid()], np.int64),
                                  np.array([piece], np.int64))
        written = mem[mmap.PAGESIZE // 4 - PIECE:mmap.PAGESIZE // 4].copy()
    assert failed == -2 - PIECE
    assert (own == 3).all()   # every piece reduced once
    assert (written == 3).all()
