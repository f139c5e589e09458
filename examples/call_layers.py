"""Where a repeated small call's Python goes, layer by layer (docs/06, "The small call").

    ringcomm-run -n 2 examples/call_layers.py [--calls 100000]

A call repeated on the same arrays takes the known-call path (ringcomm/known_calls.py): the public
method checks a few attributes of its arrays, `_run_known` numbers the call, and the engine's lane
enters compiled code. Here the compiled part is swapped for a compiled stub that returns "done" at
once, and each layer is timed from the stub up to the public method: what the stub does not account
for is Python. Then the real call, for scale. Two calls: an 8-byte all_reduce (the FIFO engine's
lane) and a 64 KiB broadcast (the CMA lane where this host lets ranks read each other's memory,
else the FIFO lane too). The stubbed calls move no data and wait for no one, so every rank times
its own; rank 0 prints. Internals are reached into on purpose: this is a measurement.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import ringcomm
from ringcomm import engine_native, read_engine
from ringcomm.engine_native import compiled_entry


@numba.njit(nogil=True)
def _fifo_stub(table, conns, ctl, inp, out, i, spin):   # engine_native's loop, doing nothing
    return engine_native.DONE


@numba.njit(numba.int64(numba.int64[::1]), nogil=True)
def _read_stub(block):                                   # read_native's call, doing nothing
    return 0                                             # read_native.DONE


def per_call(fn, calls: int) -> float:
    """Microseconds a call of fn(), best of three loops (a loop's mean absorbs the clock)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def layers(comm, name: str, public, buf, args: tuple, calls: int) -> tuple[dict, str]:
    """({layer: us a call}, the lane's kind) for the known call ``public()`` on ``buf``: each layer
    with the compiled part stubbed, then the real call. ``args``: the call's known-call key."""
    for _ in range(300):   # remembered, given its lane, and warm
        public()
    known = comm._known.get(buf, None, args)
    if known is None or not known.lane:
        raise SystemExit(f"rank {comm.rank}: the repeated {name} took no lane into compiled code here "
                         f"(RINGCOMM_ENGINE=python?): nothing to stub")
    lane, sched, call = known.lane, known.sched, known.call
    x = buf.reshape(-1)
    if isinstance(lane, read_engine.ReadLane):
        engine, attr, stub = lane.engine, "run_call", compiled_entry(_read_stub)
        bare = (lambda: engine.run_call(lane.args))
    else:
        e = lane.engine
        _fifo_stub(lane.table, e.conns, lane.ctl, x, x, 0, e.first)   # its one version, entered as the loop is
        engine, attr, stub = lane, "loop", compiled_entry(_fifo_stub)
        bare = (lambda: lane.loop(lane.table, e.conns, lane.ctl, x, x, 0, e.first))
    real = getattr(engine, attr)
    comm.barrier()
    real_call = per_call(public, calls)
    got = {}
    setattr(engine, attr, stub)
    call.inp = call.out = x   # as _run_known hands them over, for the layers called on their own
    try:
        got["compiled stub"] = per_call(bare, calls)
        got["lane.run"] = per_call(lambda: lane.run(sched, call), calls)
        got["comm._run_known"] = per_call(lambda: comm._run_known(known, name, x, x, x.size, args[-1]), calls)
        got["KnownCalls.get alone"] = per_call(lambda: comm._known.get(buf, None, args), calls)
        got["the public method"] = per_call(public, calls)
    finally:
        setattr(engine, attr, real)
        call.inp = call.out = None
    got["the real call"] = real_call
    comm.barrier()
    return got, type(lane).__name__


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100_000, help="calls a loop, three loops a layer")
    a = p.parse_args()
    with ringcomm.init() as comm:
        small = np.ones(2, np.float32)
        big = np.zeros(16 << 20, np.float32)   # 64 MiB, as ringcomm-bench allocates (huge pages)
        bcast = big[:16384]                    # 64 KiB of it
        ar, ar_lane = layers(comm, "all_reduce", lambda: comm.all_reduce(small), small,
                             ("all_reduce", "sum", None), a.calls)
        bc, bc_lane = layers(comm, "broadcast", lambda: comm.broadcast(bcast, 0), bcast,
                             ("broadcast", None, int, 0), a.calls)
        small[:] = comm.rank + 1                # the real calls still add up
        comm.all_reduce(small)
        ok = bool((small == comm.world_size * (comm.world_size + 1) / 2).all())
        if comm.rank == 0:
            print(f"rank 0 of {comm.world_size}, {a.calls} calls a loop, best of 3 (us a call; the compiled "
                  f"part stubbed in every row but the last)")
            print(f"{'layer':24s} {'all_reduce 8 B':>16s} {'broadcast 64 KiB':>18s}")
            print(f"{'(lane)':24s} {ar_lane:>16s} {bc_lane:>18s}")
            for row in ar:
                print(f"{row:24s} {ar[row]:16.3f} {bc[row]:18.3f}")
            print(f"results after the stubs: {'right' if ok else 'WRONG'}")
        if not ok:
            raise SystemExit(f"rank {comm.rank}: a real all_reduce after the stubs gave {small}")


if __name__ == "__main__":
    main()
