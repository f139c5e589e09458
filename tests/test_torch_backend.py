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
from types import SimpleNamespace

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


def check_callbacks_that_wait_for_collectives(rank, n):
    """A future's callback that issues a collective and waits for it, as DDP's PowerSGD hook does:
    the callback runs off the progress thread, which runs the collective it waits for. Nested
    twice, async and blocking, and callbacks still run in call order."""
    t, u, v = (torch.full((3,), float(rank + k)) for k in (1, 10, 100))
    order = []

    def inner(fut):
        dist.all_reduce(v)                                   # blocking, inside a callback's callback
        order.append("inner")
        return fut.value()[0] + v

    def outer(fut):
        got = dist.all_reduce(u, async_op=True).get_future().then(inner).wait()
        order.append("outer")
        return fut.value()[0] + got

    out = dist.all_reduce(t, async_op=True).get_future().then(outer).wait()
    s = n * (n + 1) / 2
    assert torch.equal(out, torch.full((3,), s + (s + 9 * n) + (s + 99 * n))), out
    assert order == ["inner", "outer"], order
    seen = []
    works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(6)]
    futs = [w.get_future().then(lambda f, i=i: seen.append(i)) for i, w in enumerate(works)]
    torch.futures.wait_all(futs)
    assert seen == list(range(6)), seen                      # completed in call order


def check_functional_and_method_forms(rank, n):
    """The functional collectives' reduce_scatter_tensor (a coalesced reduce_scatter underneath), and
    ProcessGroup's methods called with a tensor for the list and an op or root for the options."""
    import torch.distributed._functional_collectives as fc
    pg = dist.distributed_c10d._get_default_group()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # torch renames these; both names work
        got = torch.as_tensor(fc.reduce_scatter_tensor(torch.arange(2.0 * n) + rank, "sum", 0, pg))
        two = [torch.as_tensor(x) for x in fc.reduce_scatter_tensor_coalesced(
            [torch.arange(2.0 * n), torch.ones(n) * rank], "sum", [0, 0], pg)]
    assert torch.equal(got, torch.tensor([2.0 * rank, 2.0 * rank + 1]) * n + n * (n - 1) / 2), got
    assert torch.equal(two[0], torch.tensor([2.0 * rank, 2.0 * rank + 1]) * n) and two[1].item() == n * (n - 1) / 2, two
    t = torch.ones(2) * (rank + 1)
    pg.allreduce(t, RED.MAX).wait()
    assert torch.equal(t, torch.full((2,), float(n)))
    pg.allreduce([t], RED.SUM).wait()
    assert torch.equal(t, torch.full((2,), float(n * n)))
    b = torch.ones(2) * rank
    pg.broadcast(b, n - 1).wait()
    assert torch.equal(b, torch.full((2,), float(n - 1)))
    r = torch.ones(2) * (rank + 1)
    pg.reduce(r, 0, RED.SUM).wait()
    if rank == 0:
        assert torch.equal(r, torch.full((2,), n * (n + 1) / 2))


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
        _raises(ValueError, r"not contiguous", dist.all_reduce, torch.ones(8)[::2]),   # gaps: not dense
        _raises(TypeError, r"dtypes differ", dist.all_gather_single, torch.zeros(n * 2), torch.ones(2, dtype=torch.int32)),
        _raises(ValueError, r"split sizes \[1\]", dist.all_to_all_single, torch.zeros(n), torch.ones(n), None, [1]),
        _raises(ValueError, r"not another rank", dist.isend, t, rank),
        _raises(NotImplementedError, r"sums sparse tensors only", dist.all_reduce,
                torch.eye(2).to_sparse(), op=RED.MAX),
    ]
    dist.all_reduce(t)  # errors are raised before anything is queued: the group still works
    assert torch.equal(t, torch.full((8,), float(n)))
    return msgs


def check_dense_layouts(rank, n):
    """all_reduce, reduce and broadcast take a dense tensor in any order of its dimensions (as gloo
    does): channels_last, a transpose. Calls whose blocks follow the index order read a
    non-contiguous input from a contiguous copy (as gloo does), and refuse such an output."""
    want = torch.arange(120, dtype=torch.float32).reshape(2, 3, 4, 5)
    t = (want * (rank + 1)).to(memory_format=torch.channels_last)
    dist.all_reduce(t)
    assert torch.equal(t, want * (n * (n + 1) // 2)) and t.is_contiguous(memory_format=torch.channels_last)
    m = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)).t()
    dist.broadcast(m, src=n - 1)
    assert torch.equal(m, (torch.arange(12, dtype=torch.float32).reshape(3, 4) * n).t())
    r = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank).t()
    dist.reduce(r, dst=0, op=RED.MAX)
    if rank == 0:
        assert torch.equal(r, (torch.arange(12, dtype=torch.float32).reshape(3, 4) + n - 1).t())
    outs = [torch.empty(4, 3) for _ in range(n)]
    dist.all_gather(outs, (torch.arange(12.0).reshape(3, 4) + rank).t())             # a transposed input
    assert all(torch.equal(o, (torch.arange(12.0).reshape(3, 4) + q).t()) for q, o in enumerate(outs))
    z = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    dist.all_reduce(z, async_op=True)             # not waited for: the gather queued after it reads its result
    dist.all_gather(outs, z.t())
    assert all(torch.equal(o, (torch.arange(12.0).reshape(3, 4) * (n * (n + 1) // 2)).t()) for o in outs)
    x = torch.arange(2.0 * n * 2).reshape(2 * n, 2)[:, 0] + rank                      # strided: every other
    y = torch.empty(2)
    dist.reduce_scatter_tensor(y, x)
    s = torch.arange(2.0 * n * 2).reshape(2 * n, 2)[:, 0] * n + n * (n - 1) / 2
    assert torch.equal(y, s[2 * rank:2 * rank + 2]), y
    _raises(ValueError, r"reduce_scatter_tensor output is not contiguous", dist.reduce_scatter_tensor,
            torch.empty(2, 2)[:, 0], x)


def check_bool_reductions(rank, n):
    """bool tensors reduce as gloo reduces them: SUM is any, PRODUCT all, MIN and MAX alike;
    AVG is refused."""
    mine = torch.tensor([rank == 0, rank >= 0, False, rank == n - 1])
    want = {RED.SUM: [True, True, False, True], RED.MAX: [True, True, False, True],
            RED.PRODUCT: [n == 1, True, False, n == 1], RED.MIN: [n == 1, True, False, n == 1]}
    for op, expected in want.items():
        t = mine.clone()
        dist.all_reduce(t, op=op)
        assert t.dtype == torch.bool and t.tolist() == expected, (op, t)
    out = torch.empty(2, dtype=torch.bool)
    dist.reduce_scatter_tensor(out, torch.tensor([rank == 0, False] * n), op=RED.SUM)
    assert out.tolist() == [True, False], out
    _raises(NotImplementedError, r"AVG of a bool tensor", dist.all_reduce, mine.clone(), op=RED.AVG)


def check_coalesced_and_sparse(rank, n):
    outs = [[torch.zeros(2, 3), torch.zeros(0), torch.zeros(5)] for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outs, [_data(rank, (2, 3), torch.float32), torch.zeros(0),
                                         _data(rank, (5,), torch.float32) * 10])
    for q in range(n):
        assert torch.equal(outs[q][0], _data(q, (2, 3), torch.float32)) and outs[q][1].numel() == 0
        assert torch.equal(outs[q][2], _data(q, (5,), torch.float32) * 10)
    pairs = [(torch.zeros(n * 4, dtype=torch.int64), _data(rank, (4,), torch.int64)),
             (torch.zeros(n * 3, dtype=torch.bfloat16), _data(rank, (3,), torch.bfloat16))]
    pg = dist.group.WORLD
    pg.allgather_into_tensor_coalesced([o for o, _ in pairs], [i for _, i in pairs]).wait()
    for (o, i), m in zip(pairs, (4, 3)):
        assert torch.equal(o, torch.cat([_data(q, (m,), i.dtype) for q in range(n)]))
    # Sparse COO SUM: rank r holds r + 1 at index r and 1 at index 7 (shared by all), 2-d values.
    idx = torch.tensor([[rank, 7]])
    s = torch.sparse_coo_tensor(idx, torch.tensor([[rank + 1.0, 0.5], [1.0, 1.0]]), (9, 2))
    dist.all_reduce(s)
    want = torch.zeros(9, 2)
    for q in range(n):
        want[q] = torch.tensor([q + 1.0, 0.5])
    want[7] = n
    assert s.is_sparse and s.is_coalesced() and torch.equal(s.to_dense(), want)


def check_p2p_irecv_before_isend(rank, n, size):
    """Every rank posts its irecv from rank - 1 before its isend to rank + 1 (pipeline order),
    then a tagged exchange and batch_isend_irecv, with a collective issued while p2p is held."""
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(size)
    works = [dist.irecv(got, prev, tag=5), dist.isend(_data(rank, (size,), torch.float32), nxt, tag=5)]
    total = torch.ones(3)
    dist.all_reduce(total)  # runs after the held p2p calls, which it starts
    for w in works:
        assert w.wait() and w.is_completed()
    assert torch.equal(got, _data(prev, (size,), torch.float32)) and torch.equal(total, torch.full((3,), float(n)))
    a, b = torch.zeros(size), torch.zeros(7, dtype=torch.int32)
    ops = [dist.P2POp(dist.irecv, a, prev), dist.P2POp(dist.irecv, b, prev),
           dist.P2POp(dist.isend, _data(rank, (size,), torch.float32) * 2, nxt),
           dist.P2POp(dist.isend, _data(rank, (7,), torch.int32), nxt)]
    futures = [w.get_future() for w in dist.batch_isend_irecv(ops)]
    for f in futures:
        f.wait()
    assert torch.equal(a, _data(prev, (size,), torch.float32) * 2) and torch.equal(b, _data(prev, (7,), torch.int32))


def check_recv_from_any_source(rank, n):
    """Rank 0 takes two messages from every other rank without naming the source (recv and
    irecv alternating), with one directed recv from rank n - 1 in between; the others send."""
    assert dist.group.WORLD._p2p._queues        # a TCPStore: the announcements go through its queues
    if rank != 0:
        for k in range(2 if rank != n - 1 else 3):
            dist.send(torch.full((4,), 10.0 * rank + k), 0)
        return None
    seen = {q: [] for q in range(1, n)}
    for i in range(2 * (n - 1)):
        t = torch.zeros(4)
        if i % 2:
            w = dist.irecv(t)
            assert w.wait()
            src = w._source_rank()
        else:
            src = dist.recv(t)
        seen[src].append(t[0].item())
        if i == 0:
            last = torch.zeros(4)
            dist.recv(last, n - 1)  # a directed recv takes rank n - 1's next message in order
            seen[n - 1].append(last[0].item())
    assert all(sorted(v) == v for v in seen.values()), seen  # each source's messages in send order
    return {q: len(v) for q, v in seen.items()}


def check_any_source_irecv_before_isend(rank, n):
    """Every rank posts an irecv from any source before its isend to rank + 1: the batch's send announces
    itself before its receive looks for an announcement (else each waits for the other's)."""
    got = torch.zeros(3)
    works = [dist.irecv(got), dist.isend(torch.full((3,), float(rank)), (rank + 1) % n)]
    for w in works:
        assert w.wait()
    assert works[0]._source_rank() == (rank - 1) % n and torch.equal(got, torch.full((3,), float((rank - 1) % n)))
    return "ok"


def check_tags_match_by_source_and_tag(rank, n):
    """Rank 0 sends rank 1 messages with tags 1, 2, 3, 3, 2, 3; rank 1 receives them in another tag
    order (as gloo matches them): by tag, in send order within a tag. One tag-1 message waits in the
    stash across a collective until a later recv takes it; a recv of the wrong size is an error."""
    sends = [(1, 10.0), (2, 20.0), (3, 30.0), (3, 31.0), (2, 21.0), (3, 32.0)]
    if rank == 0:
        works = [dist.isend(torch.full((3,), v), 1, tag=tag) for tag, v in sends]
        for w in works:
            w.wait()
    elif rank == 1:
        got = {tag: [] for tag in (1, 2, 3)}
        bufs = [(tag, torch.zeros(3)) for tag in (2, 3, 3, 2, 3)]   # tag 1's message is stashed
        works = [dist.irecv(b, 0, tag=tag) for tag, b in bufs]
        for w in reversed(works):
            w.wait()
        for tag, b in bufs:
            got[tag].append(b[0].item())
        assert got == {1: [], 2: [20.0, 21.0], 3: [30.0, 31.0, 32.0]}, got
    total = torch.ones(1)
    dist.all_reduce(total)                              # rank 1 holds tag 1's message meanwhile
    assert total.item() == n
    if rank == 0:   # after the collective: an unreceived message would sit in the connection it uses
        dist.send(torch.full((3,), 40.0), 1, tag=4)
        dist.send(torch.full((3,), 50.0), 1, tag=5)
    elif rank == 1:
        first = torch.zeros(3)
        dist.recv(first, 0, tag=1)                      # from the stash
        assert first.tolist() == [10.0] * 3
        wrong = torch.zeros(4)
        _raises(ValueError, r"has 12 bytes, the tensor 16", lambda: dist.irecv(wrong, 0, tag=4).wait())
        last = torch.zeros(3)
        dist.recv(last, 0, tag=5)                       # the refused message was dropped, the next matches
        assert last.tolist() == [50.0] * 3 and wrong.tolist() == [0.0] * 4
    dist.barrier()
    return "ok"


def check_tags_larger_than_the_fifo(rank, n):
    """Messages of 1 MiB (the FIFO is 64 KiB): rank 0's blocking sends (tags 1 then 2) each wait for
    rank 1, which posts tag 2's irecv first -- it must take tag 1's message into the stash first. Then
    every rank posts irecvs from rank - 1 (tags 2, 1) before its isends to rank + 1 (tags 1, 2)."""
    big = 262_144  # floats: 1 MiB
    if rank == 0:
        dist.send(torch.full((big,), 1.0), 1, tag=1)
        dist.send(torch.full((big,), 2.0), 1, tag=2)
    elif rank == 1:
        b1, b2 = torch.zeros(big), torch.zeros(big)
        works = [dist.irecv(b2, 0, tag=2), dist.irecv(b1, 0, tag=1)]
        for w in works:
            w.wait()
        assert torch.equal(b1, torch.full((big,), 1.0)) and torch.equal(b2, torch.full((big,), 2.0))
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    b1, b2 = torch.zeros(big), torch.zeros(big)
    works = [dist.irecv(b2, prev, tag=2), dist.irecv(b1, prev, tag=1),
             dist.isend(torch.full((big,), 10.0 * rank + 1), nxt, tag=1),
             dist.isend(torch.full((big,), 10.0 * rank + 2), nxt, tag=2)]
    for w in works:
        w.wait()
    assert b1[0].item() == 10.0 * prev + 1 and b2[-1].item() == 10.0 * prev + 2, (b1[0], b2[-1])
    ops = [dist.P2POp(dist.irecv, b1, prev, tag=7), dist.P2POp(dist.isend, torch.full((big,), 3.0 * rank), nxt, tag=7)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(b1, torch.full((big,), 3.0 * prev))
    return "ok"


def check_any_source_with_tags(rank, n):
    """Ranks 1.. each send rank 0 tag 7 then tag 8 (value 100 r + tag). Rank 0 first takes every tag 8
    from any source, then rank n - 1's tag 7 directed, then the other tag 7s from any source."""
    if rank != 0:
        for w in [dist.isend(torch.full((2,), 100.0 * rank + tag), 0, tag=tag) for tag in (7, 8)]:
            w.wait()
        return None
    got = []
    for _ in range(1, n):
        t = torch.zeros(2)
        src = dist.recv(t, tag=8)
        got.append((src, t[0].item()))
    t = torch.zeros(2)
    dist.recv(t, n - 1, tag=7)
    got.append((n - 1, t[0].item()))
    for _ in range(2, n):
        w = dist.irecv(t, tag=7)
        w.wait()
        got.append((w._source_rank(), t[0].item()))
    assert all(v == 100.0 * src + tag for (src, v), tag in zip(got, [8] * (n - 1) + [7] * (n - 1))), got
    assert sorted(src for src, _ in got[:n - 1]) == list(range(1, n)), got
    return got


def check_group_name(rank, n):
    """torch names the group and finds it by name: functional collectives, destroy(subgroup)."""
    import torch.distributed._functional_collectives as fc
    pg = dist.group.WORLD
    assert isinstance(pg.group_name, str) and pg.group_name
    sub = dist.new_group(list(range(n)))
    assert sub.group_name != pg.group_name
    t = fc.all_reduce(_data(rank, (6,), torch.float32), "sum", sub)
    assert torch.equal(t, _expected(n, (6,), torch.float32, RED.SUM))
    dist.destroy_process_group(sub)
    return pg.group_name


def check_detail_debug_compares_calls(rank, n):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's debug level when a group is made): mismatched calls
    across ranks raise, naming every rank's call, as gloo's wrapped groups do, instead of running."""
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        sub = dist.new_group(list(range(n)))
    finally:
        dist.set_debug_level(before)
    t = _data(rank, (6,), torch.float32)
    dist.all_reduce(t, group=sub)                               # agreeing calls still run
    assert torch.equal(t, _expected(n, (6,), torch.float32, RED.SUM))
    _raises(ValueError, r"the ranks disagree.*all_reduce\(count=4.*all_reduce\(count=5",
            dist.all_reduce, torch.ones(4 if rank == 0 else 5), group=sub)
    dist.destroy_process_group(sub)


def check_split_group(rank, n):
    """Even and odd ranks split into two groups (one comm.split of the world); each reduces and
    broadcasts on its own, then is destroyed by name, and the world goes on."""
    import ringcomm.torch as rt
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    sub = rt.split_group([evens, odds])
    mine = evens if rank % 2 == 0 else odds
    assert dist.get_process_group_ranks(sub) == mine and sub.rank() == mine.index(rank)
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, torch.full((5,), float(sum(q + 1 for q in mine))))
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=mine[-1], group=sub)  # a global rank: torch maps it through the registration
    assert torch.equal(b, torch.full((2,), float(mine[-1])))
    dist.destroy_process_group(sub)
    with pytest.raises(ValueError, match="distinct ranks"):
        rt.split_group([[0], [0]])
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n


HAS_BLOCKS = all(hasattr(__import__("ringcomm").Communicator, m) for m in ("all_to_all", "gather", "scatter"))
NEEDS_BLOCKS = pytest.mark.skipif(not HAS_BLOCKS, reason="needs issue 13's comm.all_to_all / gather / scatter "
                                                         "(branch i13-coll), which this checkout lacks")
HAS_GROUPS = hasattr(__import__("ringcomm").Communicator, "group")


def check_block_collectives(rank, n):
    for root in (0, n - 1):
        outs = [torch.zeros(2, 2, dtype=torch.bfloat16) for _ in range(n)] if rank == root else None
        dist.gather(_data(rank, (2, 2), torch.bfloat16), outs, dst=root)
        if rank == root:
            assert all(torch.equal(outs[q], _data(q, (2, 2), torch.bfloat16)) for q in range(n))
        got = torch.zeros(3, dtype=torch.complex64)
        ins = [_data(q, (3,), torch.complex64) + root for q in range(n)] if rank == root else None
        dist.scatter(got, ins, src=root)
        assert torch.equal(got, _data(rank, (3,), torch.complex64) + root)
    # Equal blocks: block j of rank r holds 100 r + j.
    x = torch.tensor([100.0 * rank + j for j in range(n) for _ in range(2)])
    y = torch.zeros(2 * n)
    dist.all_to_all_single(y, x)
    assert torch.equal(y, torch.tensor([100.0 * i + rank for i in range(n) for _ in range(2)]))
    # Split sizes (rows of dim 0): rank r sends r + j + 1 rows to rank j; rows of 3 int64s.
    send = [rank + j + 1 for j in range(n)]
    recv = [i + rank + 1 for i in range(n)]
    x = torch.cat([torch.full((c, 3), 10 * rank + j) for j, c in enumerate(send)])
    y = torch.zeros(sum(recv), 3, dtype=torch.int64)
    dist.all_to_all_single(y, x, recv, send)
    assert torch.equal(y, torch.cat([torch.full((c, 3), 10 * i + rank) for i, c in enumerate(recv)]))
    # The list form: tensors of any sizes; rank r sends j + 1 values to rank j.
    outs = [torch.zeros(rank + 1) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((j + 1,), float(rank)) for j in range(n)])
    assert all(torch.equal(outs[i], torch.full((rank + 1,), float(i))) for i in range(n))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", [check_all_reduce, check_all_gather, check_reduce_scatter,
                                   check_broadcast_and_reduce, check_send_recv, check_coalesced_and_sparse,
                                   check_dense_layouts, check_bool_reductions],
                         ids=lambda f: f.__name__[6:])
def test_collective(world, check):
    world.run(check)


@pytest.mark.timeout(120)
def test_torch_distributed_debug_detail_compares_calls(world):
    world.run(check_detail_debug_compares_calls)


@pytest.mark.timeout(120)
def test_functional_collectives_and_method_forms(world):
    world.run(check_functional_and_method_forms)


@pytest.mark.timeout(120)
def test_future_callbacks_may_wait_for_collectives(world):
    world.run(check_callbacks_that_wait_for_collectives)


@pytest.mark.timeout(120)
@NEEDS_BLOCKS
def test_gather_scatter_all_to_all(world):
    world.run(check_block_collectives)


@pytest.mark.timeout(120)
def test_irecv_posted_before_isend_does_not_deadlock(world):
    world.run(check_p2p_irecv_before_isend, 10)  # fits the FIFO: held calls run, sends first


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAS_GROUPS, reason="messages larger than the FIFO both ways need comm.group() "
                                           "(issue 13, branch i13-async), which this checkout lacks")
def test_irecv_before_isend_larger_than_the_fifo(world):
    world.run(check_p2p_irecv_before_isend, 100_000)  # 400 KB each way, the FIFO is 64 KiB


@pytest.mark.timeout(120)
def test_recv_from_any_source(world):
    counts = world.run(check_recv_from_any_source)[0]
    assert counts == {q: 3 if q == world.n - 1 else 2 for q in range(1, world.n)}
    assert world.run(check_any_source_irecv_before_isend, timeout=60) == ["ok"] * world.n


@pytest.mark.timeout(120)
def test_tags_match_by_source_and_tag(world):
    assert world.run(check_tags_match_by_source_and_tag, timeout=60) == ["ok"] * world.n


@pytest.mark.timeout(180)
def test_tags_with_messages_larger_than_the_fifo(world):
    assert world.run(check_tags_larger_than_the_fifo, timeout=120) == ["ok"] * world.n


@pytest.mark.timeout(120)
def test_any_source_receives_with_tags(world):
    got = world.run(check_any_source_with_tags, timeout=60)[0]
    assert len(got) == 2 * (world.n - 1)


@pytest.mark.timeout(120)
def test_split_group_on_comm_split(world):
    world.run(check_split_group)


@pytest.mark.timeout(120)
def test_group_name_is_set(world):
    names = world.run(check_group_name)
    assert len(set(names)) == 1


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


def test_torch_store_queues_where_the_c10d_store_keeps_them(tmp_path):
    """p2p announcements go through c10d's queues (one store call each way) where the store keeps them
    (TCPStore, HashStore), and through a counter and a key per message where it does not (FileStore)."""
    from ringcomm.torch_p2p import P2PBatch
    from ringcomm.torch_support import TorchStore
    s = TorchStore(dist.PrefixStore("p/", dist.HashStore()), timeout=5)
    assert s.has_queues()
    assert s.queue_pop("q") is None                             # empty: None at once
    s.queue_push("q", "1 0 8 h")
    s.queue_push("q", b"1 3 4 h")
    assert [s.queue_pop("q"), s.queue_pop("q"), s.queue_pop("q")] == [b"1 0 8 h", b"1 3 4 h", None]
    f = TorchStore(dist.PrefixStore("p/", dist.FileStore(str(tmp_path / "store"), 1)), timeout=5)
    assert not f.has_queues()

    class Group:
        class comm:
            rank = 1
    for store, queues in ((s, True), (f, False)):
        batch = P2PBatch(Group(), store)
        assert batch._queues is queues
        op = type("Op", (), {"peer": 0, "tag": 5, "view": np.zeros(2, np.float32), "cuda": None})()
        batch._announce(op)
        assert (store.queue_pop("anysrc/0") if queues else store.get("anysrc/0/1")) == b"1 5 8 h"


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


# ---- rendezvous: a late rank, over file:// and over torch's TCPStore ------------------------------

LATE_RANK = """
import os, sys, time, torch, torch.distributed as dist, ringcomm.torch
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("ringcomm", init_method=sys.argv[1], rank=rank, world_size=n)
if rank == 1:
    time.sleep(2.0)  # the scenario, not a synchronisation: rank 0 waits 2 s for rank 1's first call
t = torch.ones(4)
dist.all_reduce(t)
print("sum", t.tolist())
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("init", ["file", "env"])
def test_a_late_rank_is_waited_for_quietly(tmp_path, init):
    """Rank 0 waits 2 s in its first call, for a peer's store key: FileStore's short waits are not
    failures, and torch's TCPStore prints no waitForInput warnings meanwhile."""
    script = tmp_path / "late.py"
    script.write_text(LATE_RANK)
    method = f"file://{tmp_path / 'rendezvous'}" if init == "file" else "env://"
    r = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", str(script), method],
                       env=_launch_env(), capture_output=True, text=True, timeout=140, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("sum [2.0, 2.0, 2.0, 2.0]") == 2, r.stdout
    assert "waitForInput" not in r.stdout + r.stderr


# ---- DeviceMesh, DTensor and FSDP2 on ringcomm ------------------------------------------------------

FSDP2 = """
import torch, torch.distributed as dist, ringcomm.torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.distributed.fsdp import fully_shard
dist.init_process_group("ringcomm")
rank, n = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
full = torch.arange(4 * n * 3, dtype=torch.float32).reshape(4 * n, 3)
d = distribute_tensor(full, mesh, [Shard(0)])
assert torch.equal(d.to_local(), full.chunk(n)[rank])
assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full)
assert torch.equal((d * 2).full_tensor(), full * 2)
torch.manual_seed(0)
def net():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
model, ref = net(), net()
ref.load_state_dict(model.state_dict())
for layer in (model[0], model[2], model):
    fully_shard(layer, mesh=mesh)
opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for step in range(2):
    x = torch.randn(n, 4, 8, generator=g)  # every rank draws the whole global batch alike
    opt.zero_grad(); model(x[rank]).sum().backward(); opt.step()
    ropt.zero_grad(); (sum(ref(x[q]).sum() for q in range(n)) / n).backward(); ropt.step()
for (k, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
    torch.testing.assert_close(p.full_tensor(), q, msg=k)
print("fsdp2 matches", rank)
dist.destroy_process_group()
"""


@pytest.mark.timeout(200)
@NEEDS_BLOCKS
def test_device_mesh_dtensor_and_two_fsdp2_steps(tmp_path):
    """DTensor shards with scatter, replicates with all_gather; FSDP2's two steps (all_gather,
    reduce_scatter) match one process training on the whole batch."""
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2)
    r = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", str(script)],
                       env=_launch_env(), capture_output=True, text=True, timeout=190, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("fsdp2 matches") == 2, r.stdout


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


def test_tags_without_announcements_are_refused(monkeypatch):
    """RINGCOMM_ANY_SOURCE=0: no announcements, so no tags to match by; messages keep issue order, and
    a nonzero tag is a ValueError at the call rather than a message swapped unseen."""
    from ringcomm.torch import ProcessGroupRingcomm

    class Comm:
        rank, world_size, timeout = 0, 2, 5.0

        def close(self):
            pass
    monkeypatch.setenv("RINGCOMM_ANY_SOURCE", "0")
    pg = ProcessGroupRingcomm(Comm(), dist.HashStore())
    for call in (lambda: pg.recv([torch.zeros(2)], 1, 3), lambda: pg.send([torch.zeros(2)], 1, 3)):
        _raises(ValueError, r"tag 3: .*do not announce.*RINGCOMM_ANY_SOURCE=0.*only tag 0", call)
    _raises(NotImplementedError, "any source", pg.recv_anysource, [torch.zeros(2)], 0)
    assert not pg._p2p._ops   # nothing held: tag 0 calls would still be taken, in issue order


def test_a_recv_takes_its_tag_and_stashes_the_messages_before_it():
    """The receiver's side alone, on announcements in a store: a recv for tag 2 receives the tag 1
    message queued before it into the stash, from which a later tag 1 recv copies it; a recv whose
    message is never announced times out naming its source and tag."""
    from ringcomm.store import HashStore
    from ringcomm.torch import ProcessGroupRingcomm
    from harness import ran_at_once
    from ringcomm.torch_p2p import P2PBatch

    class Comm:  # rank 0 of 2; each receive is filled with the number of its message from rank 1
        rank, world_size, timeout = 0, 2, 0.3
        _executor = SimpleNamespace(has_arrived=lambda peer: None)   # no link can tell (Executor.has_arrived)

        def __init__(self):
            self._progress, self.log = self, []

        def submit(self, name, fn):
            return ran_at_once(self.rank, name, fn)

        def recv(self, buf, peer):
            self.log.append((peer, buf.nbytes))
            buf.view(np.float32)[:] = len(self.log)

        def close(self):
            pass

    store = HashStore(timeout=2.0)
    for k, tag in enumerate((1, 2), 1):
        store.set(f"anysrc/0/{k}", f"1 {tag} 8 h")
    comm = Comm()
    pg = ProcessGroupRingcomm(comm, None)
    pg._p2p = P2PBatch(pg, store)
    two, one = torch.zeros(2), torch.zeros(2)
    pg.recv([two], 1, 2).wait()
    assert comm.log == [(1, 8), (1, 8)] and two.tolist() == [2.0, 2.0]   # message 1 went to the stash
    pg.recv([one], 1, 1).wait()
    assert comm.log == [(1, 8), (1, 8)] and one.tolist() == [1.0, 1.0]   # taken from it
    _raises(TimeoutError, r"recv from rank 1 with tag 3 timed out after 0.3 s", pg.recv([one], 1, 3).wait)


def test_the_future_completer_starts_afresh_in_a_forked_child():
    """A child forked while the completer's worker waits idle has no such worker: its first
    completion must start one, not notify a thread that exists only in the parent."""
    import threading
    from ringcomm.torch_support import COMPLETER
    ran = threading.Event()
    COMPLETER.submit(ran.set)
    assert ran.wait(5)
    for _ in range(100):  # until the worker is back waiting (a poll with a bound, not a sync)
        if COMPLETER._idle:
            break
        threading.Event().wait(0.01)
    pid = os.fork()
    if pid == 0:
        ok = threading.Event()
        COMPLETER.submit(ok.set)
        os._exit(0 if ok.wait(5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_completion_that_raises_leaves_the_completer_working(capsys):
    """A completion that raised (a CUDA stream that could not be made current, say) killed the
    completer's worker while it was still the active one: every later Work's future then waited for
    ever (a test hung in Future.wait this way). It is said, and the next completions run."""
    import threading
    from ringcomm.torch_support import COMPLETER
    done = threading.Event()
    COMPLETER.submit(lambda: 1 / 0)
    COMPLETER.submit(done.set)
    assert done.wait(10), "the completion after the one that raised never ran"
    assert "completing a torch Work's future failed" in capsys.readouterr().err


def test_a_cuda_work_whose_stream_cannot_be_entered_fails_rather_than_hangs(monkeypatch):
    from ringcomm import torch_cuda
    from ringcomm.work import Work as InnerWork

    class Broken:
        def __init__(self, *a):
            pass

        def __enter__(self):
            raise RuntimeError("no such device")

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "device", Broken)
    inner = InnerWork.__new__(InnerWork)
    monkeypatch.setattr(InnerWork, "exception", lambda self: None)
    work = torch_cuda.CudaWork.__new__(torch_cuda.CudaWork)
    work.device, work._end, work._stream = "cuda:0", [object()], None
    work._inner, work._outputs, work._future = inner, [], torch.futures.Future()
    work._completed = __import__("threading").Event()
    with pytest.raises(RuntimeError, match="no such device"):
        work._complete()
    assert work._completed.is_set()
    with pytest.raises(RuntimeError, match="no such device"):
        work._future.wait()
