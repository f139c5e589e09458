"""Device slices to and from a peer on another host: staged through the network connection's host slots.

A device call whose peer is reached over tcp or ibverbs uses that transport's own connection (made with the
device path's slot size, under a prefix of its own) and lets the GPU reach its slots directly: each slot's
host memory is registered with cudaHostRegister (portable, mapped) once, so kernels and copies on our stream
write the outgoing slot and read the incoming one over PCIe, without a staging copy. What the network needs
is that the bytes are in host memory before the host posts them, and that our kernels are done reading a
slot before the host gives it back: post() and release() poll our stream idle first (never blocking in CUDA,
within the wait's deadline and aborted by abort()).

That poll is the host waiting for the GPU in the caller's thread, once per slice: correct, but on a GPU it
serialises the host and the GPU per slice. NCCL's answer, a per-communicator proxy thread that posts a slice
when its event completes while the caller's thread queues the next, is not built yet (issue 11, point 5).
GPUDirect RDMA (registering device memory with the NIC) is not attempted: the slots are host memory.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from . import cuda_rt
from .base import PeerTimeout


class _Staged:
    def __init__(self, conn, rt, name: str):
        self.conn, self.rt, self.stream = conn, rt, 0
        self.peer, self.slot_bytes, self.transport = conn.peer, conn.slot_bytes, name
        self.deadline = 0.0
        self.views: dict = {}        # host slot address -> its device view (registered once)
        self.typed_views: dict = {}  # (address, dtype) -> typed view
        self.current = None          # the host slot in hand

    def _hold(self, data) -> None:
        """Make the host slot starting where ``data`` starts (tcp's and ibverbs' slots are ``slot_bytes``
        each, a payload starts at its slot's start) the one in hand; registered and viewed once."""
        at = data.__array_interface__["data"][0]
        if at not in self.views:
            host = np.frombuffer((ctypes.c_uint8 * self.slot_bytes).from_address(at), np.uint8)
            self.views[at] = (host, self.rt.view(self.rt.host_register(host), self.slot_bytes, host))
        self.current = at

    def typed(self, dtype, k: int):
        key = (self.current, dtype)
        view = self.typed_views.get(key)
        if view is None:
            slot = self.views[self.current][1]
            view = self.typed_views[key] = slot[: slot.size // dtype.itemsize * dtype.itemsize].view(dtype)
        return view[:k]

    def _gpu_done(self, why: str) -> None:
        abort = getattr(getattr(self.conn, "ctx", None), "abort", None)
        if not cuda_rt.drain(self.rt, self.stream, max(self.deadline, time.monotonic() + 1.0), abort=abort):
            raise PeerTimeout(f"this rank's GPU stream did not finish {why} for rank {self.peer} in time",
                              peer=self.peer, transport=self.transport)

    def close(self) -> None:
        self.conn.close()
        if cuda_rt.drain(self.rt, self.stream, time.monotonic() + 1.0):     # unpin only what nothing reads
            for slot, _ in self.views.values():
                try:
                    self.rt.host_unregister(slot)
                except cuda_rt.CudaError:
                    pass
        self.views.clear()
        self.typed_views.clear()


class StagedSend(_Staged):
    def acquire(self, deadline: float):
        self.deadline = deadline
        slot = self.conn.acquire(deadline)
        self._hold(slot)
        return self.views[self.current][1]

    def post(self, nbytes: int) -> None:
        self._gpu_done("writing a slot")      # the bytes must be in host memory before they go out
        self.conn.post(nbytes)


class StagedRecv(_Staged):
    def wait(self, deadline: float):
        self.deadline = deadline
        data = self.conn.wait(deadline)
        self._hold(data)
        return data                            # its size is checked; typed() gives the device view

    def release(self) -> None:
        self._gpu_done("reading a slot")       # our kernels must be done before the slot is reused
        self.conn.release()


def staged(conn, direction: str, name: str):
    rt = cuda_rt.get()
    return (StagedSend if direction == "send" else StagedRecv)(conn, rt, name)
