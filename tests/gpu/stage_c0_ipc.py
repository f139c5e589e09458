"""Device check, stage C0: raw CUDA IPC and stream memory operations between two processes, no ringcomm.

    python tests/gpu/stage_c0_ipc.py

What ringcomm's cuda_ipc relies on, tried alone so a failure points at the machine, not at ringcomm:
1. memory handles, both directions: A fills a buffer after a ~200 ms GPU-side delay and records an IPC
   event; B opens both, makes its stream wait for the event, copies, checks every byte; then the same
   from B to A. Without the event wait B would read the buffer before the delayed fill;
2. a stream waiting on a word of host memory another process writes (cudaHostRegister'ed /dev/shm page,
   cuStreamWaitValue64 / cuStreamWriteValue64 through ringcomm.transport.cuda_cupy): the stream must
   stay blocked until the other process writes the word, and its write must reach the other process.
Prints one line per check; exit 1 if any failed. A container runtime that refuses CUDA IPC shows here.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import time

N = 1 << 22                                     # int32 elements: 16 MiB
DELAY_NS = 200_000_000


def _delay_kernel():
    import numpy as np
    from numba import cuda
    if not hasattr(np, "row_stack"):   # numba-cuda <= 0.30.4 on NumPy 2.5 (see ringcomm's kernels/device.py)
        np.row_stack = np.vstack

    @cuda.jit
    def spin(ns, out):
        if cuda.grid(1) == 0:
            t = 0
            while t < ns:
                cuda.nanosleep(1_000_000)
                t += 1_000_000
            out[0] = 1
    return spin


def _fill_after_delay(cp, stream, buf, value):
    from numba import cuda
    flag = cp.zeros(1, cp.int32)
    with stream:
        _delay_kernel()[1, 1, cuda.external_stream(stream.ptr)](DELAY_NS, cuda.as_cuda_array(flag))
        buf[...] = value


def _side(role: str, pipe, seg_name: str) -> None:
    import cupy as cp
    rt = cp.cuda.runtime
    stream = cp.cuda.Stream(non_blocking=True)
    mine = cp.zeros(N, cp.int32)
    ev = rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess)
    out = []
    for turn in ("A", "B"):
        if turn == role:                            # the writer: delayed fill, event, handles to the peer
            _fill_after_delay(cp, stream, mine, 7 if role == "A" else 9)
            rt.eventRecord(ev, stream.ptr)
            pipe.send((bytes(rt.ipcGetMemHandle(mine.data.ptr)), bytes(rt.ipcGetEventHandle(ev))))
            pipe.recv()                             # the reader is done with it
        else:
            mem_h, ev_h = pipe.recv()
            ptr = rt.ipcOpenMemHandle(mem_h)
            theirs = rt.ipcOpenEventHandle(ev_h)
            rt.streamWaitEvent(stream.ptr, theirs, 0)
            got = cp.empty(N, cp.int32)
            rt.memcpyAsync(got.data.ptr, ptr, 4 * N, rt.memcpyDeviceToDevice, stream.ptr)
            stream.synchronize()
            want = 7 if turn == "A" else 9
            bad = int((got != want).sum())
            out.append(f"C0 ipc {turn}->{role}: {'ok' if bad == 0 else f'FAILED: {bad} of {N} wrong'}")
            rt.ipcCloseMemHandle(ptr)
            rt.eventDestroy(theirs)
            pipe.send("done")
    out += _flags(role, pipe, seg_name)
    pipe.send(out)


def _flags(role, pipe, seg_name):
    """A's stream waits for a word B's host writes; then A's stream writes a word B's host reads."""
    import numpy as np
    from ringcomm.transport.cuda_cupy import CupyRuntime
    from ringcomm.transport.cuda_rt import Flag
    fd = os.open("/dev/shm/" + seg_name, os.O_RDWR)
    page = np.frombuffer(mmap.mmap(fd, 4096), np.int64)
    os.close(fd)
    rt = CupyRuntime()
    dev = rt.host_register(page)
    flags = Flag(page[0:1], dev), Flag(page[8:9], dev + 64)
    if role == "A":
        s = rt.stream_create()
        rt.wait_value(s, flags[0], 1)
        rt.write_value(s, flags[1], 5)
        time.sleep(0.2)                             # long enough for an unblocked stream to finish
        blocked = not rt.stream_idle(s)
        pipe.send("write it")
        deadline = time.monotonic() + 10
        while not rt.stream_idle(s) and time.monotonic() < deadline:
            time.sleep(1e-3)
        return [f"C0 flags: stream waits on host word: {'ok' if blocked else 'FAILED: did not wait'}; "
                f"released by the other process: {'ok' if rt.stream_idle(s) else 'FAILED: still waiting'}"]
    pipe.recv()
    page[0] = 1
    deadline = time.monotonic() + 10
    while page[8] != 5 and time.monotonic() < deadline:
        time.sleep(1e-3)
    return [f"C0 flags: stream's write seen by the other process: {'ok' if page[8] == 5 else 'FAILED'}"]


def main() -> int:
    seg = f"rc-c0-{os.getpid()}"
    fd = os.open("/dev/shm/" + seg, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=_side, args=(r, p, seg)) for r, p in (("A", a), ("B", b))]
    try:
        for p in procs:
            p.start()
        lines, failed = [], []
        deadline = time.monotonic() + 30
        alive = list(procs)
        while alive and not failed and time.monotonic() < deadline:
            ended = mp.connection.wait([p.sentinel for p in alive], deadline - time.monotonic())
            alive = [p for p in alive if p.sentinel not in ended]
            for p in procs:     # a side that failed leaves the other waiting for it: stop there
                p.join(0)
            failed = [f"side {r} exited with {p.exitcode}" for r, p in zip("AB", procs) if p.exitcode]
        if alive and not failed:
            failed = [f"side {r} still running after 30 s" for r, p in zip("AB", procs) if p in alive]
        for pipe in (a, b):                         # each side's last message is its report
            while pipe.poll():
                msg = pipe.recv()
                if isinstance(msg, list):
                    lines += msg
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        os.unlink("/dev/shm/" + seg)
    for line in lines + failed:
        print(line)
    ok = len(lines) == 5 and not failed and not any("FAILED" in line for line in lines)
    print("C0", "passed" if ok else f"FAILED ({len(lines)} of 5 checks reported)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
