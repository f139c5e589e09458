"""fetch_reduce: a reducing step's compiled loop gives the host kernels' bits, whichever way it builds
the output, at any alignment and length. The "peers" here are this process: process_vm_readv of
one's own pid reads one's own memory, the same system call a peer's buffer takes."""
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


def test_a_read_that_fails_hands_back_its_piece_with_the_pieces_before_it_done():
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    mem = np.frombuffer(m, np.float32)
    mem[:] = 2
    libc = ctypes.CDLL(None, use_errno=True)
    second = ctypes.c_void_p(mem.ctypes.data + page)
    assert libc.mprotect(second, ctypes.c_size_t(page), 0) == 0   # PROT_NONE: unreadable from here on
    try:
        own = np.full(3 * PIECE, 1, np.float32)
        out = np.zeros(3 * PIECE, np.float32)
        pids = np.array([0, os.getpid()], np.int64)
        addrs = np.array([0, mem.ctypes.data + page - PIECE * 4], np.int64)   # one readable piece, then none
        build = fetch_reduce.STREAM if stream_copy.enabled() else fetch_reduce.SCRATCH
        failed = fetch_reduce.run(out, own, 0, pids, addrs, np.zeros((3, PIECE), np.float32), PIECE, "sum", -1,
                                  build, np.empty(4, np.int64))
    finally:
        libc.mprotect(second, ctypes.c_size_t(page), mmap.PROT_READ | mmap.PROT_WRITE)
    del mem
    m.close()
    assert failed == PIECE
    assert (out[:PIECE] == 3).all() and not out[PIECE:].any()
