"""Host microseconds per device slice: ringcomm's own Python on the device path, with every CUDA call a no-op.

    python tests/gpu/host_overhead.py [--ranks 2] [--calls 20] [--count 65536] [--transport tcp]

Runs the device path under numba's CUDA simulator for its arrays, with a NULL device runtime installed in
every rank (ringcomm.transport.cuda_rt.NullRuntime: no stream, event, copy or kernel does anything), so the
time left is the executor, the connections' counters, DeviceSteps and the runtime calls' Python. A slice is
one entry of the executor's plan (one slot's worth of one step). Tiny device slots (RINGCOMM_CUDA_BUFFSIZE)
make many slices per call. Prints, per collective, the slowest rank's median wall and CPU microseconds per
slice. On a GPU the real runtime adds the cost of its calls (cupy's wrappers, numba's launch), which this
does not see; the device check's stage C3 measures that. ``--transport tcp`` (or ibverbs) makes every peer
one "on another host" (RINGCOMM_TRANSPORT): the slices are then staged through the network transport's host
slots by the communicator's proxy thread (transport/cuda_staged.py), and the figure is the caller's thread's
share plus the proxy's, as wall time per slice.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import call_collective

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
ENV = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": str(8 * 1024), "RINGCOMM_NSLOTS": "8"}


def _null_device() -> str:
    """Make every device call of this rank a no-op; say how."""
    try:
        from ringcomm.transport import cuda_rt
    except ImportError:                             # the code before the runtime seam: patch the kernels
        from ringcomm.kernels import device as kd
        for name in ("reduce_copy", "reduce", "postprocess", "copy"):
            setattr(kd, name, lambda *a, **k: a[0])
        return "kernels patched (no runtime seam)"
    cuda_rt.use(cuda_rt.NullRuntime())
    return "NullRuntime"


def rank_overhead(comm, count: int, calls: int) -> dict:
    import numpy as np
    from numba import cuda
    how = _null_device()
    n, res = comm.world_size, {"how": how}
    for coll in COLLECTIVES:
        big = cuda.to_device(np.zeros(count * n, np.float32))
        part = cuda.to_device(np.zeros(count, np.float32))
        x, out = {"all_gather": (part, big), "reduce_scatter": (big, part)}.get(coll, (part, None))
        call_collective(comm, coll, x, out)                   # connects and builds the slice plan
        plans = comm._device.executor._plans
        slices = len(next(reversed(plans.values()))[1])
        walls, cpus = [], []
        for _ in range(calls):
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            call_collective(comm, coll, x, out)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        res[coll] = (slices, statistics.median(walls) / slices * 1e6, statistics.median(cpus) / slices * 1e6)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--count", type=int, default=1 << 15, help="float32 elements per rank")
    ap.add_argument("--transport", choices=("tcp", "ibverbs"), default=None,
                    help="every peer staged over this network transport (default: cuda_ipc on this host)")
    args = ap.parse_args(argv)
    if args.transport:
        ENV["RINGCOMM_TRANSPORT"] = args.transport
    os.environ.update(ENV)
    from harness import World
    with World(args.ranks, ENV, timeout=120) as w:
        per_rank = w.run(rank_overhead, args.count, args.calls, timeout=600)
    print(f"host us per slice, NULL device runtime ({per_rank[0]['how']}), {args.ranks} ranks, "
          f"{args.count} float32 per rank, slot {int(ENV['RINGCOMM_CUDA_BUFFSIZE']) // 8} B, "
          f"{('staged over ' + args.transport) if args.transport else 'cuda_ipc'}, "
          f"load {open('/proc/loadavg').read().split()[0]}")
    print(f"{'collective':<15}{'slices/call':>12}{'wall us/slice':>15}{'cpu us/slice':>14}")
    for coll in COLLECTIVES:
        slices = per_rank[0][coll][0]
        wall = max(r[coll][1] for r in per_rank)
        cpu = max(r[coll][2] for r in per_rank)
        print(f"{coll:<15}{slices:>12}{wall:>15.1f}{cpu:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
