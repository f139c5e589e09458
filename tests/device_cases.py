"""The collective matrix on device buffers: tests/cases.py's cases, with every buffer moved to the device.

Used by the simulator test (numba's CUDA simulator, on the CPU) and by the GPU tests (numba, cupy and torch
buffers on a real GPU). ``kind`` names how buffers are made: "numba" (numba.cuda.to_device: also what the
simulator has), "cupy" or "torch".
"""
from __future__ import annotations

import numpy as np

from cases import BLOCK_COLLECTIVES, compare, make_input, reference, run_block_case


def numba_to_device(x: np.ndarray):
    """numba.cuda.to_device, bfloat16 included: a real GPU copies through the buffer protocol, which has no
    format for ml_dtypes' bfloat16 ("cannot include dtype 'E' in a buffer"), so copy its bits and view them."""
    from numba import cuda
    if x.dtype.name == "bfloat16":
        return cuda.to_device(x.view(np.uint16)).view(x.dtype)
    return cuda.to_device(x)


def numba_to_host(d) -> np.ndarray:
    """The way back of numba_to_device."""
    if d.dtype.name == "bfloat16":
        return d.view(np.uint16).copy_to_host().view(d.dtype)
    return d.copy_to_host()


def to_device(x: np.ndarray, kind: str):
    if kind == "cupy" and x.dtype.name == "bfloat16":
        kind = "numba"                          # cupy has no bfloat16
    if kind == "numba":
        return numba_to_device(x)
    if kind == "cupy":
        import cupy
        return cupy.asarray(x)
    if kind == "torch":
        import torch                            # through a signed view: numpy has no bfloat16 for torch
        signed = torch.from_numpy(x.view(f"i{x.dtype.itemsize}").copy()).cuda()
        return signed.view(getattr(torch, x.dtype.name))
    raise ValueError(kind)


def to_host(d, kind: str, dtype) -> np.ndarray:
    """Copy back, after the caller's stream has finished the collective."""
    if getattr(d, "__cuda_ndarray__", False):  # numba (and the simulator): copies on the legacy default stream
        return numba_to_host(d)
    if kind == "cupy":
        import cupy
        cupy.cuda.get_current_stream().synchronize()
        return cupy.asnumpy(d)
    import torch
    torch.cuda.current_stream().synchronize()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[np.dtype(dtype).itemsize]
    return d.view(bits).cpu().numpy().view(dtype)


def empty(kind: str, n: int, dtype):
    return to_device(np.zeros(n, dtype), kind)


def run_device_case(comm, case: dict, kind: str) -> str | None:
    """cases.run_case with device buffers; None when right, else what went wrong."""
    n, r = comm.world_size, comm.rank
    coll, count, root = case["collective"], case["count"], case["root"]
    if coll in BLOCK_COLLECTIVES:
        return run_block_case(comm, {**case, "buffers": kind}, lambda a: to_device(a, kind),
                              lambda d, dtype: to_host(d, kind, dtype))
    insize = count * n if coll == "reduce_scatter" else count
    inputs = [make_input(case, k, insize) for k in range(n)]
    dt = inputs[r].dtype
    x = to_device(inputs[r], kind)
    kw = {"algo": case["algo"]}
    if coll == "all_reduce":
        out = None if case["inplace"] else empty(kind, count, dt)
        got = comm.all_reduce(x, case["op"], out=out, **kw)
        want = reference(case, inputs)
    elif coll == "reduce":
        out = None if case["inplace"] else empty(kind, count, dt)
        got = comm.reduce(x, root, case["op"], out=out, **kw)
        want = reference(case, inputs) if r == root else (inputs[r] if case["inplace"] else np.zeros_like(inputs[r]))
    elif coll == "broadcast":
        got = comm.broadcast(x, root, **kw)
        want = inputs[root]
    elif coll == "all_gather":
        whole = np.zeros(count * n, dt)
        whole[r * count:(r + 1) * count] = inputs[r]
        got = to_device(whole, kind)
        if case["inplace"]:
            x = got[r * count:(r + 1) * count]
        comm.all_gather(x, got, **kw)
        want = np.concatenate(inputs)
    else:
        got = x[r * count:(r + 1) * count] if case["inplace"] else empty(kind, count, dt)
        comm.reduce_scatter(x, got, case["op"], **kw)
        want = reference(case, inputs)[r * count:(r + 1) * count]
    return compare(to_host(got, kind, dt), want, {**case, "buffers": kind})


def run_device_cases(comm, cases: list[dict], kind: str) -> list[str]:
    return [err for err in (run_device_case(comm, c, kind) for c in cases) if err]


def p2p_and_world_checks(comm, kind: str) -> list[str]:
    """send / recv around a ring of device buffers, and a mixed host / device call that must fail."""
    n, r = comm.world_size, comm.rank
    errors = []
    if n > 1:
        mine = to_device(np.arange(500, dtype=np.float32) * (r + 1), kind)
        got = empty(kind, 500, np.float32)
        nxt, prev = (r + 1) % n, (r - 1) % n
        if r % 2 == 0:
            comm.send(mine, nxt)
            comm.recv(got, prev)
        else:
            comm.recv(got, prev)
            comm.send(mine, nxt)
        want = np.arange(500, dtype=np.float32) * (prev + 1)
        if not np.array_equal(to_host(got, kind, np.float32), want):
            errors.append(f"rank {r}: recv from {prev} got the wrong data")
    try:
        comm.all_reduce(np.ones(4, np.float32), out=empty(kind, 4, np.float32))
        errors.append(f"rank {r}: a host buf with a device out was accepted")
    except TypeError as e:
        if "host memory and the other on a CUDA device" not in str(e):
            errors.append(f"rank {r}: unclear mixing error: {e}")
    return errors


def device_read_choice(comm) -> str | None:
    """Device buffers where automatic choice would take the host's one-copy "read" steps: the FIFO
    algorithms run instead, and "read" asked for by name is refused (those steps read host memory)."""
    from numba import cuda
    n = comm.world_size
    x = numba_to_device(np.full(64, comm.rank + 1, np.float32))
    comm.all_reduce(x)
    got = numba_to_host(x)
    if not (got == n * (n + 1) / 2).all():
        return f"rank {comm.rank}: all_reduce gave {got[:4]}"
    try:
        comm.all_reduce(cuda.to_device(np.ones(64, np.float32)), algo="read")
    except ValueError as e:
        return None if "comm.alloc" in str(e) else f"rank {comm.rank}: unclear refusal: {e}"
    return f"rank {comm.rank}: algo='read' on device buffers was accepted"
