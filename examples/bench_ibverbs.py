"""One-way bandwidth of ringcomm's ibverbs transport between two processes on this host.

    python examples/bench_ibverbs.py [--sizes 4K,64K,256K,1M] [--mbytes 16] [--nslots 8]

Rank 0 streams slices of each size into rank 1's slots (RDMA WRITE WITH IMMEDIATE, credits
written back), rank 1 receives and releases them; the figure is the receiver's bytes per second,
no collective and no reduction on top. It needs pyverbs and an active RDMA port (a real NIC, or
Soft-RoCE: ../shared/rdma/run-in-rxe-guest.sh); RINGCOMM_IB_HCA etc. choose it as for ringcomm.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from ringcomm.store import TCPStore
from ringcomm.transport.base import LinkContext


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _rank(rank: int, port: int, sizes: list[int], total: int, nslots: int) -> None:
    from ringcomm.transport.ibverbs import IbverbsTransport
    store = TCPStore("127.0.0.1", port, is_server=False, timeout=60)
    for size in sizes:
        ctx = LinkContext(rank=rank, world_size=2, store=store, prefix=f"bw{size}", nslots=nslots,
                          slot_bytes=size)
        t = IbverbsTransport(ctx)
        try:
            count = max(4 * nslots, total // size)
            deadline = time.monotonic() + 120
            if rank == 0:
                conn = t.connect_send(1, deadline)
                for _ in range(count):
                    conn.acquire(deadline)  # the payload is whatever the slot holds
                    conn.post(size)
            else:
                conn = t.connect_recv(0, deadline)
                conn.wait(deadline)  # the first slice includes connecting: not timed
                conn.release()
                start = time.perf_counter()
                for _ in range(count - 1):
                    conn.wait(deadline)
                    conn.release()
                seconds = time.perf_counter() - start
                store.set(f"result/{size}", f"{count - 1} {seconds}")
            store.get(f"result/{size}", timeout=120)  # rank 0 closes only once rank 1 is done
        finally:
            t.close()
    store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,64K,256K,1M", help="slice (= slot) sizes, comma separated")
    p.add_argument("--mbytes", type=int, default=16, help="MiB to stream per size (default 16)")
    p.add_argument("--nslots", type=int, default=8, help="slots in the FIFO (default 8)")
    a = p.parse_args()
    sizes = [_size(s) for s in a.sizes.split(",")]
    spawn = mp.get_context("spawn")
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=300) as store:
        procs = [spawn.Process(target=_rank, args=(r, store.port, sizes, a.mbytes << 20, a.nslots))
                 for r in (0, 1)]
        for proc in procs:
            proc.start()
        try:
            print(f"{'slice':>10} {'slices':>7} {'seconds':>8} {'MB/s':>8}   (ibverbs, {a.nslots} slots, one way)")
            for size in sizes:
                count, seconds = store.get(f"result/{size}", timeout=300).decode().split()
                rate = int(count) * size / float(seconds) / 1e6
                print(f"{size:>10} {count:>7} {float(seconds):>8.3f} {rate:>8.1f}", flush=True)
        finally:
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()


if __name__ == "__main__":
    main()
