"""A reducing read step on plain buffers, compiled: fetch each piece of the peers' operands by CMA
and reduce it, in one numba loop per element type (read_engine._reduce's work, without its
Python per piece).

read_engine._reduce takes a step's operands a piece at a time (FETCH_PIECE_BYTES): each remote
piece is copied by process_vm_readv into a piece-sized buffer (or into the output piece itself),
then the operands are folded in rank order while they sit in L2. In Python every piece cost a few
microseconds of its own (a Remote, an address, a ctypes call, a ufunc call): about a tenth of a
2-rank 16 MiB reduce_scatter's time. Here the whole step is one call:

    for each piece [a, b):
        fetch every remote operand's piece   (into the output piece for the first, ``into``,
                                              else into its scratch row)
        acc = op0 op op1, then acc = acc op opj for j >= 2   (kernels/native.py: host's bits)
        write acc into each peer of ``push``    (process_vm_writev: all_reduce's write_out_copy)
        out[a:b] = acc                       (only where acc is a scratch row: ``build``)

How the output is built (``build``): INTO_OUT reduces in the output itself; SCRATCH builds each
piece in a scratch row first (in place, where this rank's input is a later operand than the
first two, the first operation would overwrite it before it is read), then copies it there;
STREAM builds it in scratch too and writes it out with non-temporal stores. An output line that
is not in the cache is read from memory before an ordinary store writes it, so a big output out
of place (read_engine.STREAM_OUT_MIN_BYTES; STREAM_FINAL_OUT_MIN_BYTES where no step reads an output
back) goes STREAM: its lines are written, never read.

Waits, errors and AVG's division stay where they were: Python waits for the peers to enter the
call before (read_engine._view), and a failed read hands the step back at its piece (the return
value), where Python's loop reads it again and explains the error (a dead peer, a refusal); a
failed write into a peer stops the writes, not the reduction, and Python writes the rest.
Operands and buffers arrive by address, so a read-only input and a writable output are one array
type in the compiled code; ``like`` (an empty array of the storage dtype) picks the loop's type.

Two ways in: run(), with the step's arrays and values (Python's steps, read_engine._reduce), and
enter(), with a Block made once per step of a plan (the native engine's reducing calls, after
read_native's compiled wait for the peers: ReadEngine._fetch_step), whose entry reads the peers'
pids and addresses from their control words itself.
"""
from __future__ import annotations

import threading

import numpy as np

from ringcomm.kernels import native as native_kernels

from . import ctl_layout, native_sync, peer_maps
from .ctl_layout import DESC, PID

INTO_OUT, SCRATCH, STREAM = range(3)   # how the output is built (``build``)
_lock = threading.Lock()
_jitted = None         # the compiled step (loop()), made once
_entry = None          # the compiled step over an argument block (enter()), made with it


def loop(dtype):
    """The compiled step for element type ``dtype`` (a numba dispatcher, cached on disk), or None
    where the native kernels do not take that type (Python's loop does the step then)."""
    global _jitted
    if not native_kernels.supported(dtype):
        return None
    if _jitted is None:
        with _lock:
            if _jitted is None:
                import numba
                native_sync.intrinsics()
                native_sync.drop_stale_cache(__file__, "_step", deps=(native_kernels.__file__,))
                # the block's reads of the peers' words inline ctl_layout's numbers
                native_sync.drop_stale_cache(__file__, "_enter", deps=(native_kernels.__file__, ctl_layout.__file__,
                                                                       peer_maps.__file__))
                reduce_into, _ = native_kernels.compiled()
                globals()["_reduce_into"] = reduce_into
                globals()["_carray"] = numba.carray
                jit = numba.njit(nogil=True)
                for name in ("_transfer", "_stream_bytes", "_operand", "_mapped"):
                    globals()[name] = jit(globals()[name])
                globals()["_step_jit"] = step = numba.njit(nogil=True, cache=True)(_step)   # a version per storage dtype
                globals()["_entry"] = numba.njit(nogil=True, cache=True)(_enter)
                _jitted = step
    return _jitted


NO_PUSH = np.zeros(0, np.int64)


def run(out: np.ndarray, own, own_j: int, pids: np.ndarray, addrs: np.ndarray, scratch: np.ndarray,
        piece: int, op: str, into: int, build: int, iov: np.ndarray, push_pids: np.ndarray = NO_PUSH,
        push_addrs: np.ndarray = NO_PUSH) -> int:
    """Reduce one step's operands into ``out`` (see the module's loop). Operand j is this rank's
    ``own`` input span where j == own_j, else peer pids[j]'s bytes at addrs[j] (its element 0 of
    the span); ``scratch``: (operands + 1) rows of ``piece`` elements at least, of out's dtype;
    ``into``: the operand fetched straight into out's piece (-1: none; INTO_OUT only); ``build``:
    INTO_OUT, SCRATCH or STREAM (STREAM only where streaming is on: stream_copy); ``push_pids``,
    ``push_addrs``: processes and addresses (of their element 0 of the span) into which each piece
    is written by process_vm_writev as soon as it is built (all_reduce's write_out_copy). Returns
    -1 when done; the element offset of the piece whose read failed (nothing from it on is
    reduced); or -2 - the offset of the piece whose write failed (the step is reduced in full,
    nothing from that piece on is written: the caller writes it, and says why if it fails again)."""
    step, like, kind16, readv, memmove, writev = _lookup(out.dtype)
    own_addr = 0 if own is None else own.ctypes.data
    return step(like, out.ctypes.data, out.size, own_addr, own_j, pids, addrs, scratch.ctypes.data, scratch.shape[1],
                piece, native_kernels.OPCODES[op], kind16, into, build, readv, memmove, iov, push_pids, push_addrs,
                writev)


_by_dtype: dict = {}   # dtype -> _for(dtype): what run() passes besides the call's own arguments


def _for(dtype) -> tuple:
    """The compiled step for ``dtype``, an empty array of its storage type (which picks the step's
    version), its 16-bit float kind, and the addresses of process_vm_readv, memmove and
    process_vm_writev: ~4 us of a call's Python when looked up at each (2-rank all_reduce by CMA)."""
    return (loop(dtype), np.empty(0, native_kernels.storage(dtype)), native_kernels.kind16(dtype),
            native_sync.libc_address("process_vm_readv"), native_sync.libc_address("memmove"),
            native_sync.libc_address("process_vm_writev"))


# The step as the native engine's reducing calls run it (read_engine.ReadEngine._fetch_step): one
# int64 block, made once per step of a plan, dtype and op (Block), of which a call sets only
# B_OUT .. B_BUILD; the compiled entry reads each peer's pid and buffer address from its control
# words itself (as read_native's rows do) and runs _step. run()'s twenty arguments, three
# ``.ctypes.data`` and the Python that filled the peers' arrays cost ~6 us a call there.
# Layout: the head (B_OUT .. B_NRANKS), then the m operands' control-word addresses (0: this
# rank's input), the npush peers' ones, their ranks (for the peer_maps table at B_MAPS), then room
# for the pids and addresses the entry fills in (pid 0: a registered buffer, mapped at that address).
B_OUT, B_OWN, B_INTO, B_BUILD, B_SIZE, B_OWN_J, B_SCRATCH, B_ROW, B_PIECE, B_OP, B_KIND16, B_READV, B_MEMMOVE, \
    B_WRITEV, B_IOV, B_M, B_NPUSH, B_IN_OFF, B_OUT_OFF, B_MAPS, B_NRANKS = range(21)
HEAD = 21


class Block:
    """A step's argument block (``words``) with what it names by address kept alive: the scratch
    rows, the system call's iovec scratch and the peer_maps table; ``like`` picks the compiled
    step's version."""

    __slots__ = ("words", "like", "scratch", "iov", "maps")

    def __init__(self, dtype, op: str, size: int, own_j: int, ctl, push_ctl, in_off: int, out_off: int,
                 scratch: np.ndarray, iov: np.ndarray, ranks=(), maps: np.ndarray | None = None):
        """``size``: the step's elements; ``ctl``: each operand's control-word address (0 for
        ``own_j``, this rank's input), ``push_ctl`` each peer's the pieces are written into;
        ``in_off``, ``out_off``: the span's byte offset in the peers' inputs and outputs;
        ``scratch``: (operands + 1) rows as run() takes them; ``ranks``: the rank of each of
        ``ctl`` then ``push_ctl`` and ``maps`` the peer_maps table, for peers that pass registered
        buffers (none: every peer's buffers must be plain)."""
        step, like, kind16, readv, memmove, writev = _lookup(dtype)
        m, npush = len(ctl), len(push_ctl)
        maps = peer_maps.table(0) if maps is None else maps
        w = self.words = np.zeros(HEAD + 4 * (m + npush), np.int64)
        w[B_SIZE:HEAD] = (size, own_j, scratch.ctypes.data, scratch.shape[1], scratch.shape[1],
                          native_kernels.OPCODES[op], kind16, readv, memmove, writev, iov.ctypes.data, m, npush,
                          in_off, out_off, maps.ctypes.data, (maps.size - 1) // (2 * peer_maps.MAP_CAP))
        w[HEAD:HEAD + m + npush] = (*ctl, *push_ctl)
        w[HEAD + m + npush:HEAD + 2 * (m + npush)] = tuple(ranks) or (0,) * (m + npush)
        self.like, self.scratch, self.iov, self.maps = like, scratch, iov, maps


def enter(block: Block) -> int:
    """Run the step of ``block`` (B_OUT .. B_BUILD set for this call, as run()'s ``out``, ``own``,
    ``into``, ``build``): what run() returns."""
    return _entry(block.like, block.words)


def _lookup(dtype) -> tuple:
    got = _by_dtype.get(dtype)
    if got is None:
        got = _by_dtype[dtype] = _for(dtype)
    return got


_reduce_into = _carray = _step_jit = None   # set by loop()


_transfer = native_sync.transfer           # compiled by loop(), with the next two
_stream_bytes = native_sync.stream_bytes


_mapped = peer_maps.mapped   # compiled by loop()


def _operand(j, a, b, own_j, into, own, out, scratch, row, pids, addrs, like):
    """Operand j's piece [a, b): this rank's input, a peer's registered buffer where this process
    maps it (pid 0: read in place), the output piece it was fetched into, or its scratch row."""
    if j == own_j:
        return own[a:b]
    if pids[j] == 0:
        return _carray(native_sync.typed_ptr(addrs[j] + a * like.itemsize, like), b - a)
    if j == into:
        return out[a:b]
    return scratch[j * row:j * row + b - a]


def _step(like, out_addr, size, own_addr, own_j, pids, addrs, scratch_addr, row, piece, op, kind16, into,
          build, readv, memmove, iov, push_pids, push_addrs, writev):
    m = pids.size
    item = like.itemsize
    unwritten = -1   # the first piece not written into the peers (-1: none)
    out = _carray(native_sync.typed_ptr(out_addr, like), size)
    own = _carray(native_sync.typed_ptr(own_addr if own_addr else out_addr, like), size)
    scratch = _carray(native_sync.typed_ptr(scratch_addr, like), ((m + 1) * row,))
    for a in range(0, size, piece):
        b = min(a + piece, size)
        k = b - a
        for j in range(m):
            if j == own_j or pids[j] == 0:   # (a registered operand is read where it is mapped)
                continue
            dst = out_addr + a * item if j == into else scratch_addr + (j * row) * item
            if not _transfer(readv, pids[j], dst, addrs[j] + a * item, k * item, iov):
                if build == STREAM:
                    native_sync.stream_fence()   # the pieces streamed so far, before Python's stores
                return a
        acc = out[a:b] if build == INTO_OUT else scratch[m * row:m * row + k]
        _reduce_into(acc, _operand(0, a, b, own_j, into, own, out, scratch, row, pids, addrs, like),
                     _operand(1, a, b, own_j, into, own, out, scratch, row, pids, addrs, like), op, kind16)
        for j in range(2, m):
            _reduce_into(acc, acc, _operand(j, a, b, own_j, into, own, out, scratch, row, pids, addrs, like), op,
                         kind16)
        built = out_addr + a * item if build == INTO_OUT else scratch_addr + (m * row) * item
        if unwritten < 0:   # to the peers (if any) while the piece is in cache
            for t in range(push_pids.size):
                if push_pids[t] == 0:   # a registered output, mapped here
                    native_sync.call_c(memmove, push_addrs[t] + a * item, built, k * item, 0, 0, 0)
                elif not _transfer(writev, push_pids[t], built, push_addrs[t] + a * item, k * item, iov):
                    unwritten = a   # no more writes; the reduction goes on (in place it cannot be redone)
                    break
        if build != INTO_OUT:   # the piece built in scratch row m goes out
            dst, src = out_addr + a * item, built
            if build == STREAM:
                _stream_bytes(dst, src, k * item, memmove)
            else:
                native_sync.call_c(memmove, dst, src, k * item, 0, 0, 0)
    if build == STREAM:
        native_sync.stream_fence()   # as stream_copy's: the lines are in place before a later store (a sync)
    return -1 if unwritten < 0 else -2 - unwritten


def _enter(like, w):
    """_step over block ``w`` (Block): the peers' pids and addresses first, from their words (a
    registered buffer's through the peer_maps table: pid 0). 0 where a registered one is not
    mapped here (read_native's row checked it: not expected), before any piece: Python's steps
    then run the step and say why."""
    m, npush = w[B_M], w[B_NPUSH]
    ctl, ranks, fill = w[HEAD:HEAD + m + npush], w[HEAD + m + npush:HEAD + 2 * (m + npush)], w[HEAD + 2 * (m + npush):]
    pids, addrs = fill[:m], fill[m:2 * m]
    push_pids, push_addrs = fill[2 * m:2 * m + npush], fill[2 * m + npush:]
    maps = _carray(native_sync.typed_ptr(w[B_MAPS], w), 1 + 2 * w[B_NRANKS] * peer_maps.MAP_CAP)
    for j in range(m + npush):
        c = ctl[j]
        if c == 0:
            continue
        which = 0 if j < m else 1
        k = native_sync.load_acquire(c + 8 * (DESC + 2 * which))
        where = native_sync.load_acquire(c + 8 * (DESC + 2 * which + 1)) + (w[B_IN_OFF] if j < m else w[B_OUT_OFF])
        pid = 0
        if k == -1:
            pid = native_sync.load_acquire(c + 8 * PID)
        else:
            where = _mapped(maps, ranks[j], k, where, w[B_SIZE] * like.itemsize)
            if where == 0:
                return 0
        if j < m:
            pids[j], addrs[j] = pid, where
        else:
            push_pids[j - m], push_addrs[j - m] = pid, where
    iov = _carray(native_sync.typed_ptr(w[B_IOV], w), 4)
    return _step_jit(like, w[B_OUT], w[B_SIZE], w[B_OWN], w[B_OWN_J], pids, addrs, w[B_SCRATCH], w[B_ROW],
                     w[B_PIECE], w[B_OP], w[B_KIND16], w[B_INTO], w[B_BUILD], w[B_READV], w[B_MEMMOVE], iov,
                     push_pids, push_addrs, w[B_WRITEV])
