"""CUDA tensors in the torch.distributed backend, with ProcessGroupNCCL's stream semantics.

ringcomm.torch runs a group's calls on its communicator's progress thread. For CUDA tensors, the order on the GPU must be
the caller's, although the work is queued from another thread:

- at call time, in the caller's thread, an event is recorded on the caller's current stream of the
  tensors' device: the collective runs after the work queued there so far (as NCCL's stream waits for it);
- on the worker, that device is made current and a stream of the group's own (one per device) is made
  torch's current stream; it waits for the event, then the Communicator runs the call (ringcomm's device
  path orders its own stream after that current stream, and that stream after its work on success), and
  an end event is recorded on it;
- Work.wait() (and synchronize()) waits, on the host, for the worker to have *queued* the call, then makes
  the waiting thread's current stream wait for the end event: the GPU, not the host, waits for the result,
  as with NCCL. The future is a CUDA-aware one (torch.futures.Future(devices=[the device])), completed
  once the call is queued from a stream that waits for the end event: its wait() and value(), and the
  callbacks of then(), order the caller's current stream after the collective, as NCCL's future does.
  is_completed() says whether the GPU has finished (the end event), as NCCL's Work does;
- the tensors are marked used on the group's stream (record_stream), so the caching allocator does not
  hand their memory out again before that stream has passed the call.

Point-to-point calls follow the same rule but are not queued one by one: they join the group's held batch
(ringcomm/torch_p2p.py) with its CPU ones, so an irecv posted before its isend completes. mark() records
the caller's event at each call; the batch runs inside after_callers() once for all its CUDA calls.

Reductions follow the group's reproducible setting as on the host (RINGCOMM_REPRODUCIBLE=1, or
``pg.reproducible``): a float SUM / AVG runs with reproducible=True on ringcomm's device kernels.

Only ringcomm.torch imports this module; install() wires it in: a method called with CUDA tensors goes
here, one with CPU tensors goes on as before.
"""
from __future__ import annotations

import contextlib
import functools
from datetime import timedelta

import torch

from .torch_support import REDUCIBLE, Work, ring_op


class CudaWork(Work):
    def __init__(self, inner, outputs, device, end, stream):
        # end: a one-item list the progress thread fills; stream: the group's, which the call runs on
        self.device, self._end, self._stream = device, end, stream
        super().__init__(inner, outputs)

    @property
    def end(self):
        return self._end[0]

    def _new_future(self):
        if not torch.cuda.is_available():   # the tests' stand-in CUDA tensors (torch's CPU build)
            return torch.futures.Future()
        return torch.futures.Future(devices=[self.device])

    def _complete(self) -> None:
        """Complete the future with the group's stream current, the one the call ran on (its end event is
        on it): a CUDA-aware future records its own events on the current stream when it is set, and
        whoever waits on it (or runs a callback) has its current stream wait for those, as NCCL's future
        records them on NCCL's stream."""
        if self.end is None or self._inner.exception() is not None:
            return super()._complete()
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                super()._complete()
        except Exception as e:
            if not self._completed.is_set():   # the stream could not be made current: the waiter learns why
                super()._complete(e)
            raise

    def is_completed(self) -> bool:
        """The GPU has finished the call (its end event), as NCCL's Work.is_completed() says."""
        if not super().is_completed():
            return False
        end = self.end
        return end is None or end.query()

    def wait(self, timeout=timedelta(0)) -> bool:
        super().wait(timeout)               # the worker has queued the call (or raised its error)
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self.end is not None:
            torch.cuda.current_stream(self.device).wait_event(self.end)


def _tensors(args) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a)
    return out


def _check(tensors, what: str):
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"{what}: tensors on {dev} and {t.device}; one call takes tensors of one device")
        if t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(f"{what}: CUDA tensors must be dense and contiguous")
    return dev


def _run(pg, name: str, tensors: list, outputs: list, body):
    """Queue body() on the group's worker with the stream semantics above; return its CudaWork."""
    dev, ready = mark(pg, tensors, name)
    end = [None]

    def run():
        with after_callers(pg, [(dev, ready)], end):
            body()
    pg._p2p.flush()  # held p2p calls were issued first, so they run first
    return CudaWork(pg.comm._progress.submit(name, run), outputs, dev, end, group_stream(pg, dev))


def mark(pg, tensors: list, what: str):
    """In the caller's thread: (device, an event on its current stream there), the tensors marked used on
    the group's stream of that device, so the caching allocator keeps their memory until it passed."""
    dev = _check(tensors, what)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(dev))
    side = group_stream(pg, dev)
    for t in tensors:
        t.record_stream(side)
    return dev, ready


@contextlib.contextmanager
def after_callers(pg, marks: list, end: list):
    """On the worker: the body runs with ``marks``' device current and the group's stream of it as torch's
    current stream, which first waits for every mark's event; on success end[0] is an event after the body.
    (One device: the caller checks that every mark names the same one.)"""
    dev = marks[0][0]
    side = group_stream(pg, dev)
    with torch.cuda.device(dev), torch.cuda.stream(side):
        for _, ready in marks:
            side.wait_event(ready)
        yield
        end[0] = torch.cuda.Event()     # not reached when the body raised: no stream is chained to it
        end[0].record(side)


def group_stream(pg, dev):
    """The group's own stream on ``dev`` (one per device), made at first use."""
    streams = pg.__dict__.setdefault("_cuda_streams", {})
    if dev not in streams:
        streams[dev] = torch.cuda.Stream(dev)
    return streams[dev]


def _reducible(t, what):
    if t.dtype not in REDUCIBLE:
        raise NotImplementedError(f"{what} has dtype {t.dtype}, which the ringcomm backend does not reduce")
    return t


# ---- the collectives on CUDA tensors (ringcomm's device path takes torch tensors as they are) ------------

def allreduce(pg, tensors, opts=None):
    from torch.distributed import ReduceOp
    op = ring_op(opts.reduceOp if opts is not None else ReduceOp.SUM, "all_reduce")
    ts = [_reducible(t, "all_reduce tensor") for t in tensors]
    return _run(pg, "all_reduce", ts, list(tensors), lambda: [pg.comm.all_reduce(t, op, **pg._rp(op, t)) for t in ts])


def broadcast(pg, tensors, opts):
    t = tensors[0]
    return _run(pg, "broadcast", [t], [t], lambda: pg.comm.broadcast(t.view(torch.uint8) if t.dtype not in
                                                                      REDUCIBLE else t, opts.rootRank))


def reduce(pg, tensors, opts):
    t = _reducible(tensors[0], "reduce tensor")
    op = ring_op(opts.reduceOp, "reduce")
    return _run(pg, "reduce", [t], [t], lambda: pg.comm.reduce(t, opts.rootRank, op, **pg._rp(op, t)))


def all_gather_single(pg, output, input, opts=None):
    return _run(pg, "all_gather_into_tensor", [output, input], [output], lambda: pg.comm.all_gather(input, output))


def reduce_scatter_single(pg, output, input, opts):
    op = ring_op(opts.reduceOp, "reduce_scatter_tensor")
    t = _reducible(input, "input")
    return _run(pg, "reduce_scatter_tensor", [output, input], [output],
                lambda: pg.comm.reduce_scatter(t, output, op, **pg._rp(op, t)))


def allgather(pg, output_tensors, input_tensors, opts=None):
    outs, inp = output_tensors[0], input_tensors[0]
    flat = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype, device=inp.device)

    def body():
        pg.comm.all_gather(inp, flat)
        for o, block in zip(outs, flat.view(len(outs), inp.numel())):     # on the group's stream
            o.detach().copy_(block.view(o.shape))
    return _run(pg, "all_gather", [inp, flat, *outs], list(outs), body)


# ---- point-to-point: held in the group's batch with its CPU calls (ringcomm/torch_p2p.py) ----------------
# An irecv may come before its isend; the batch runs as one comm.group() on the group's stream, after the
# callers' streams at each call. Messages match by (source, tag) as on the host.

def _one(tensors, what):
    if len(tensors) != 1:
        raise NotImplementedError(f"{what}: the ringcomm backend takes one tensor per call, got {len(tensors)}")
    return tensors[0]


def send(pg, tensors, dst, tag=0):
    t = _one(tensors, "send")
    pg._peer(dst, "send")
    return pg._p2p.send(t, dst, [t], cuda=mark(pg, [t], "send"), tag=tag)


def recv(pg, tensors, src, tag=0):
    t = _one(tensors, "recv")
    pg._peer(src, "recv")
    return pg._p2p.recv(t, src, [t], cuda=mark(pg, [t], "recv"), tag=tag)


def recv_anysource(pg, tensors, tag=0):
    t = _one(tensors, "recv from any source")
    pg._p2p.check_any_source()
    return pg._p2p.recv(t, None, [t], cuda=mark(pg, [t], "recv from any source"), tag=tag)


ROUTED = {"allreduce": allreduce, "allreduce_coalesced": allreduce, "broadcast": broadcast, "reduce": reduce,
          "all_gather_single": all_gather_single, "_allgather_base": all_gather_single,
          "reduce_scatter_single": reduce_scatter_single, "_reduce_scatter_base": reduce_scatter_single,
          "allgather": allgather, "send": send, "recv": recv,
          "recv_anysource": recv_anysource}


def install(cls) -> None:
    """Route each of ``cls``'s collectives here when it is called with CUDA tensors."""
    for name, cuda_fn in ROUTED.items():
        host_fn = getattr(cls, name)

        @functools.wraps(host_fn)
        def method(self, *args, _host=host_fn, _cuda=cuda_fn, **kwargs):
            ts = _tensors(args)
            if any(t.is_cuda for t in ts):           # then _check refuses a mix of devices
                return _cuda(self, *args, **kwargs)
            return _host(self, *args, **kwargs)
        setattr(cls, name, method)
