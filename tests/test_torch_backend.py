"""ringcomm as a torch.distributed backend: every collective through dist.* on 2 and 3 spawned
ranks, async Work, the errors for what it does not do, and DDP on ringcomm against gloo.

The checks run inside the ranks (module-level functions, so spawn can import them); all ranks
call the same collectives in the same order and assert on their own results at the end.
"""
from __future__ import annotations

import glob
import math
import multiprocessing as mp
import os
import pathlib
import re
import secrets
import subprocess
import sys
import traceback
import warnings
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
import torch.distributed as dist  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPAWN = mp.get_context("spawn")
RED = dist.ReduceOp
# A 64 KiB FIFO of 8 KiB slots: 100k floats cross many slices, and a send that big
# blocks until its receiver reads (the send/recv check orders its ranks for that).
WORLD_ENV = {"RINGCOMM_TIMEOUT": "30", "RINGCOMM_BUFFSIZE": "65536", "RINGCOMM_NSLOTS": "8"}


# ---- a world of ranks that each hold a "ringcomm" process group --------------------------------

def _serve(rank, n, port, env, conn):
    os.environ.update(env)
    import ringcomm.torch  # noqa: F401 - registers the backend
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=30))
    try:
        while (msg := conn.recv()) is not None:
            fn, args = msg
            try:
                conn.send(("ok", fn(rank, n, *args)))
            except BaseException as e:  # noqa: BLE001 - the test reports every rank's failure
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


class TorchWorld:
    def __init__(self, n: int):
        self.n, self.job = n, "tt" + secrets.token_hex(4)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        env = {**WORLD_ENV, "RINGCOMM_JOB_ID": self.job}
        self.procs, self.conns, self.broken = [], [], False
        for r in range(n):
            parent, child = SPAWN.Pipe()
            p = SPAWN.Process(target=_serve, args=(r, n, self.store.port, env, child), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def run(self, fn, *args, timeout: float = 90.0):  # a deadline for a loaded machine; ~5 s idle
        assert not self.broken, "this world was killed by an earlier failure"
        for c in self.conns:
            c.send((fn, args))
        out, errors = [], []
        for r, c in enumerate(self.conns):
            try:
                if not c.poll(timeout):
                    raise TimeoutError(f"gave no answer within {timeout} s")
                status, value = c.recv()
            except (OSError, EOFError) as e:  # TimeoutError included
                self.kill()
                raise AssertionError(f"rank {r} (exit code {self.procs[r].exitcode}) running "
                                     f"{fn.__name__}: {e or type(e).__name__}") from None
            (out if status == "ok" else errors).append(value if status == "ok" else f"rank {r}: {value}")
        assert not errors, "\n".join(errors)
        return out

    def kill(self):
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(15)
        self.kill()
        exits = [p.exitcode for p in self.procs]
        left = glob.glob(f"/dev/shm/rc-{self.job}-*")
        for path in left:
            os.unlink(path)
        return exits, left


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def world(request):
    w = TorchWorld(request.param)
    try:
        yield w
    finally:
        killed = w.broken  # then a test has failed already, and the exit codes say nothing new
        exits, left = w.close()
    assert killed or exits == [0] * w.n, f"ranks exited with {exits}"
    assert not left, f"segments left in /dev/shm: {left}"


# ---- the checks, run inside every rank ---------------------------------------------------------

def _data(rank, shape, dtype):
    """Small integers, exact in every dtype: rank r holds (i % 3) + r + 1 (bool: (i + r) odd)."""
    i = torch.arange(math.prod(shape)).reshape(shape)
    if dtype == torch.bool:
        return (i + rank) % 2 == 1
    return ((i % 3) + rank + 1).to(dtype)


def _expected(n, shape, dtype, op):
    xs = torch.stack([_data(q, shape, torch.int64) for q in range(n)])
    if op == RED.AVG:  # ringcomm's AVG: integers truncate toward zero; floats divide the sum once
        s = xs.sum(0)
        return (s.double() / n).to(dtype) if dtype.is_floating_point else torch.div(s, n, rounding_mode="trunc").to(dtype)
    reduced = {RED.SUM: xs.sum(0), RED.PRODUCT: xs.prod(0), RED.MIN: xs.min(0).values, RED.MAX: xs.max(0).values}[op]
    return reduced.to(dtype)


def check_all_reduce(rank, n):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8):
        for op in (RED.SUM, RED.PRODUCT, RED.MIN, RED.MAX, RED.AVG):
            big = op == RED.SUM and dtype in (torch.float32, torch.bfloat16)  # many slices: 8 KiB slots
            for shape in ((0,), (3, 5)) + (((100_003,),) if big else ()):
                t = _data(rank, shape, dtype)
                ptr = t.data_ptr()
                dist.all_reduce(t, op=op)
                assert t.data_ptr() == ptr
                torch.testing.assert_close(t, _expected(n, shape, dtype, op), rtol=0, atol=0,
                                           msg=lambda m: f"{dtype} {op} {shape}: {m}")


def check_all_gather(rank, n):
    for dtype in (torch.float32, torch.int16, torch.bool, torch.complex64):  # bytes move: any dtype
        mine = _data(rank, (2, 3), dtype)
        outs = [torch.zeros(2, 3, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, mine)
        for q in range(n):
            assert torch.equal(outs[q], _data(q, (2, 3), dtype)), (dtype, q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renamed it all_gather_single
        out = torch.zeros(n * 7, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, _data(rank, (7,), torch.bfloat16))
    assert torch.equal(out, torch.cat([_data(q, (7,), torch.bfloat16) for q in range(n)]))
    out = torch.zeros(n, 5)  # in place: the input is this rank's own block of the output
    out[rank].copy_(_data(rank, (5,), torch.float32))
    dist.all_gather_single(out, out[rank])
    assert torch.equal(out, torch.stack([_data(q, (5,), torch.float32) for q in range(n)]))


def check_reduce_scatter(rank, n):
    for op in (RED.SUM, RED.MAX, RED.AVG):
        full = _data(rank, (n * 1000,), torch.float32)
        want = _expected(n, (n * 1000,), torch.float32, op)[rank * 1000:(rank + 1) * 1000]
        out = torch.zeros(1000)
        dist.reduce_scatter(out, list(full.chunk(n)), op=op)
        assert torch.equal(out, want), ("list", op)
        out = torch.zeros(1000)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(out, full, op=op)
        assert torch.equal(out, want), ("tensor", op)


def check_broadcast_and_reduce(rank, n):
    for root in range(n):
        for dtype in (torch.float32, torch.complex64, torch.bool):
            t = _data(rank, (4, 4), dtype)
            dist.broadcast(t, src=root)
            assert torch.equal(t, _data(root, (4, 4), dtype)), (root, dtype)
        for op in (RED.SUM, RED.MIN):
            t = _data(rank, (50_000,), torch.int64)
            dist.reduce(t, dst=root, op=op)
            if rank == root:
                assert torch.equal(t, _expected(n, (50_000,), torch.int64, op)), (root, op)


def check_send_recv(rank, n):
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    mine, got = _data(rank, (100_000,), torch.float32), torch.zeros(100_000)  # 400 KB > the FIFO
    if rank % 2 == 0:  # even ranks send first, odd ranks receive first: the chain of waits ends
        dist.send(mine, nxt)
        dist.recv(got, prev)
    else:
        dist.recv(got, prev)
        dist.send(mine, nxt)
    assert torch.equal(got, _data(prev, (100_000,), torch.float32))
    small = torch.zeros(10, dtype=torch.int32)  # fits the FIFO: both isends complete before any recv
    works = [dist.isend(_data(rank, (10,), torch.int32), nxt), dist.irecv(small, prev)]
    for w in works:
        w.wait()
    assert torch.equal(small, _data(prev, (10,), torch.int32))
    dist.barrier()
    dist.barrier(async_op=True).wait()


def check_async_work(rank, n):
    ts = [_data(rank, (20_000,), torch.float32) * (i + 1) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    gathered = torch.zeros(n * 3, dtype=torch.int64)
    works.append(dist.all_gather_single(gathered, _data(rank, (3,), torch.int64), async_op=True))
    futures = [w.get_future() for w in works]
    for w in reversed(works):  # waiting out of order is fine: the calls ran in order
        assert w.wait() is True and w.is_completed() and w.is_success()
    for i, t in enumerate(ts):
        assert torch.equal(t, _expected(n, (20_000,), torch.float32, RED.SUM) * (i + 1)), i
        assert futures[i].wait()[0] is t
    assert torch.equal(gathered, torch.cat([_data(q, (3,), torch.int64) for q in range(n)]))
    return works[0].wait(timeout=timedelta(seconds=5))


def _raises(kind, pattern, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except kind as e:
        assert re.search(pattern, str(e)), f"{kind.__name__} says {e}"
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__}")


def check_errors(rank, n):
    t = torch.ones(8)
    msgs = [
        _raises(NotImplementedError, r"ReduceOp\.BAND", dist.all_reduce, t, op=RED.BAND),
        _raises(NotImplementedError, r"PREMUL_SUM", dist.all_reduce, t, op=dist._make_nccl_premul_sum(2.0)),
        _raises(NotImplementedError, r"int16", dist.all_reduce, torch.ones(4, dtype=torch.int16)),
        _raises(NotImplementedError, r"on meta.*CPU tensors only", dist.all_reduce, torch.ones(4, device="meta")),
        _raises(ValueError, r"not contiguous", dist.all_reduce, torch.ones(4, 4).t()),
        _raises(TypeError, r"dtypes differ", dist.all_gather_single, torch.zeros(n * 2), torch.ones(2, dtype=torch.int32)),
        _raises(NotImplementedError, r"gather", dist.gather, t, [torch.zeros(8) for _ in range(n)] if rank == 0 else None),
        _raises(NotImplementedError, r"all_to_all", dist.all_to_all_single, torch.zeros(8 * n), torch.ones(8 * n)),
        _raises(NotImplementedError, r"no tags", dist.isend, t, (rank + 1) % n, tag=3),
        _raises(NotImplementedError, r"any source", dist.irecv, t),
    ]
    dist.all_reduce(t)  # errors are raised before anything is queued: the group still works
    assert torch.equal(t, torch.full((8,), float(n)))
    return msgs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", [check_all_reduce, check_all_gather, check_reduce_scatter,
                                   check_broadcast_and_reduce, check_send_recv], ids=lambda f: f.__name__[6:])
def test_collective(world, check):
    world.run(check)


@pytest.mark.timeout(120)
def test_async_op_returns_a_work_that_waits(world):
    assert world.run(check_async_work) == [True] * world.n


@pytest.mark.timeout(120)
def test_what_it_does_not_do_raises(world):
    msgs = world.run(check_errors)[0]
    assert "ringcomm backend" in msgs[0] and "SUM, PRODUCT, MIN, MAX and AVG" in msgs[0]


def _launch_env() -> dict:
    """For ringcomm-run: a fresh job (its own token and /dev/shm names, removed when it ends)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RINGCOMM_TOKEN", "RINGCOMM_JOB_ID")}
    return {**env, "RINGCOMM_TIMEOUT": "30"}


PEER_DIES = """
import os, torch, torch.distributed as dist, ringcomm.torch
dist.init_process_group("ringcomm")
t = torch.ones(100_000)
dist.all_reduce(t)  # both ranks connected
if dist.get_rank() == 1:
    os._exit(3)
work = dist.all_reduce(t, async_op=True)
for what, wait in (("work", work.wait), ("future", work.get_future().wait), ("next call", lambda: dist.all_reduce(t))):
    try:
        wait()
        print(what, "returned")
    except Exception as e:
        print(what, type(e).__name__, e)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_failed_call_raises_from_wait_and_future(tmp_path):
    script = tmp_path / "peer_dies.py"
    script.write_text(PEER_DIES)
    r = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", "--grace", "60", str(script)],
                       env=_launch_env(), capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL)
    lines = [ln.removeprefix("[rank 0] ") for ln in r.stdout.splitlines() if ln.startswith("[rank 0] ")]
    assert r.returncode == 3, r.stdout + r.stderr
    assert lines[0].startswith("work PeerFailure") and "rank 1" in lines[0] and "all_reduce" in lines[0], lines
    assert lines[1].startswith("future PeerFailure"), lines
    assert lines[2].startswith("next call CommunicatorClosed"), lines


# ---- in this process: no ranks needed ----------------------------------------------------------

def test_tensors_are_viewed_not_copied():
    import ml_dtypes

    from ringcomm.torch_support import host_view
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.arange(6, dtype=dtype).reshape(2, 3)
        v = host_view(t, "t", reduce=True)
        assert v.ctypes.data == t.data_ptr() and v.shape == (6,)
        v[0] = 5
        assert t[0, 0].item() == 5
    assert host_view(torch.ones(2, dtype=torch.bfloat16), "t", reduce=True).dtype == ml_dtypes.bfloat16
    assert host_view(torch.ones(3), "t").dtype == np.uint8 and host_view(torch.ones(3), "t").size == 12


def test_torch_store_adapter():
    from ringcomm.errors import StoreTimeout
    from ringcomm.torch_support import TorchStore
    s = TorchStore(dist.HashStore(), timeout=5)
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.add("n", 2) == 2 and s.add("n", 3) == 5
    s.wait(["a", "n"], timeout=1)
    assert s.delete("a") and not s.delete("a")
    with pytest.raises(StoreTimeout, match="'missing'"):
        s.get("missing", timeout=0)  # c10d reads 0 as "forever": the adapter must not pass it


def test_import_ringcomm_does_not_import_torch():
    code = "import sys, ringcomm; assert 'torch' not in sys.modules, 'ringcomm imported torch'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---- DDP: the example, on ringcomm and on gloo ---------------------------------------------------

GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def _train(backend, tmp_path):
    save = tmp_path / f"{backend}.pt"
    for attempt in range(3):
        r = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2",
                            str(ROOT / "examples" / "ddp_train.py"), "--backend", backend, "--save", str(save)],
                           env=_launch_env(), capture_output=True, text=True, timeout=110,
                           stdin=subprocess.DEVNULL)
        # The reference run only: torch 2.13's gloo sometimes aborts in its own teardown, after
        # training and saving (about one run in five here). Run it again; ringcomm gets no retry.
        if not (backend == "gloo" and r.returncode == 134 and GLOO_TEARDOWN_ABORT in r.stdout + r.stderr):
            break
    assert r.returncode == 0, f"{backend}: {r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    losses = [float(m) for m in re.findall(r"\[rank 0\] step +\d+ +loss ([0-9.]+)", r.stdout)]
    return losses, torch.load(save)


@pytest.mark.timeout(240)
def test_ddp_trains_the_same_on_ringcomm_and_gloo(tmp_path):
    ring_losses, ring = _train("ringcomm", tmp_path)
    gloo_losses, gloo = _train("gloo", tmp_path)
    assert len(ring_losses) == len(gloo_losses) == 50
    assert ring_losses[-1] < 0.25 * ring_losses[0], "the model did not train"
    assert max(abs(a - b) for a, b in zip(ring_losses, gloo_losses)) <= 1e-6
    assert ring.keys() == gloo.keys()
    diff = max((ring[k] - gloo[k]).abs().max().item() for k in ring)
    scale = max(v.abs().max().item() for v in gloo.values())
    assert diff <= 1e-6 * scale, f"largest parameter difference {diff}"


def test_cuda_tensors_are_routed_to_the_device_path_and_cpu_tensors_stay(monkeypatch):
    """ringcomm/torch_cuda.py's wiring, without a GPU: a call with a CUDA tensor goes to the CUDA variant
    (tests/gpu/test_gpu_torch.py checks what that does on a GPU), one with CPU tensors to the host one."""
    from ringcomm import torch_cuda
    calls = []
    monkeypatch.setattr(torch_cuda, "ROUTED", {name: (lambda self, *a, _n=name, **k: calls.append(("cuda", _n)))
                                               for name in torch_cuda.ROUTED})
    group = type("Group", (), {name: (lambda self, *a, _n=name, **k: calls.append(("host", _n)))
                               for name in torch_cuda.ROUTED})
    torch_cuda.install(group)

    class CudaLooking(torch.Tensor):
        is_cuda = True
    g = group()
    g.allreduce([torch.ones(2)])
    g.allreduce([torch.ones(2).as_subclass(CudaLooking)])
    g.allgather([[torch.ones(2)]], [torch.ones(2).as_subclass(CudaLooking)])
    assert calls == [("host", "allreduce"), ("cuda", "allreduce"), ("cuda", "allgather")], calls
