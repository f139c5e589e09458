"""The peers ringcomm is measured against: torch.distributed (gloo on the host, NCCL on GPUs) and MPI.

They are the `bench` extra (`pip install 'ringcomm[bench]'`), imported only here, only in the ranks
of a peer's job. What each library lacks is said, not papered over:
- torch.distributed has no out-of-place all_reduce or reduce: the out-of-place figure is what a torch
  user does instead, a copy into the output followed by the in-place call (its cost is included).
- MPI has no AVG, and mpi4py no bfloat16 datatype; gloo has no uint32 / uint64.
"""
from __future__ import annotations

import os

import numpy as np

from .backends import Backend, Unsupported

EXTRA_HINT = "pip install 'ringcomm[bench]'"


class TorchBackend(Backend):
    """torch.distributed with backend "gloo" (host tensors) or "nccl" (CUDA tensors)."""

    def __init__(self, kind: str):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.name = torch, dist, kind
        self.device = None
        if kind == "nccl":
            if not torch.cuda.is_available():
                raise Unsupported("no CUDA GPU is visible to torch (torch.cuda.is_available() is False)")
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=self.device)
        else:
            dist.init_process_group("gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._bases = []  # (host base array, device mirror) for the nccl backend
        self.ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                    "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
        # torch 2.13 renamed the *_into_tensor / *_tensor calls; take whichever this torch has.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def check(self, collective, dtype, op):
        if self.name == "gloo" and np.dtype(dtype).kind == "u" and np.dtype(dtype).itemsize > 1:
            raise Unsupported(f"gloo has no {np.dtype(dtype)} (torch.distributed's gloo takes uint8 "
                              f"as its only unsigned type)")
        if self.name == "gloo" and op == "avg" and np.dtype(dtype).kind in "iu":
            raise Unsupported("gloo's AVG is defined for floating-point tensors only")

    def register(self, send_buf, recv_buf):
        if self.device is not None:
            self._bases = [(b, self._host_tensor(b).to(self.device)) for b in (send_buf, recv_buf)]

    def _host_tensor(self, arr):
        if arr.dtype.name == "bfloat16":  # numpy's ml_dtypes bfloat16 is not a type torch imports
            return self.torch.from_numpy(arr.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(arr)

    def _t(self, arr):
        """The tensor the library works on for host array ``arr`` (a view, never a copy, on the host)."""
        if self.device is None:
            return self._host_tensor(arr)
        for base, dev in self._bases:
            off = arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            if 0 <= off <= base.nbytes - arr.nbytes:
                return dev[off // arr.itemsize: off // arr.itemsize + arr.size]
        raise ValueError("array is not a view of a registered buffer")

    def upload(self, arr):
        if self.device is not None:
            self._t(arr).copy_(self._host_tensor(arr))

    def download(self, arr):
        if self.device is not None:
            self._host_tensor(arr).copy_(self._t(arr).cpu())
        return arr

    def sync(self):
        if self.device is not None:
            self.torch.cuda.synchronize(self.device)

    def call(self, collective, inp, out, op, root, in_place):
        dist, ti, to = self.dist, self._t(inp), self._t(out)
        red = self.ops.get(op)
        if collective == "all_reduce":
            if in_place:
                return (lambda: dist.all_reduce(to, red)), out
            return (lambda: (to.copy_(ti), dist.all_reduce(to, red))), out
        if collective == "all_gather":
            return (lambda: self._all_gather(to, ti)), out
        if collective == "reduce_scatter":
            return (lambda: self._reduce_scatter(to, ti, red)), out
        if collective == "broadcast":
            buf, arr = (ti, inp) if self.rank == root else (to, out)
            return (lambda: dist.broadcast(buf, src=root)), arr
        if collective == "reduce":
            if in_place:
                return (lambda: dist.reduce(ti, dst=root, op=red)), out
            return (lambda: (to.copy_(ti), dist.reduce(to, dst=root, op=red))), out
        if collective == "sendrecv":
            return self._ring_shift(lambda t, p: dist.send(t, p), lambda t, p: dist.recv(t, p), ti, to), out
        n, mine = self.world_size, self.rank == root
        if collective == "all_to_all":
            return (lambda: dist.all_to_all_single(to, ti)), out
        if collective == "gather":  # torch takes the root's output as a list: views of one buffer
            blocks = list(to.chunk(n)) if mine else None
            return (lambda: dist.gather(ti, gather_list=blocks, dst=root)), out
        if collective == "scatter":
            blocks = list(ti.chunk(n)) if mine else None
            return (lambda: dist.scatter(to, scatter_list=blocks, src=root)), out
        raise ValueError(f"unknown collective {collective!r}")

    def barrier(self):
        self.dist.barrier()

    def gather_f64(self, values):
        t = self.torch.tensor(np.asarray(values, np.float64))
        out = self.torch.empty(t.numel() * self.world_size, dtype=self.torch.float64)
        self._all_gather(out, t)  # CPU tensors: gloo, also inside the nccl job ("cpu:gloo,cuda:nccl")
        return out.numpy().reshape(self.world_size, t.numel())

    def facts(self):
        torch = self.torch
        facts = {"library": f"torch {torch.__version__} ({self.name})", "torch": torch.__version__}
        if self.name == "nccl":
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            facts["gpu"] = torch.cuda.get_device_name(self.device)
            facts["library"] = f"NCCL {facts['nccl']} via torch {torch.__version__}"
        return facts

    def close(self):
        self.dist.destroy_process_group()


class MpiBackend(Backend):
    """mpi4py on MPI_COMM_WORLD (MPICH from the `mpich` wheel, or whatever MPI mpi4py loads)."""

    name = "mpi"

    def __init__(self):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def check(self, collective, dtype, op):
        if np.dtype(dtype).name == "bfloat16":
            raise Unsupported("MPI has no bfloat16 datatype that mpi4py can map")
        if op == "avg" and collective in ("all_reduce", "reduce_scatter", "reduce"):
            raise Unsupported("MPI has no AVG reduction")

    def call(self, collective, inp, out, op, root, in_place):
        c, IN_PLACE, red, me = self.comm, self.MPI.IN_PLACE, self.ops.get(op), self.rank
        if collective == "all_reduce":
            src = IN_PLACE if in_place else inp
            return (lambda: c.Allreduce(src, out, red)), out
        if collective == "all_gather":
            src = IN_PLACE if in_place else inp
            return (lambda: c.Allgather(src, out)), out
        if collective == "reduce_scatter":
            if in_place:  # MPI leaves an in-place result at the start of the buffer, not at block r
                return (lambda: c.Reduce_scatter_block(IN_PLACE, inp, red)), inp[:out.size]
            return (lambda: c.Reduce_scatter_block(inp, out, red)), out
        if collective == "broadcast":
            buf = inp if me == root else out
            return (lambda: c.Bcast(buf, root)), buf
        if collective == "reduce":
            if in_place:
                src, dst = (IN_PLACE, inp) if me == root else (inp, None)
            else:
                src, dst = inp, (out if me == root else None)
            return (lambda: c.Reduce(src, dst, red, root)), out
        if collective == "sendrecv":
            return self._ring_shift(lambda b, p: c.Send(b, p), lambda b, p: c.Recv(b, p), inp, out), out
        if collective == "all_to_all":
            return (lambda: c.Alltoall(inp, out)), out
        if collective == "gather":
            src = IN_PLACE if in_place and me == root else inp
            return (lambda: c.Gather(src, out if me == root else None, root)), out
        if collective == "scatter":
            dst = IN_PLACE if in_place and me == root else out
            return (lambda: c.Scatter(inp if me == root else None, dst, root)), out
        raise ValueError(f"unknown collective {collective!r}")

    def barrier(self):
        self.comm.Barrier()

    def gather_f64(self, values):
        x = np.asarray(values, np.float64)
        out = np.empty(x.size * self.world_size, np.float64)
        self.comm.Allgather(x, out)
        return out.reshape(self.world_size, x.size)

    def facts(self):
        import mpi4py
        lib = self.MPI.Get_library_version().strip().splitlines()[0]
        lib = " ".join(lib.replace("Version:", "").split())
        return {"library": f"{lib} via mpi4py {mpi4py.__version__}", "mpi": lib, "mpi4py": mpi4py.__version__}
