"""Host microseconds of each CUDA-side primitive one device slice is made of, on a real GPU, one process.

    python tests/gpu/host_costs.py [--slice 1MiB] [--reps 2000]

The device check's stage C3 found 220-400 us of host time per slice on an H200 against 6-12 us with every
CUDA call a no-op (host_overhead.py): the difference is the primitives below. Each row is the median over
``reps`` calls of the host time of one call, queued on one non-blocking stream (the GPU work itself is not
timed: a slice of ``--slice`` bytes takes the GPU a few microseconds). Rows:

  slice view            a numba device array's [i:j] (DeviceSteps.apply takes two per slice)
  wrap cupy as numba    ringcomm.buffers.device_array on a cupy array (once per call, not per slice)
  reduce_copy launch    kernels.device.reduce_copy: numba's dispatch of the reduction kernel
  copy                  kernels.device.copy: numba's copy_to_device (cudaMemcpyAsync)
  cupy memcpyAsync      cupy's runtime.memcpyAsync on raw pointers, for comparison
  wait_value            cuStreamWaitValue64 through ctypes (one per received slice)
  write_value           cuStreamWriteValue64 through ctypes (one per sent or freed slice)
  event record+query    cudaEventRecord then cudaEventQuery (the proxy's staged path)

Exits 0 with a note where there is no GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import unavailable
from bench_device import parse_size


def _median_us(fn, reps: int) -> float:
    for _ in range(min(50, reps)):          # warm: compiles, caches
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice", default="1MiB", help="bytes per slice (float32)")
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"host costs skipped: {why}")
        return 0
    import numpy as np

    import cupy
    from ringcomm.buffers import device_array
    from ringcomm.kernels import device as D
    from ringcomm.transport import cuda_rt
    from ringcomm.transport.cuda_rt import Flag

    k = parse_size(args.slice) // 4
    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    rt = cuda_rt.get()
    big = cupy.ones(4 * k, cupy.float32)
    arr = device_array(big, "buf", writable=True)
    a, b, out = arr[:k], arr[k:2 * k], arr[2 * k:3 * k]
    page = np.zeros(512, np.int64)
    flag = Flag(page[:1], rt.host_register(page))
    event = rt.event_create()
    kstream = D.as_stream(stream.ptr)
    rows = [
        ("slice view", lambda: arr[k:2 * k]),
        ("wrap cupy as numba", lambda: device_array(big, "buf", writable=True)),
        ("reduce_copy launch", lambda: D.reduce_copy(out, a, b, "sum", kstream)),
        ("copy", lambda: D.copy(out, a, kstream)),
        ("cupy memcpyAsync", lambda: cupy.cuda.runtime.memcpyAsync(
            big.data.ptr + 8 * k, big.data.ptr, 4 * k, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)),
        ("wait_value", lambda: rt.wait_value(stream.ptr, flag, 0)),     # already reached: never blocks
        ("write_value", lambda: rt.write_value(stream.ptr, flag, 0)),
        ("event record+query", lambda: (rt.event_record(event, stream.ptr), rt.event_done(event))),
    ]
    print(f"host us per call, median of {args.reps}, slice {4 * k} bytes, "
          f"stream memory operations {'on' if rt.mem_ops() else 'OFF'}")
    for name, fn in rows:
        print(f"{name:<22}{_median_us(fn, args.reps):>10.1f}", flush=True)
        stream.synchronize()
    rt.event_destroy(event)
    rt.host_unregister(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
