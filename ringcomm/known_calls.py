"""Calls seen before: the fast path of a collective repeated on the same arrays.

A training loop all-reduces the same few arrays (a loss, a gradient norm, a flag, a bucket of
gradients) every step. For an 8-byte all_reduce the data moves in about a microsecond; the checks
and choices before it (the arrays' type, dtype, layout and writability, their overlap, the
algorithm for the size, the schedule) cost a few more in Python. Their outcome depends only on
what this module keys and re-checks: the same array objects (held weakly, never kept alive), with
the same shape, dtype, layout and writability, the same collective, op, algorithm and root
arguments (the root with its type: 0.0 == 0, but only an int passed the check). So a repeated
call checks those few attributes and goes straight to the executor, whose slice plan is cached
too: no allocation beyond the call's record, no Python per slice. From its second repeat on it
goes further, down its engine's lane (comm._run_known) straight into the compiled code.

Anything else takes the checked path, which also explains every error. Making a registry
(comm.alloc, or CMA on plain buffers) clears the cache, since it can change the algorithm of a
call remembered before it; after that, calls on registered buffers and CMA reads are remembered
like any other (their algorithm follows from the same keys).
"""
from __future__ import annotations

import weakref

import numpy as np

from .buffers import address

MAX_ENTRIES = 16           # the arrays a loop repeats; the oldest entry goes first


class KnownCall:
    """One remembered call: what it was given (weakly) and what the checked path decided."""

    __slots__ = ("key", "buf", "out", "shape", "out_shape", "dtype", "out_dtype", "op", "algo", "sched", "addrs",
                 "lane", "call", "__weakref__")

    def __init__(self, key, buf, out, op, algo, sched):
        self.key = key     # (id(buf), id(out), the call's arguments): KnownCalls.entries'
        self.buf = weakref.ref(buf)
        # Where the arrays' data are: an array object's data pointer never moves while its shape
        # stays (resize() reallocates only to a new size; .data cannot be assigned), and get() checks
        # the very objects and shapes. The read engine takes them from here (address() costs ~1 us).
        self.addrs = (address(buf), address(buf if out is None else out))
        self.out = None if out is None else weakref.ref(out)
        self.shape, self.dtype = buf.shape, buf.dtype
        self.out_shape, self.out_dtype = (None, None) if out is None else (out.shape, out.dtype)
        self.op, self.algo, self.sched = op, algo, sched
        self.lane = None   # an engine's compiled way in (comm._run_known): None until looked for, False if none
        self.call = None   # with a lane: the executor.Call its calls reuse, renumbered each time


class KnownCalls:
    def __init__(self):
        self.entries: dict = {}   # (id(buf), id(out), args) -> KnownCall
        # id(buf) -> the call last found or remembered on buf: a loop repeats its calls, and this
        # look-up hashes one int where the key above hashes two tuples (get() 0.37 -> 0.32 us a
        # call; examples/call_layers.py)
        self.latest: dict = {}

    def get(self, buf, out, args: tuple) -> KnownCall | None:
        """The remembered call for these arrays and ``args`` (collective, op, algo, root...), if its
        checks still hold."""
        known = self.latest.get(id(buf))
        try:
            if known is None or known.key[1] != id(out) or known.key[2] != args:
                known = self.entries.get((id(buf), id(out), args))
                if known is None:
                    return None
                self.latest[id(buf)] = known
        except Exception:   # an unhashable op, algo or root, or one whose == fails: the checked path says what is wrong
            return None
        if known.buf() is not buf or buf.shape != known.shape or buf.dtype is not known.dtype:
            return None
        # Still the arrays the checked path accepted, unchanged: strides can be reassigned in place,
        # hence the layout flags (carray: C-contiguous, aligned and writeable, in one look).
        if out is None:
            return known if buf.flags.carray else None
        if (known.out() is out and out.shape == known.out_shape and out.dtype is known.out_dtype
                and out.flags.carray and buf.flags.c_contiguous):
            return known
        return None

    def remember(self, buf, out, args: tuple, picked_op, picked_algo, sched) -> None:
        """After the checked path accepted a call: remember it if it is on plain numpy arrays. Of any
        size: the checks cost ~3 us, a 2-rank 1 MiB broadcast ~50 us (with them 54-56, without
        51-53; up to 256 KiB only, as this cache once was, calls above it paid them every time)."""
        if type(buf) is not np.ndarray or not (out is None or type(out) is np.ndarray):
            return
        try:
            key = (id(buf), id(out), args)
            hash(key)
        except TypeError:
            return
        if len(self.entries) >= MAX_ENTRIES and key not in self.entries:
            oldest = self.entries.pop(next(iter(self.entries)))
            if self.latest.get(oldest.key[0]) is oldest:
                del self.latest[oldest.key[0]]
        self.entries[key] = self.latest[key[0]] = KnownCall(key, buf, out, picked_op, picked_algo, sched)

    def forget(self) -> None:
        self.entries.clear()
        self.latest.clear()
