"""Plain numpy buffers in the one-copy "read" steps, through cross-memory attach (transport/cma.py).

A registered buffer (comm.alloc) is readable because the peers map it. A plain numpy buffer is
readable too where the kernel lets one process read another's memory (process_vm_readv: same
user, no Yama or container rule against it): the owner publishes the buffer's address, the
reader copies straight out of it into its own output. That is what MPICH (through UCX) does for
large messages between processes of one host: one copy, where the FIFO path makes two (into a
slot, out of it).

So the read schedules of schedule/onecopy.py run on plain buffers unchanged; only where a
read step's bytes come from differs (read_engine.py: a mapped view, or a Remote here; a reducing
step reduces a fetched copy, piece by piece in cache, since the kernel only copies). Automatic
choice takes this path for broadcast, all_gather, all_reduce and reduce_scatter, from
CMA_MIN_BYTES (measured per collective: below it the FIFO path wins; RINGCOMM_CMA_MIN sets one
value for all), when every peer passed the probe; RINGCOMM_CMA=0 turns it off.

The probe (setup) is collective and runs once per communicator, at the first call that could
take this path: each rank publishes its pid and the address of a known word, reads every peer's
word with process_vm_readv, publishes what failed, and the path is used only if nothing failed
anywhere -- every rank must pick the same algorithm. RINGCOMM_DEBUG=info prints each peer's path.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from ringcomm.transport import cma

from .buffers import address
from .env import env_number, env_switch
from .errors import RingcommError

COLLECTIVES = ("broadcast", "all_gather", "all_reduce", "reduce_scatter")
# Measured crossovers: below them the FIFO path is as fast or faster (64 KiB broadcast 6 us
# against 15 us by CMA, whose per-call Python and two syscalls cost ~15 us); above them one copy
# instead of two wins. They were 2 MiB (broadcast) and 4 MiB (all_gather's output) on an AMD EPYC
# VM (docs/06 "Where a 2-rank broadcast's time went"), where the FIFOs' slot copies streamed past
# the caches held their own: broadcast 1 MiB 54-63 us against 80 by CMA. On the Intel Xeon VM of a
# later session CMA won from 512 KiB for both (2 ranks, 200-call rows, alternating runs, CMA
# against FIFOs: broadcast 512 KiB 22 us against 32-33, 1 MiB 32-34 against 70-76; all_gather
# 512 KiB 30-31 against 34-35, 1 MiB 68-69 against 88-89, 2 MiB 155-202 against 200-215; at
# 256 KiB no gain) and on 4 ranks from 1 MiB (broadcast 1 MiB 271-281 against 412-414, all_gather
# 2 MiB 522-544 against 691-771): there a FIFO slot's lines bounce between the two cores' caches
# (a broadcast cut into 16 KiB slices ran at 7 GB/s, 256 KiB ones at 16), while a reader's CMA
# copy pulls them once. Then the copy-only calls went compiled (read_native.py: ~7 us of Python
# less a call), and on the same Intel VM CMA won from 128 KiB with a core per rank (2 ranks,
# 100-call rows alternating with MPICH, CMA against FIFOs: broadcast 64 KiB 6.9 us against
# 6.1-7.5, 128 KiB 8.0 against 9.3-9.9, 256 KiB 10.1 against 16-17; all_gather 64 KiB of output 9.0
# against 8.4, 128 KiB 11.3 against 13.3, 256 KiB 15.4 against 23.8), while 4 ranks on 2 cores
# kept 1 MiB (40-call rows: broadcast 256 KiB 139 us against 73, 1 MiB 309 against 533). Bytes as
# wanted() counts them: broadcast's buffer, all_gather's output, the reductions' input. Then a known
# call (known_calls.py) brought its arrays' addresses (address() had cost ~1 us a rank, ~3 us a
# call in lockstep: a 16 KiB broadcast by CMA 7.8 us, then 4.7), and on an Intel VM with a 480 MiB L3
# CMA won from 64 KiB of broadcast and 32 KiB of all_gather's output (2 ranks, 200-call rows
# alternating with MPICH, two runs each way, CMA against FIFOs: broadcast 32 KiB 5.1-5.2 us
# against 5.0-6.6, 64 KiB 5.6-6.1 against 6.8-7.1, 128 KiB 6.9-7.2 against 11.3-12.0; all_gather
# 16 KiB 5.0-6.3 against 5.0-5.2, 32 KiB 5.3-5.6 against 6.2-6.3, 64 KiB 6.5-6.6 against 8.2-8.6).
CMA_MIN_BYTES = {"broadcast": 64 << 10, "all_gather": 32 << 10, "all_reduce": 128 << 10, "reduce_scatter": 1 << 20}
# With more ranks than cores: this much per rank a core holds (rounded up). For the copies it was
# 512 KiB while a stacked rank's every wait went back to Python (a CMA call waits for all its
# peers); once the compiled waits yield the core themselves (engine_native._wait, read_native.
# _wait_at_least), CMA won from 256 KiB on 4 ranks on 2 cores (Intel VM, 10 ms rows alternating
# with MPICH, two runs, CMA against FIFOs: broadcast 64 KiB 25.7 / 23.4 us against 18.9 / 22.8,
# 256 KiB 51.1 / 46.5 against 59.6 / 64.2; all_gather's output 256 KiB 48.0 / 45.0 against 64.4 /
# 70.9; ten-run sets: broadcast 256 KiB median 48-51 against 56-58).
# all_reduce joined them at 2 MiB a rank per core (4 MiB of input on 4 ranks on 2 cores), once its
# reducing step ran compiled from a block (fetch_reduce.Block): Intel VM, 30-call rows alternating
# with MPICH, three runs, RINGCOMM_CMA_MIN=1 against the FIFOs, two rounds each way, out of place
# (in place), us: 4 MiB 1622-1687 (1285-1309) against 1853-1938 (1744-1748), 16 MiB 8395-8614
# (4962-5700) against 9254-9334 (7486-7800); below, the FIFOs won (1 MiB 668-674 against 524-536,
# 256 KiB 154-218 against 146-161). The day before, compiled up to the step only: 4 MiB 2122-2224
# against 2291-2333, 16 MiB level (in place 6989-7210 against 8587-8852). 3 ranks on 2 cores, the
# same day: 2 MiB 712-905 against 994-1020, 4 MiB 1204-1294 against 1934-2023, 16 MiB 6035-6081
# against 9562-9907 (1 MiB level). reduce_scatter joined at 8 MiB a rank per core (16 MiB there):
# 4 ranks, the FIFOs won to 4 MiB, CMA a little at 16 (4 MiB 1256-1311 against 997-1010, 16 MiB
# 4029-4149 against 4205-4260); 3 ranks, CMA won from 6 MiB (6 MiB 1114-1347 against 1556-1560,
# 24 MiB 5039-5369 against 7406-7413; 1.5 MiB 474-502 against 439-455).
CMA_MIN_STACKED_BYTES = {"broadcast": 128 << 10, "all_gather": 128 << 10, "all_reduce": 2 << 20,
                         "reduce_scatter": 8 << 20}
# The reductions, 2 ranks, 30-call rows alternating with MPICH, CMA against the FIFOs, out of place
# (in place): all_reduce 1 MiB 170 us against 158, 2 MiB 355 against 352, 4 MiB 524 against 673,
# 16 MiB 2089 (1574) against 2791 (2646), 64 MiB 13846 (11025) against 16190 (15897);
# reduce_scatter 1 MiB 83 against 84, 2 MiB 187 against 224, 4 MiB 342 against 423, 16 MiB 1360
# (1041) against 1697 (1564), 64 MiB 8661 (6770) against 10125 (10328). Before the first fetched
# operand went straight into the output (read_engine._reduce), out of place lost again
# from 32 MiB (reduce_scatter 32 MiB 4591 against 3823).
# reduce_scatter then moved to 8 MiB: on the Intel VM of 2026-12-03 (session 25; memcpy 6.2-7.0
# GB/s, slower than the sessions above) the FIFOs won at 2 and 4 MiB in every round, 30-call rows
# alternating with MPICH, three runs, RINGCOMM_CMA_MIN=64M against the default, out of place (us):
# 2 MiB 221-261 against 274-373, 4 MiB 422-494 against 483-573, 8 MiB level (900-929 against
# 735-918), 16 MiB 1818-2125 against 1404-1652. Why is not traced; not huge pages, which a
# reduce_scatter's input lacks below 4 MiB: one process fetching by CMA the same 1 MiB in 256 KiB
# pieces, out of a 2 MiB array (4 KiB pages) took 71 us, out of a 16 MiB one (14 MiB of huge pages)
# 101. all_reduce kept 2 MiB: level at 2 MiB, CMA ahead from 4 (670-674 against 764).
# Then reducing calls ran compiled up to their reducing step (read_engine._fetch_step: a 2-rank
# 4 KiB all_reduce by CMA 67 us, then 18), and all_reduce moved to 512 KiB: same day, two rounds,
# RINGCOMM_CMA_MIN=1 against the FIFOs (us): 256 KiB 42-44 against 39-42, 512 KiB 77 against 93-99,
# 1 MiB 185-193 against 220-221, 2 MiB level (CMA both ways). reduce_scatter by CMA gained too
# (2 MiB 277-293 us against 320-354, 8 MiB 821-837 against 896-906) but not past the FIFOs below
# 8 MiB (2 MiB 221-261, 4 MiB 422-494 in the rounds above).
# Then the reducing step ran from an argument block (fetch_reduce.Block: a 4 KiB all_reduce by CMA
# 11.9 us, then 6.3), and on the next day's Intel VM (session 26: memcpy 7.5-12 GB/s, 480 MiB L3)
# both moved down: 2 ranks, 30-call rows alternating with MPICH, three runs, RINGCOMM_CMA_MIN=1
# (or 1M) against the defaults then, two rounds each way, out of place (in place), us:
# all_reduce 64 KiB 10.3-10.6 against 9.4-9.6 (level), 128 KiB 14.4-14.6 against 17.4-18.1,
# 256 KiB 22.5-26.0 against 29.6-31.0, 512 KiB and 1 MiB level (CMA both ways); reduce_scatter
# 512 KiB level (31-33 against 30-33), 1 MiB 61-70 against 79-87, 2 MiB 166-182 against 201-212,
# 4 MiB 344-392 (252-271) against 398-418 (327-345), 8 and 16 MiB level. That day's FIFOs were not
# ahead at 2-4 MiB, as they were the day before (above): that VM's figures stand against these.


# The host's core count, read once (os.cpu_count() reads /sys: 6 us, which a call above the
# known-call cache's size would pay every time); not this process's affinity: every rank must
# reach the same answer.
CORES = max(1, os.cpu_count() or 1)


def enabled() -> bool:
    """RINGCOMM_CMA: 1 (default) probes and uses CMA where it beats the FIFOs, 0 never does."""
    return env_switch("RINGCOMM_CMA") and cma.available()


def wanted(collective: str, nbytes: int, ranks: int = 2) -> bool:
    """Whether automatic choice would take the CMA read path for this call (if the probe passes),
    on a communicator of ``ranks`` ranks, all on this host. RINGCOMM_CMA_MIN, where set, is the
    crossover as given. By default it is CMA_MIN_BYTES with a core per rank, else
    CMA_MIN_STACKED_BYTES scaled by the ranks per core (rounded up): with more ranks than cores
    a CMA call's syncs wait for ranks the scheduler has parked, as the FIFO pipeline does not
    (4 ranks on 2 cores, AMD VM, broadcast: 2 MiB 537-680 us by CMA against 440-510 us by the
    FIFOs, 4 MiB 600-830 against 1050-1190). The reductions take it later there: each rank reads
    all of its peers' chunks while they wait for the core (Intel VM, 4 ranks on 2 cores, 20-call
    rows, CMA against FIFOs, before their reducing step ran compiled: all_reduce 1 MiB 707 us
    against 670, 16 MiB 9145 against 9640; reduce_scatter 1 MiB 490 against 320, 64 MiB 25748
    against 20451); since then, from CMA_MIN_STACKED_BYTES' figures."""
    if collective not in COLLECTIVES:
        return False
    given = env_number("RINGCOMM_CMA_MIN", None, int)
    if given is not None:
        return nbytes >= given
    per_core = -(-ranks // CORES)
    if per_core > 1:
        return nbytes >= CMA_MIN_STACKED_BYTES[collective] * per_core
    return nbytes >= CMA_MIN_BYTES[collective]


class Remote:
    """A peer's plain buffer (or a piece of it), read with process_vm_readv: the stand-in for a
    mapped view in read_engine.py. Indexing by a slice of elements gives the piece."""

    __slots__ = ("pid", "addr", "size", "dtype", "peer")

    def __init__(self, pid: int, addr: int, size: int, dtype, peer: int):
        self.pid, self.addr, self.size, self.dtype, self.peer = pid, addr, size, np.dtype(dtype), peer

    def __getitem__(self, s: slice) -> Remote:
        a, b, _ = s.indices(self.size)
        return Remote(self.pid, self.addr + a * self.dtype.itemsize, max(0, b - a), self.dtype, self.peer)

    def copy_to(self, out: np.ndarray) -> None:
        """out[...] = this piece, in one copy (out: C-contiguous, same size and dtype)."""
        if out.size != self.size or not out.flags.c_contiguous:
            raise ValueError(f"CMA read of {self.size} elements into {out.size} (contiguous: {out.flags.c_contiguous})")
        cma.read(self.pid, self.addr, address(out), out.nbytes)

    def copy_from(self, src: np.ndarray) -> None:
        """This piece = src, in one copy (process_vm_writev; src: C-contiguous, same size and dtype)."""
        if src.size != self.size or not src.flags.c_contiguous:
            raise ValueError(f"CMA write of {src.size} elements into {self.size} "
                             f"(contiguous: {src.flags.c_contiguous})")
        cma.write(self.pid, self.addr, address(src), src.nbytes)


def setup(reg, words, magic: int) -> bool:
    """The collective probe: whether every rank can read every peer by CMA (all must agree).
    ``words``: this rank's control words; word 0 holds ``magic``, which the peers read by CMA."""
    ctx, me = reg.ctx, reg.rank
    others = [p for p in range(reg.n) if p != me]
    on = enabled()
    mine = {"ctl": os.path.basename(reg.ctl.path), "pid": os.getpid(), "addr": int(words.ctypes.data)}
    ctx.store.set(f"{ctx.prefix}/cma/{me}", json.dumps(mine).encode())
    deadline = time.monotonic() + reg.timeout
    failed = {}
    expect = np.array([magic], np.int64).tobytes()
    for p in others:
        theirs = json.loads(reg.published(f"{ctx.prefix}/cma/{p}", p, deadline, "probe CMA"))
        reg.map_ctl(p, theirs["ctl"])
        why = cma.probe(theirs["pid"], theirs["addr"], expect) if on else "RINGCOMM_CMA=0"
        if why:
            failed[p] = why
    ctx.store.set(f"{ctx.prefix}/cma-ok/{me}", json.dumps(sorted(failed)).encode())
    # A failure between any two ranks turns the path off for everyone: all must pick one algorithm.
    refused = {p: json.loads(reg.published(f"{ctx.prefix}/cma-ok/{p}", p, deadline, "probe CMA")) for p in others}
    ok = not failed and not any(refused.values())
    if "info" in os.environ.get("RINGCOMM_DEBUG", "").lower().split(","):
        for p in others:
            why = failed.get(p) or (f"rank {p} cannot read rank(s) {refused[p]}" if refused[p] else None)
            why = why or (None if ok else "another pair of ranks cannot use CMA")
            path = "single-copy CMA reads" if why is None else f"the FIFO (two-copy) path: {why}"
            print(f"ringcomm rank {me}: plain buffers with rank {p}: {path}", file=sys.stderr, flush=True)
    return ok


def check_size(remote: Remote, want: int, call, me: int, which: str) -> None:
    if remote.size != want:
        raise RingcommError(f"rank {me} (this process): rank {remote.peer}'s {which}put of {call.name} #{call.seq} "
                            f"has {remote.size} elements where this rank's has {want}: the ranks passed different sizes")
