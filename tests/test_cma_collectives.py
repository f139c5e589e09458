"""Plain numpy buffers in the one-copy read steps through CMA (ringcomm/plain_read.py), on real ranks."""
from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

from cases import DTYPES, compare, make_input, reference, run_case
from harness import World
from ringcomm.transport import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv in this libc (not Linux)")


def _cases(n):
    cases, i = [], 0
    for coll in ("broadcast", "all_gather", "all_reduce", "reduce_scatter", "reduce"):
        for dtype in DTYPES[::2] + ("uint8",):
            count = (1, 7, 1000, 33)[i % 4]
            cases.append(dict(collective=coll, dtype=dtype, op="sum", count=count, algo=None,
                              root=(0, n - 1)[i % 2], inplace=bool(i % 3), seed=i))
            i += 1
    cases.append(dict(collective="all_gather", dtype="float32", op="sum", count=(1 << 20) + 3, algo=None,
                      root=0, inplace=True, seed=99))
    # out of place, 8 MiB and 12 bytes a rank: the own block's copy streams (stream_copy)
    cases.append(dict(collective="all_gather", dtype="float32", op="sum", count=(2 << 20) + 3, algo=None,
                      root=0, inplace=False, seed=98))
    return cases


def _both_paths(comm, cases):
    """Every case by CMA reads (RINGCOMM_CMA_MIN=1: from one byte) and by the FIFOs: right both
    times, the same bytes, and only the copy-only collectives took the read steps."""
    reg, errors = comm._registry, []
    for case in cases:
        got = {}
        for cma_on in (True, False):
            if reg is not None:
                reg.cma = cma_on if reg.cma is not None else None
            calls = reg.engine.calls if reg is not None else 0
            err = run_case(comm, case)
            reg = comm._registry
            if err:
                errors.append(f"cma={cma_on}: {err}")
            read = reg.engine.calls - calls if reg is not None else 0
            copy_only = case["collective"] in ("broadcast", "all_gather")
            if read != (cma_on and copy_only):
                errors.append(f"cma={cma_on}: {case}: {read} read calls")
            got[cma_on] = _result(comm, case)
        if got[True] != got[False]:
            errors.append(f"{case}: CMA and FIFO results differ")
    return errors


def _result(comm, case):
    """The case's output bytes, run again (run_case checks; this keeps them to compare paths)."""
    n, r = comm.world_size, comm.rank
    inputs = [make_input(case, k, case["count"]) for k in range(n)]
    if case["collective"] == "broadcast":
        x = inputs[r].copy()
        return comm.broadcast(x, case["root"]).tobytes()
    if case["collective"] == "all_gather":
        out = np.empty(case["count"] * n, inputs[r].dtype)
        return comm.all_gather(inputs[r], out).tobytes()
    return b""


@pytest.mark.timeout(240)
def test_copy_collectives_read_plain_buffers_by_cma_with_the_fifo_bits():
    with World(3, {"RINGCOMM_CMA_MIN": "1", "RINGCOMM_BUFFSIZE": "65536"}, timeout=120) as w:
        errors = w.run(_both_paths, _cases(3), timeout=200)
    assert errors == [[]] * 3, "\n".join(e for errs in errors for e in errs)


def _refuse(comm, how):
    if comm.rank == 1:
        if how == "eperm":  # what a Yama or container refusal returns, for this rank's probes
            cma.probe = lambda pid, addr, expect: "not permitted (faked by the test)"
        else:
            os.environ["RINGCOMM_CMA"] = "0"
    x = np.full(1 << 18, comm.rank, np.float32)
    comm.broadcast(x, root=1)
    out = np.empty(2 * x.size, np.float32)
    comm.all_gather(x, out)
    return comm._registry.cma, bool((x == 1).all()), bool((out[x.size:] == 1).all() and (out[:x.size] == 1).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["eperm", "RINGCOMM_CMA=0"])
def test_a_refused_probe_on_one_rank_keeps_every_rank_on_the_fifos(how):
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=60) as w:
        assert w.run(_refuse, how, timeout=60) == [(False, True, True)] * 2


def _die_during(comm, method, root):
    """Rank 0 copies by CMA to or from rank 1 (Remote.copy_to: it reads the root, rank 1's, buffer;
    copy_from: as the root it writes half of rank 1's); rank 1 is killed just as the copy starts."""
    from ringcomm import plain_read
    original = getattr(plain_read.Remote, method)

    def killed_first(self, arr):
        os.kill(self.pid, signal.SIGKILL)
        while not _gone(self.pid):   # it is our sibling: a zombie of the test process, not reaped
            time.sleep(0.01)
        original(self, arr)

    setattr(plain_read.Remote, method, killed_first)
    comm.broadcast(np.full(1 << 20, comm.rank, np.float32), root=root)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
        return True


def _broadcast(comm, root):
    comm.broadcast(np.full(1 << 20, comm.rank, np.float32), root=root)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method, root, doing", [
    ("copy_to", 1, "reading \\(CMA\\) its buffer in broadcast #\\d+ from"),
    ("copy_from", 0, "writing \\(CMA\\) into its buffer in broadcast #\\d+ of")])
def test_a_peer_killed_during_a_cma_copy_is_reported_at_once(method, root, doing):
    with World(2, {"RINGCOMM_CMA_MIN": "1"}, timeout=60) as w:
        w.start(_die_during, method, root, ranks=[0])
        w.start(_broadcast, root, ranks=[1])
        t0 = time.monotonic()
        status, text = w.collect([0], 60)[0]
        took = time.monotonic() - t0
        w.kill()
    assert status == "err" and "PeerFailure" in text, text
    assert re.search(rf"rank 0 \(this process\) failed {doing} rank 1 over shm: rank 1 \(pid \d+\) died", text), text
    assert took < 20, f"the dead peer was reported after {took:.1f} s"
