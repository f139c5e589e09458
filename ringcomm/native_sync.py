"""The few machine operations the native engine needs that numba has no words for.

    load_acquire(addr)         the int64 at ``addr``, read with acquire ordering
    store_release(addr, v)     store int64 ``v`` at ``addr`` with release ordering
    fence()                    a full (seq_cst) fence: no later load passes an earlier store
    cpu_pause()                x86 PAUSE: a spin-wait hint (yields the pipeline, not the core)
    cycles()                   the CPU's cycle counter (RDTSC): cheap time for compiled loops
    typed_ptr(addr, like)      ``addr`` as a pointer to ``like``'s element type, for numba.carray
    load_word(addr)            the int64 at ``addr``, which need not be aligned (a plain load)
    store_stream(addr, v)      store int64 ``v`` at 8-aligned ``addr`` non-temporally (MOVNTI):
                               past the caches, so the line need not be fetched first; weakly
                               ordered, so stream_fence() must come before the store that publishes it
    stream_line(dst, src)      copy the 64 bytes at ``src`` (any alignment) to 64-aligned ``dst`` as one
                               non-temporal vector store (AVX-512 VMOVNTPS here): a whole line, which
                               the 8-byte MOVNTI writes in eight pieces (one core, 64 MiB: 18 against
                               15 GB/s; glibc's memcpy 11-13 GB/s); weakly ordered like store_stream
    stream_fence()             every earlier streaming store lands before any later store (SFENCE)
    call_c(fn, a, b, c, d, e, f)   the C function at address ``fn`` called with six int64 (or
                               pointer) arguments, its int64 result: libc's system calls from
                               compiled code whose disk cache must not hold a process's addresses

Why atomics for plain counters: a compiled spin loop over an ordinary array load may be hoisted
by LLVM out of the loop (nothing in the loop writes it), and then it never sees the peer's store.
An atomic acquire load is re-read every time, and no later load (the slot's data) may be moved
above it; a release store keeps every earlier store (the slot's data, its size) before it. On x86
both compile to plain MOVs (TSO already orders them at run time), on aarch64 to LDAR / STLR: the
native engine is correct on weakly ordered CPUs too. (The Python engine's numpy stores are not, so
transport/shm.py still refuses them.)

Numba compiles these into the caller; nothing here runs at import, and numba is imported only by
``intrinsics()``.
"""
from __future__ import annotations

import threading
import time

_lock = threading.RLock()  # cycles_per_second() holds it while it calls intrinsics()
_done = None
load_acquire = store_release = fence = cpu_pause = cycles = typed_ptr = None   # set by intrinsics()
load_word = store_stream = stream_line = stream_fence = call_c = None
NAMES = ("load_acquire", "store_release", "fence", "cpu_pause", "cycles", "typed_ptr", "load_word", "store_stream",
         "stream_line", "stream_fence", "call_c")


def intrinsics():
    """(load_acquire, ..., store_stream) as in NAMES, made once per process and
    also set as this module's globals, where jitted code finds them."""
    global _done
    if _done is None:
        with _lock:
            if _done is None:
                made = _make()
                globals().update(zip(NAMES, made))
                _done = made
    return _done


def _make():
    import platform

    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    i64 = ir.IntType(64)
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

    @intrinsic
    def load_acquire(typingctx, addr):
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], i64.as_pointer())
            return builder.load_atomic(ptr, "acquire", 8)
        return types.int64(types.int64), codegen

    @intrinsic
    def store_release(typingctx, addr, value):
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], i64.as_pointer())
            builder.store_atomic(args[1], ptr, "release", 8)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen

    @intrinsic
    def fence(typingctx):
        def codegen(context, builder, sig, args):
            builder.fence("seq_cst")   # MFENCE on x86, DMB ISH on aarch64
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def cpu_pause(typingctx):
        def codegen(context, builder, sig, args):
            if x86:  # elsewhere an empty spin: correct, only less polite to the sibling hyperthread
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.x86.sse2.pause")
                builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def cycles(typingctx):
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])
        return types.int64(), codegen

    @intrinsic
    def typed_ptr(typingctx, addr, like):
        ptr_type = types.CPointer(like.dtype)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))
        return ptr_type(types.int64, like), codegen

    @intrinsic
    def load_word(typingctx, addr):
        def codegen(context, builder, sig, args):
            return builder.load(builder.inttoptr(args[0], i64.as_pointer()), align=1)
        return types.int64(types.int64), codegen

    @intrinsic
    def store_stream(typingctx, addr, value):
        def codegen(context, builder, sig, args):
            store = builder.store(args[1], builder.inttoptr(args[0], i64.as_pointer()), align=8)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen

    line = ir.VectorType(i64, 8)

    @intrinsic
    def stream_line(typingctx, dst, src):
        def codegen(context, builder, sig, args):
            value = builder.load(builder.inttoptr(args[1], line.as_pointer()), align=1)
            store = builder.store(value, builder.inttoptr(args[0], line.as_pointer()), align=64)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen

    @intrinsic
    def stream_fence(typingctx):
        # Not fence(): LLVM lowers a seq_cst fence on x86 to LOCK OR, and SFENCE is the instruction
        # both vendors define for ordering MOVNT stores (Linux's memcpy_flushcache ends with one too).
        def codegen(context, builder, sig, args):
            if x86:
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.x86.sse.sfence")
                builder.call(fn, [])
            else:
                builder.fence("seq_cst")   # DMB ISH: orders STNP like any store
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def call_c(typingctx, fn, a, b, c, d, e, f):
        def codegen(context, builder, sig, args):
            proto = ir.FunctionType(i64, [i64] * 6)
            return builder.call(builder.inttoptr(args[0], proto.as_pointer()), list(args[1:]))
        return types.int64(*[types.int64] * 7), codegen

    return (load_acquire, store_release, fence, cpu_pause, cycles, typed_ptr, load_word, store_stream,
            stream_line, stream_fence, call_c)


_hz = None


_libc_addresses: dict = {}


def libc_address(name: str) -> int:
    """The address of libc's function ``name``, for call_c from compiled code (looked up once)."""
    addr = _libc_addresses.get(name)
    if addr is None:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        addr = _libc_addresses[name] = ctypes.cast(getattr(libc, name), ctypes.c_void_p).value
    return addr


def yield_until(addr, least, fn, yields, since, budget):
    """A compiled wait's last stage where ranks outnumber cores (no spinning): call ``fn``
    (sched_yield, by address) up to ``yields`` times, each handing the core to a rank that may be
    the one awaited, until the int64 at ``addr`` reaches ``least``: True; False after the yields,
    or once ``budget`` cycles have passed since ``since``. Plain Python: the modules that call it
    compile it with their own helpers (engine_native.kernel, read_native.kernel)."""
    for _ in range(yields):
        call_c(fn, 0, 0, 0, 0, 0, 0)
        if load_acquire(addr) >= least:
            return True
        if cycles() - since > budget:
            return False
    return False


def transfer(fn, pid, local, remote, nbytes, iov):
    """process_vm_readv or _writev (``fn``, by address) of ``nbytes`` between this process's
    ``local`` and process ``pid``'s ``remote``, going on after a partial transfer; False if a call
    moves nothing (the caller's Python does the step again and says why). ``iov``: four int64s of
    scratch, the two iovecs. Plain Python, compiled by its callers (read_native.kernel,
    fetch_reduce.loop)."""
    done = 0
    at = iov.ctypes.data
    while done < nbytes:
        iov[0], iov[1], iov[2], iov[3] = local + done, nbytes - done, remote + done, nbytes - done
        got = call_c(fn, pid, at, 1, at + 16, 1, 0)
        if got <= 0:
            return False
        done += got
    return True


def stream_bytes(dst, src, nbytes, memmove):
    """Copy ``nbytes`` from ``src`` to ``dst`` (addresses, not overlapping): the whole 64-byte lines
    of dst with non-temporal stores (stream_line), the bytes before the first and after the last
    by ``memmove`` (libc's, by address). The caller fences (stream_fence) before any store that
    tells a peer the bytes are there. Plain Python, compiled by its callers (read_native.kernel,
    fetch_reduce.loop, stream_copy.kernel)."""
    head = min(nbytes, (-dst) & 63)
    call_c(memmove, dst, src, head, 0, 0, 0)
    lines = (nbytes - head) // 64
    for i in range(lines):
        stream_line(dst + head + 64 * i, src + head + 64 * i)
    done = head + 64 * lines
    call_c(memmove, dst + done, src + done, nbytes - done, 0, 0, 0)


def cycles_per_second() -> float:
    """The cycle counter's rate, measured once per process over ~2 ms (a VM's TSC runs at a
    fixed rate; what matters is turning "return to Python every ~1 ms" into counter ticks)."""
    global _hz
    with _lock:
        if _hz is None:
            _hz = _measure_hz()
    return _hz


def _measure_hz() -> float:
    import numba
    intrinsics()
    read = numba.njit(cache=True)(_read_cycles)
    read()
    t0, c0 = time.perf_counter(), read()
    while time.perf_counter() - t0 < 2e-3:
        pass
    return (read() - c0) / (time.perf_counter() - t0)


def _read_cycles():
    return cycles()


def drop_stale_cache(module_file: str, function: str, deps=()) -> None:
    """numba's disk cache of ``function`` (cache=True) is keyed on its own file, ``module_file``,
    alone; compiled code that inlines this module's intrinsics, or other files' code (``deps``),
    would outlive an edit there. So drop the cache when one of them is newer."""
    import glob
    import pathlib

    here = pathlib.Path(module_file)
    newest = max(p.stat().st_mtime for p in [pathlib.Path(__file__), *map(pathlib.Path, deps)])
    for index in glob.glob(str(here.parent / "__pycache__" / f"{here.stem}.{function}-*.nbi")):
        try:
            stale = pathlib.Path(index).stat().st_mtime < newest
        except OSError:   # another process (a peer rank starting too) dropped it just now
            continue
        if stale:
            for path in glob.glob(index[:-len(".nbi")] + "*"):
                try:
                    pathlib.Path(path).unlink()
                except OSError:
                    pass
