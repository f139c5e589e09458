"""The torch backend's block collectives, coalesced all_gather and sparse all_reduce.

Each function checks its tensors at once (TypeError / ValueError / NotImplementedError before
anything is queued) and returns (output tensors, run): ``run`` does the call on the communicator's
queue. Data moves as bytes, so every dtype moves; a list of tensors is staged into one flat
buffer and back, as torch's gloo backend does. Only ringcomm.torch imports this module.
"""
from __future__ import annotations

import torch

from .torch_support import check_tensor, host_view, read_view, same_kind


def _stage(tensors, what):
    """One flat byte buffer the size of ``tensors`` together, and its numpy view."""
    for t in tensors:
        check_tensor(t, what)
    flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
    return flat, host_view(flat, what + " staging")


def _pack(tensors, flat) -> None:
    if tensors:
        torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors], out=flat)


def _unpack(flat, tensors) -> None:
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            t.detach().view(-1).view(torch.uint8).copy_(flat[at:at + n])
        at += n


def _sizes(tensors, what, like) -> None:
    for t in tensors:
        check_tensor(t, what)
        same_kind(like, t, what)
        if t.numel() != like.numel():
            raise ValueError(f"{what}: {t.numel()} elements where {like.numel()} were expected")


def gather(comm, outputs, inputs, root):
    """torch's gather: root's outputs[0] (world_size tensors) gets every rank's inputs[0]."""
    inp, n = inputs[0], comm.world_size
    x, fill = read_view(inp, "gather input")
    if comm.rank != root:
        if outputs and outputs[0]:
            raise ValueError(f"gather: rank {comm.rank} is not the root ({root}) and must pass no gather_list")
        return [], lambda: (fill(), comm.gather(x, root=root))
    outs = outputs[0]
    if len(outs) != n:
        raise ValueError(f"gather: the root passes {len(outs)} output tensors for a group of {n}")
    _sizes(outs, "gather output", inp)
    flat, y = _stage(outs, "gather output")

    def run():
        fill()
        comm.gather(x, y, root=root)
        _unpack(flat, outs)
    return list(outs), run


def scatter(comm, outputs, inputs, root):
    """torch's scatter: root's inputs[0] (world_size tensors) block r goes to rank r's outputs[0]."""
    out, n = outputs[0], comm.world_size
    y = host_view(out, "scatter output")
    if comm.rank != root:
        if inputs and inputs[0]:
            raise ValueError(f"scatter: rank {comm.rank} is not the root ({root}) and must pass no scatter_list")
        return [out], lambda: comm.scatter(None, y, root=root)
    ins = inputs[0]
    if len(ins) != n:
        raise ValueError(f"scatter: the root passes {len(ins)} input tensors for a group of {n}")
    _sizes(ins, "scatter input", out)
    flat, x = _stage(ins, "scatter input")

    def run():  # packs at run time: earlier queued calls that write the inputs count
        _pack(ins, flat)
        comm.scatter(x, y, root=root)
    return [out], run


def _split_bytes(t, splits, n, what):
    """Byte counts per rank of torch's split sizes (rows of dim 0); equal blocks when none."""
    rows = t.shape[0] if t.dim() else 1
    row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
    if not splits:
        if rows % n:
            raise ValueError(f"{what}: dim 0 ({rows}) does not split into {n} equal blocks; pass split sizes")
        return [rows // n * row_bytes] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"{what}: split sizes {splits} must be {n} counts >= 0 summing to dim 0 ({rows})")
    return [s * row_bytes for s in splits]


def all_to_all_single(comm, output, input, output_splits, input_splits):
    same_kind(input, output, "all_to_all_single input and output")
    n = comm.world_size
    (x, fill), y = read_view(input, "all_to_all_single input"), host_view(output, "all_to_all_single output")
    send = _split_bytes(input, input_splits, n, "all_to_all_single input")
    recv = _split_bytes(output, output_splits, n, "all_to_all_single output")
    if input.numel() and output.numel() and input.data_ptr() == output.data_ptr():
        raise ValueError("all_to_all_single: output and input are the same memory; ringcomm needs two buffers")
    if not input_splits and not output_splits:
        if x.size != y.size:
            raise ValueError(f"all_to_all_single: input has {input.numel()} elements, output {output.numel()}")
        return [output], lambda: (fill(), comm.all_to_all(x, y))
    return [output], lambda: (fill(), comm.all_to_all(x, y, send_counts=send, recv_counts=recv))


def all_to_all(comm, outputs, inputs):
    """torch's list all_to_all: inputs[j] goes to rank j, outputs[i] comes from rank i (any sizes)."""
    n = comm.world_size
    if len(inputs) != n or len(outputs) != n:
        raise ValueError(f"all_to_all: {len(inputs)} inputs and {len(outputs)} outputs for a group of {n}")
    for t in list(inputs) + list(outputs):
        check_tensor(t, "all_to_all tensor")
        same_kind(inputs[0], t, "all_to_all tensors")
    sflat, x = _stage(inputs, "all_to_all input")
    rflat, y = _stage(outputs, "all_to_all output")
    send = [t.numel() * t.element_size() for t in inputs]
    recv = [t.numel() * t.element_size() for t in outputs]

    def run():
        _pack(inputs, sflat)
        comm.all_to_all(x, y, send_counts=send, recv_counts=recv)
        _unpack(rflat, outputs)
    return list(outputs), run


def all_gather_coalesced(comm, output_lists, inputs):
    """output_lists[r][i] gets rank r's inputs[i]: every input packed into one all_gather."""
    n = comm.world_size
    if len(output_lists) != n:
        raise ValueError(f"all_gather_coalesced: {len(output_lists)} output lists for a group of {n}")
    for outs in output_lists:
        if len(outs) != len(inputs):
            raise ValueError(f"all_gather_coalesced: an output list has {len(outs)} tensors, the input list {len(inputs)}")
        for o, i in zip(outs, inputs):
            _sizes([o], "all_gather_coalesced output", i)
    sflat, x = _stage(inputs, "all_gather_coalesced input")
    rflat = torch.empty(n * sflat.numel(), dtype=torch.uint8)
    y = host_view(rflat, "all_gather_coalesced staging")

    def run():
        _pack(inputs, sflat)
        comm.all_gather(x, y)
        for r, outs in enumerate(output_lists):
            _unpack(rflat[r * sflat.numel():(r + 1) * sflat.numel()], outs)
    return [o for outs in output_lists for o in outs], run


def all_gather_into_tensor_coalesced(comm, outputs, inputs):
    """One all_gather per (output, input) pair, all in one queued call."""
    if len(outputs) != len(inputs):
        raise ValueError(f"all_gather_into_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
    calls = []
    for o, i in zip(outputs, inputs):
        same_kind(i, o, "all_gather_into_tensor_coalesced input and output")
        (x, fill), y = read_view(i, "all_gather input"), host_view(o, "all_gather output")
        calls.append((x, fill, y))
    return list(outputs), lambda: [(fill(), comm.all_gather(x, y)) for x, fill, y in calls]


def sparse_all_reduce(comm, t, op_name: str):
    """A sparse COO SUM as gloo does it: all_gather every rank's nnz, then its indices and
    values (padded to the largest nnz), and coalesce the union; ``t`` takes the result in place."""
    if op_name != "SUM":
        raise NotImplementedError(f"sparse all_reduce: the ringcomm backend sums sparse tensors only (got {op_name})")
    if t.device.type != "cpu":
        check_tensor(t, "sparse all_reduce tensor")
    n = comm.world_size

    def run():
        mine = t.coalesce()
        idx, val = mine.indices().contiguous(), mine.values().contiguous()
        counts = torch.empty(n, dtype=torch.int64)
        comm.all_gather(host_view(torch.tensor([idx.shape[1]]), "nnz"), host_view(counts, "nnz"))
        most = int(counts.max())
        pi = torch.zeros(idx.shape[0], most, dtype=idx.dtype)
        pv = torch.zeros((most,) + tuple(val.shape[1:]), dtype=val.dtype)
        pi[:, :idx.shape[1]], pv[:val.shape[0]] = idx, val
        ai = torch.empty((n,) + tuple(pi.shape), dtype=idx.dtype)
        av = torch.empty((n,) + tuple(pv.shape), dtype=val.dtype)
        comm.all_gather(host_view(pi, "sparse indices"), host_view(ai, "sparse indices"))
        comm.all_gather(host_view(pv, "sparse values"), host_view(av, "sparse values"))
        ind = torch.cat([ai[r, :, :c] for r, c in enumerate(counts.tolist())], dim=1)
        vals = torch.cat([av[r, :c] for r, c in enumerate(counts.tolist())])
        total = torch.sparse_coo_tensor(ind, vals, t.shape).coalesce()
        t.copy_(total)  # a sparse copy_ takes the new indices and values
    return [t], run
