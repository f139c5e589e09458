"""ringcomm as a torch.distributed backend.

    import ringcomm.torch                       # registers the backend "ringcomm"
    dist.init_process_group("ringcomm")         # under torchrun or ringcomm-run
    model = DistributedDataParallel(model)      # DDP's gradient all-reduce now runs on ringcomm

A Python ProcessGroup, as torch's own testing/_internal/distributed/multi_threaded_pg.py builds
one. torch hands the backend its c10d Store; ringcomm rendezvous through it (TorchStore), so no
second port is opened. Each process group owns one Communicator; its calls queue on the
communicator's progress thread (ringcomm/progress.py) in the order they are made and run one at a
time, and each returns a Work whose wait() and get_future() follow it. DDP's reducer calls
allreduce from C++ and waits on the future with the GIL released, so the progress thread runs
while backward goes on.

Reproducible sums: with RINGCOMM_REPRODUCIBLE=1 in the environment when a group is made (or
``ProcessGroupRingcomm.reproducible = True`` later), every float SUM / AVG the group reduces --
all_reduce, reduce, reduce_scatter, so DDP's gradient buckets too -- runs with reproducible=True:
its bits depend only on the multiset of the ranks' tensors. Other reductions (MIN, MAX, PRODUCT,
integer dtypes) run as before: MIN, MAX and integer sums are order-independent already.

Tensors are read and written in place through numpy views of their memory (bfloat16 through
ml_dtypes); CUDA tensors go to ringcomm's device path with ProcessGroupNCCL's stream semantics
(ringcomm/torch_cuda.py). What the backend does not do raises NotImplementedError
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

from . import torch_collectives as colls
from . import torch_cuda, torch_groups
from .torch_p2p import P2PBatch
from .torch_support import TorchStore, Work, check_tensor, host_view, read_view, same_kind, tensor_op

BACKEND = "ringcomm"
_LIVE: weakref.WeakSet = weakref.WeakSet()  # groups still open, closed at exit


def _unsupported(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"the ringcomm backend does not implement {name}; it has all_reduce, "
                                  f"all_gather, reduce_scatter, broadcast, reduce, gather, scatter, all_to_all, "
                                  f"send, recv and barrier, and coalesced all_reduce and all_gather")
    method.__name__ = name
    return method


# ProcessGroup's methods also take a tensor for a list, and an op or a root for the options
# (pg.allreduce(t, ReduceOp.MAX), pg.broadcast(t, 1), pg.reduce(t, 0, op)), as gloo's do.

def _listed(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _op(opts):
    """The reduction of an options object, or the op itself; SUM for none."""
    if opts is None:
        return dist.ReduceOp.SUM
    return opts.reduceOp if hasattr(opts, "reduceOp") else opts


def _root(opts) -> int:
    return opts if isinstance(opts, int) else opts.rootRank


def _one(tensors, collective: str):
    if len(tensors) != 1:
        raise NotImplementedError(f"{collective}: the ringcomm backend takes one tensor per call, got {len(tensors)}")
    return tensors[0]


class ProcessGroupRingcomm(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a ringcomm Communicator."""

    def __init__(self, comm: ringcomm.Communicator, store=None):
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            # TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps gloo and NCCL groups to compare every
            # collective's fingerprint across ranks first; it cannot wrap a Python ProcessGroup, so
            # the group does it itself (RINGCOMM_DEBUG=check): a mismatch is a CollectiveMismatch
            # naming each rank's call, before any data moves.
            comm._check = True
        self.reproducible = reproducible_from_env()
        # torch's store for this group (None for a group made from a Communicator alone): it
        # carries p2p's any-source announcements, and split_group's groups take a prefix of it.
        self.store = store
        # RINGCOMM_ANY_SOURCE=0 (alike on every rank) spares each send its two store calls.
        announce = store is not None and _flag("RINGCOMM_ANY_SOURCE", True, "recv from any source")
        self._p2p = P2PBatch(self, TorchStore(dist.PrefixStore("ringcomm-p2p/", store), comm.timeout)
                             if announce else None)
        _LIVE.add(self)

    def getBackendName(self) -> str:
        return BACKEND

    # torch names every group it makes (_set_group_name) and looks groups up by that name:
    # destroy_process_group(subgroup), functional collectives, DeviceMesh. The C++ getter reads
    # the name from a registered backend, and a Python ProcessGroup is its own backend, so
    # without these it raises "ProcessGroup name not set" (multi_threaded_pg keeps its name too).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError(f"{self!r} has no group name yet: torch names a group once it made it")
        return name

    def __repr__(self):
        return f"<ProcessGroupRingcomm rank {self.comm.rank} of {self.comm.world_size}>"

    def _rp(self, op, view) -> dict:
        """The reproducible keyword for one reduction: on where the group asks and it applies (a float SUM /
        AVG). ``view``: a host view (numpy; bfloat16's numpy kind is "V", not "f") or a CUDA tensor."""
        dtype = view.dtype
        floating = dtype.is_floating_point if isinstance(dtype, torch.dtype) else \
            dtype.kind == "f" or str(dtype) == "bfloat16"
        on = self.reproducible and op in (ringcomm.SUM, ringcomm.AVG) and floating
        return {"reproducible": True} if on else {}

    def _submit(self, name: str, outputs: list, fn) -> Work:
        self._p2p.flush()  # held p2p calls were issued first, so they run first
        return self._submit_now(name, outputs, fn)

    def _submit_now(self, name: str, outputs: list, fn) -> Work:
        # fn runs on the communicator's progress thread, where its blocking ringcomm calls run inline.
        return Work(self.comm._progress.submit(name, fn), outputs)

    # ---- reductions -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensors, red = _listed(tensors), _op(opts)
        if len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:
            name = getattr(getattr(red, "op", red), "name", str(red))
            return self._submit("sparse all_reduce", *colls.sparse_all_reduce(self.comm, tensors[0], name))
        views = [(host_view(t, "all_reduce tensor", reduce=True, elementwise=True), tensor_op(red, t, "all_reduce"))
                 for t in tensors]
        return self._submit("all_reduce", list(tensors),
                            lambda: [self.comm.all_reduce(v, o, **self._rp(o, v)) for v, o in views])

    allreduce_coalesced = allreduce  # a list of tensors, reduced one after another

    def reduce(self, tensors, opts, op=None):
        t, root = _one(_listed(tensors), "reduce"), _root(opts)
        op = tensor_op(_op(opts if op is None else op), t, "reduce")
        v = host_view(t, "reduce tensor", reduce=True, elementwise=True)
        return self._submit("reduce", [t], lambda: self.comm.reduce(v, root, op, **self._rp(op, v)))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        out, ins = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        op = tensor_op(opts.reduceOp, out, "reduce_scatter")
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
        return self._reduce_scatters("reduce_scatter_tensor", [output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """One reduce_scatter per (output, input) pair, in one queued call: the functional
        collectives' reduce_scatter_tensor comes here."""
        if len(outputs) != len(inputs):
            raise ValueError(f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
        n = self.comm.world_size
        for o, i in zip(outputs, inputs):
            if i.numel() != n * o.numel():
                raise ValueError(f"reduce_scatter_tensor_coalesced: an input has {i.numel()} elements, "
                                 f"not {n} x its output's {o.numel()}")
        return self._reduce_scatters("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _reduce_scatters(self, name: str, outputs, inputs, opts):
        """One queued call of a reduce_scatter per (output, input) pair, in order."""
        red, calls = _op(opts), []
        for o, i in zip(outputs, inputs):
            op = tensor_op(red, o, name)
            same_kind(i, o, f"{name} input and output")
            (x, fill), y = read_view(i, f"{name} input", reduce=True), host_view(o, f"{name} output", reduce=True)
            calls.append((x, fill, y, op))

        def run():
            for x, fill, y, op in calls:
                fill()
                self.comm.reduce_scatter(x, y, op, **self._rp(op, x))
        return self._submit(name, list(outputs), run)

    _reduce_scatter_base = reduce_scatter_single

    # ---- data movement: bytes, so every dtype moves -----------------------------------------

    def broadcast(self, tensors, opts):
        t, root = _one(_listed(tensors), "broadcast"), _root(opts)
        v = host_view(t, "broadcast tensor", elementwise=True)
        return self._submit("broadcast", [t], lambda: self.comm.broadcast(v, root))

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, inp = _one(output_tensors, "all_gather"), _one(input_tensors, "all_gather")
        n = self.comm.world_size
        x, fill = read_view(inp, "all_gather input")
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
            fill()
            self.comm.all_gather(x, y)
            for o, block in zip(outs, flat.view(n, inp.numel())):
                o.detach().copy_(block.view(o.shape))
        return self._submit("all_gather", list(outs), run)

    def all_gather_single(self, output, input, opts=None):
        same_kind(input, output, "all_gather_into_tensor input and output")
        x, fill = read_view(input, "all_gather_into_tensor input")
        y = host_view(output, "all_gather_into_tensor output")
        return self._submit("all_gather_into_tensor", [output], lambda: (fill(), self.comm.all_gather(x, y)))

    _allgather_base = all_gather_single

    # Held, then run together (ringcomm/torch_p2p.py): an irecv may come before its isend. Messages
    # match by (source, tag), in send order within one, as gloo's do.
    def send(self, tensors, dst, tag=0):
        t = _one(tensors, "send")
        v = host_view(t, "send tensor", elementwise=True)
        self._peer(dst, "send")
        return self._p2p.send(v, dst, [t], tag=tag)

    def recv(self, tensors, src, tag=0):
        t = _one(tensors, "recv")
        v = host_view(t, "recv tensor", elementwise=True)
        self._peer(src, "recv")
        return self._p2p.recv(v, src, [t], tag=tag)

    def recv_anysource(self, tensors, tag=0):
        t = _one(tensors, "recv from any source")
        self._p2p.check_any_source()
        return self._p2p.recv(host_view(t, "recv tensor", elementwise=True), None, [t], tag=tag)

    def _peer(self, peer, what):
        if not 0 <= peer < self.comm.world_size or peer == self.comm.rank:
            raise ValueError(f"{what}: peer {peer} is not another rank of this group of {self.comm.world_size}")

    def barrier(self, opts=None):
        return self._submit("barrier", [], self.comm.barrier)


    # ---- block collectives (ringcomm/torch_collectives.py) -----------------------------------

    def gather(self, output_tensors, input_tensors, opts):
        return self._submit("gather", *colls.gather(self.comm, output_tensors, input_tensors, opts.rootRank))

    def scatter(self, output_tensors, input_tensors, opts):
        return self._submit("scatter", *colls.scatter(self.comm, output_tensors, input_tensors, opts.rootRank))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._submit("all_to_all_single", *colls.all_to_all_single(
            self.comm, output, input, output_split_sizes, input_split_sizes))

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._submit("all_to_all", *colls.all_to_all(self.comm, output_tensors, input_tensors))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._submit("all_gather_coalesced", *colls.all_gather_coalesced(self.comm, output_lists, input_list))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._submit("all_gather_into_tensor_coalesced",
                            *colls.all_gather_into_tensor_coalesced(self.comm, outputs, inputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # ---- sub-groups (ringcomm/torch_groups.py) -------------------------------------------------

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """Collective over this group: the ranks listing the same ``ranks`` form a new group (one
        comm.split, no rendezvous); None where ``ranks`` is empty or None."""
        return torch_groups.split(self, ranks, group_name, group_desc)

    # ---- lifecycle --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish the queued calls, then close the Communicator (destroy_process_group calls this);
        close() lets the queue drain for up to the timeout, then aborts what is left."""
        _LIVE.discard(self)
        self._p2p.flush()
        self.comm.close()

    abort = shutdown


def reproducible_from_env() -> bool:
    """RINGCOMM_REPRODUCIBLE: "1" on, "0" or unset off; anything else is a ValueError naming it."""
    return _flag("RINGCOMM_REPRODUCIBLE", False, "reproducible float sums")


def _flag(name: str, default: bool, what: str) -> bool:
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: use 1 ({what}) or 0")
    return default if raw == "" else raw == "1"


torch_cuda.install(ProcessGroupRingcomm)  # CUDA tensors: NCCL's stream semantics (ringcomm/torch_cuda.py)


def _create_process_group(store, rank, world_size, timeout):
    # torch passes its default 30 min when the user named no timeout: then ringcomm's own
    # (RINGCOMM_TIMEOUT, default 300 s) applies, as it does outside torch.
    seconds = None if timeout is None or timeout == default_pg_timeout else timeout.total_seconds()
    adapter = TorchStore(store)
    comm = ringcomm.init(rank, world_size, store=adapter, timeout=seconds)
    adapter.timeout = comm.timeout
    return ProcessGroupRingcomm(comm, store)


@atexit.register
def _close_all() -> None:
    for pg in list(_LIVE):  # groups the program never destroyed: release their segments
        pg.shutdown()


# "cuda" too: CUDA tensors run on ringcomm's device path (torch_cuda.py).
split_group = torch_groups.split_group
dist.Backend.register_backend(BACKEND, _create_process_group, devices=["cpu", "cuda"])
