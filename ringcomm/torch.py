"""ringcomm as a torch.distributed backend.

    import ringcomm.torch                       # registers the backend "ringcomm"
    dist.init_process_group("ringcomm")         # under torchrun or ringcomm-run
    model = DistributedDataParallel(model)      # DDP's gradient all-reduce now runs on ringcomm

A Python ProcessGroup, as torch's own testing/_internal/distributed/multi_threaded_pg.py builds
one. torch hands the backend its c10d Store; ringcomm rendezvous through it (TorchStore), so no
second port is opened. Each process group owns one Communicator and one worker thread: calls
queue in the order they are made and run one at a time, and each returns a Work whose wait() and
get_future() follow it. DDP's reducer calls allreduce from C++ and waits on the future with the
GIL released, so the worker runs while backward goes on.

Reproducible sums: with RINGCOMM_REPRODUCIBLE=1 in the environment when a group is made (or
``ProcessGroupRingcomm.reproducible = True`` later), every float SUM / AVG the group reduces --
all_reduce, reduce, reduce_scatter, so DDP's gradient buckets too -- runs with reproducible=True:
its bits depend only on the multiset of the ranks' tensors. Other reductions (MIN, MAX, PRODUCT,
integer dtypes) run as before: MIN, MAX and integer sums are order-independent already.

Tensors are read and written in place through numpy views of their memory (bfloat16 through
ml_dtypes); CPU tensors only for now. What the backend does not do raises NotImplementedError
saying so. A Python ProcessGroup stands for the whole group (torch cannot take a Python backend
for one device only), so "cpu:ringcomm,cuda:nccl" would still route CUDA tensors here.
"""
from __future__ import annotations

import atexit
import os
import weakref

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("ringcomm.torch needs PyTorch: pip install 'ringcomm[torch]' "
                      "(pins torch 2.13.0; its CPU build is enough)") from e

import ringcomm

from .torch_support import TorchStore, Work, Worker, check_tensor, host_view, ring_op, same_kind

BACKEND = "ringcomm"
_LIVE: weakref.WeakSet = weakref.WeakSet()  # groups still open, closed at exit


def _unsupported(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"the ringcomm backend does not implement {name}; it has all_reduce, "
                                  f"all_gather, reduce_scatter, broadcast, reduce, send, recv and barrier")
    method.__name__ = name
    return method


def _one(tensors, collective: str):
    if len(tensors) != 1:
        raise NotImplementedError(f"{collective}: the ringcomm backend takes one tensor per call, got {len(tensors)}")
    return tensors[0]


class ProcessGroupRingcomm(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a ringcomm Communicator."""

    def __init__(self, comm: ringcomm.Communicator):
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        self._worker = Worker(comm.rank)
        self._seq = 0
        self.reproducible = reproducible_from_env()
        _LIVE.add(self)

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupRingcomm rank {self.comm.rank} of {self.comm.world_size}>"

    def _rp(self, op, view) -> dict:
        """The reproducible keyword for one reduction: on where the group asks and it applies."""
        on = self.reproducible and op in (ringcomm.SUM, ringcomm.AVG) and view.dtype.kind == "f"
        return {"reproducible": True} if on else {}

    def _submit(self, name: str, outputs: list, fn) -> Work:
        self._seq += 1
        return self._worker.submit(Work(self._worker, name, self._seq, outputs), fn)

    # ---- reductions -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op = ring_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce")
        views = [host_view(t, "all_reduce tensor", reduce=True) for t in tensors]
        return self._submit("all_reduce", list(tensors),
                            lambda: [self.comm.all_reduce(v, op, **self._rp(op, v)) for v in views])

    allreduce_coalesced = allreduce  # a list of tensors, reduced one after another

    def reduce(self, tensors, opts):
        t, op = _one(tensors, "reduce"), ring_op(opts.reduceOp, "reduce")
        v = host_view(t, "reduce tensor", reduce=True)
        return self._submit("reduce", [t], lambda: self.comm.reduce(v, opts.rootRank, op, **self._rp(op, v)))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        out, ins = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        op = ring_op(opts.reduceOp, "reduce_scatter")
        y = host_view(out, "reduce_scatter output", reduce=True)
        if len(ins) != self.comm.world_size:
            raise ValueError(f"reduce_scatter: {len(ins)} input tensors for a group of {self.comm.world_size}")
        for t in ins:
            check_tensor(t, "reduce_scatter input")
            same_kind(t, out, "reduce_scatter input and output")
            if t.numel() != out.numel():
                raise ValueError(f"reduce_scatter: an input has {t.numel()} elements, the output {out.numel()}")
        # ringcomm reduces one buffer of world_size blocks: stage the list into one.
        flat = torch.empty(len(ins) * out.numel(), dtype=out.dtype)
        x = host_view(flat, "reduce_scatter staging", reduce=True)

        def run():  # copies at run time, so earlier queued calls that write the inputs count
            torch.cat([t.detach().reshape(-1) for t in ins], out=flat)
            self.comm.reduce_scatter(x, y, op, **self._rp(op, x))
        return self._submit("reduce_scatter", [out], run)

    def reduce_scatter_single(self, output, input, opts):
        op = ring_op(opts.reduceOp, "reduce_scatter_tensor")
        same_kind(input, output, "reduce_scatter_tensor input and output")
        x = host_view(input, "reduce_scatter_tensor input", reduce=True)
        y = host_view(output, "reduce_scatter_tensor output", reduce=True)
        return self._submit("reduce_scatter_tensor", [output],
                            lambda: self.comm.reduce_scatter(x, y, op, **self._rp(op, x)))

    _reduce_scatter_base = reduce_scatter_single

    # ---- data movement: bytes, so every dtype moves -----------------------------------------

    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        v = host_view(t, "broadcast tensor")
        return self._submit("broadcast", [t], lambda: self.comm.broadcast(v, opts.rootRank))

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, inp = _one(output_tensors, "all_gather"), _one(input_tensors, "all_gather")
        n = self.comm.world_size
        x = host_view(inp, "all_gather input")
        if len(outs) != n:
            raise ValueError(f"all_gather: {len(outs)} output tensors for a group of {n}")
        for o in outs:
            check_tensor(o, "all_gather output")
            same_kind(inp, o, "all_gather input and output")
            if o.numel() != inp.numel():
                raise ValueError(f"all_gather: an output has {o.numel()} elements, the input {inp.numel()}")
        flat = torch.empty(n * inp.numel(), dtype=inp.dtype)
        y = host_view(flat, "all_gather staging")

        def run():
            self.comm.all_gather(x, y)
            for o, block in zip(outs, flat.view(n, inp.numel())):
                o.detach().copy_(block.view(o.shape))
        return self._submit("all_gather", list(outs), run)

    def all_gather_single(self, output, input, opts=None):
        same_kind(input, output, "all_gather_into_tensor input and output")
        x = host_view(input, "all_gather_into_tensor input")
        y = host_view(output, "all_gather_into_tensor output")
        return self._submit("all_gather_into_tensor", [output], lambda: self.comm.all_gather(x, y))

    _allgather_base = all_gather_single

    def send(self, tensors, dst, tag=0):
        t = self._p2p_check(tensors, tag, "send")
        v = host_view(t, "send tensor")
        return self._submit("send", [t], lambda: self.comm.send(v, dst))

    def recv(self, tensors, src, tag=0):
        t = self._p2p_check(tensors, tag, "recv")
        v = host_view(t, "recv tensor")
        return self._submit("recv", [t], lambda: self.comm.recv(v, src))

    def _p2p_check(self, tensors, tag, what):
        if tag != 0:
            raise NotImplementedError(f"{what}: the ringcomm backend has no tags (got tag={tag}); messages "
                                      f"between two ranks arrive in the order they were sent")
        return _one(tensors, what)

    def barrier(self, opts=None):
        return self._submit("barrier", [], self.comm.barrier)

    recv_anysource = _unsupported("recv from any source")
    alltoall = _unsupported("all_to_all")
    alltoall_base = all_to_all_single = _unsupported("all_to_all_single")
    gather = _unsupported("gather")
    scatter = _unsupported("scatter")
    allgather_coalesced = _unsupported("all_gather_coalesced")
    all_gather_single_coalesced = allgather_into_tensor_coalesced = _unsupported("coalesced all_gather")
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced = _unsupported("coalesced reduce_scatter")

    # ---- lifecycle --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish the queued calls, then close the Communicator (destroy_process_group calls this)."""
        _LIVE.discard(self)
        self._worker.stop(self.comm.timeout + 5.0)
        self.comm.close()

    abort = shutdown


def reproducible_from_env() -> bool:
    """RINGCOMM_REPRODUCIBLE: "1" on, "0" or unset off; anything else is a ValueError naming it."""
    raw = os.environ.get("RINGCOMM_REPRODUCIBLE", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"RINGCOMM_REPRODUCIBLE={raw!r}: use 1 (reproducible float sums) or 0")
    return raw == "1"


def _create_process_group(store, rank, world_size, timeout):
    # torch passes its default 30 min when the user named no timeout: then ringcomm's own
    # (RINGCOMM_TIMEOUT, default 300 s) applies, as it does outside torch.
    seconds = None if timeout is None or timeout == default_pg_timeout else timeout.total_seconds()
    adapter = TorchStore(store)
    comm = ringcomm.init(rank, world_size, store=adapter, timeout=seconds)
    adapter.timeout = comm.timeout
    return ProcessGroupRingcomm(comm)


@atexit.register
def _close_all() -> None:
    for pg in list(_LIVE):  # groups the program never destroyed: release their segments
        pg.shutdown()


# "cuda" too, so that a CUDA tensor reaches this backend and gets its clear NotImplementedError.
dist.Backend.register_backend(BACKEND, _create_process_group, devices=["cpu", "cuda"])
