"""CUDA tensors' isend / irecv in the torch backend take the same held batch as CPU ones (ringcomm/torch_p2p.py):
an irecv posted before its matching isend completes, with ProcessGroupNCCL's stream semantics.

Without a GPU, at two levels: what reaches the Communicator -- in what grouping and order, on which stream, after
which events -- with torch.cuda's streams and events replaced by recording fakes; and the batch's device path end
to end, fed numba device arrays under the simulator and the fake runtime (tests/fake_cuda.py).
tests/gpu/test_gpu_torch.py runs batch_isend_irecv on CUDA tensors on a real GPU."""
from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
import ringcomm.torch  # noqa: E402,F401 - registers the backend, installs the CUDA routing
from ringcomm.store import HashStore  # noqa: E402
from ringcomm.torch import ProcessGroupRingcomm  # noqa: E402
from harness import ran_at_once  # noqa: E402


class FakeCuda:
    """torch.cuda's streams, events and device / stream contexts, as a log of what would reach the GPU."""

    def __init__(self):
        self.log, self.n, self.events = [], 0, 0
        self._local = threading.local()         # torch's current stream is per thread
        test = self

        class Event:
            def __init__(self):
                test.events += 1
                self.name = f"ev{test.events}"

            def record(self, stream):
                test.log.append(("record", self.name, stream.name))

            def query(self):            # this stand-in GPU has done whatever was recorded
                return True

        class Stream:
            def __init__(self, dev=None, name=None):
                test.n += 1
                self.name = name or f"side{test.n}"

            def wait_event(self, ev):
                test.log.append(("wait", self.name, ev.name))
        self.Event, self.Stream = Event, Stream

    @property
    def current(self) -> str:
        return getattr(self._local, "current", "caller")

    @current.setter
    def current(self, name: str) -> None:
        self._local.current = name

    def install(self, mp):
        mp.setattr(torch.cuda, "Event", self.Event)
        mp.setattr(torch.cuda, "Stream", self.Stream)
        mp.setattr(torch.cuda, "current_stream", lambda dev=None: self.Stream(name=self.current))
        mp.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
        mp.setattr(torch.cuda, "stream", self.stream)

    @contextlib.contextmanager
    def stream(self, s):
        saved, self.current = self.current, s.name
        try:
            yield
        finally:
            self.current = saved


def cuda_tensor(values, index=0, log=None):
    class CudaLooking(torch.Tensor):
        is_cuda = True
        device = property(lambda self: torch.device("cuda", index))

        def record_stream(self, s):
            log.append(("record_stream", s.name))
    return torch.tensor(values, dtype=torch.float32).as_subclass(CudaLooking)


class Comm:
    """What ProcessGroupRingcomm reads of a Communicator: rank 0 of 2; every call logged, with the stream
    torch's current stream is at that moment (the device path takes it as the caller's)."""

    rank, world_size, timeout = 0, 2, 5.0
    _executor = SimpleNamespace(has_arrived=lambda peer: None)   # no link can tell (Executor.has_arrived)

    def __init__(self, cuda, fail=None):
        self.cuda, self.fail, self._progress = cuda, fail, self

    def submit(self, name, fn):          # the progress thread, run at once: the log shows the queue's order
        return ran_at_once(self.rank, name, fn)

    @contextlib.contextmanager
    def group(self):
        self.cuda.log.append(("group", self.cuda.current))
        yield
        self.cuda.log.append(("end group",))

    def _p2p(self, what, buf, peer):
        kind = "cuda" if getattr(buf, "is_cuda", False) else type(buf).__name__
        self.cuda.log.append((what, kind, peer, self.cuda.current))
        if self.fail == what:
            raise RuntimeError(f"{what} failed")

    def send(self, buf, peer):
        self._p2p("send", buf, peer)

    def recv(self, buf, peer):
        self._p2p("recv", buf, peer)

    def all_reduce(self, buf, op, **kw):
        self.cuda.log.append(("all_reduce", self.cuda.current))

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    return cuda


def _group(cuda, fail=None, store=None):
    pg = ProcessGroupRingcomm(Comm(cuda, fail), None)
    if store is not None:                 # announcements as a torch store would carry them
        from ringcomm.torch_p2p import P2PBatch
        pg._p2p = P2PBatch(pg, store)
    return pg


def test_cuda_and_cpu_p2p_are_held_and_run_as_one_group_on_the_groups_stream(fake):
    """irecv before isend, CUDA and CPU mixed (torch's batch_isend_irecv allows it): nothing reaches the
    Communicator at the calls; waiting starts one comm.group() on the group's stream, which first waits for the
    events recorded on the caller's stream at each CUDA call; Work.wait() makes the waiting stream wait for
    the batch's end event; a collective issued later runs after the batch."""
    pg, log = _group(fake), fake.log
    a, c = cuda_tensor([0.0] * 3, log=log), cuda_tensor([1.0] * 3, log=log)
    works = [pg.recv([a], 1, 0), pg.send([torch.ones(2)], 1, 0), pg.send([c], 1, 0)]
    assert [e for e in log if e[0] in ("group", "send", "recv")] == []           # held
    side = log[1][1]
    assert log == [("record", "ev1", "caller"), ("record_stream", side),
                   ("record", "ev2", "caller"), ("record_stream", side)], log
    del log[:]
    fake.current = "waiter"
    assert works[0].wait()
    assert log[:5] == [("wait", side, "ev1"), ("wait", side, "ev2"), ("group", side),
                       ("recv", "cuda", 1, side), ("send", "ndarray", 1, side)], log
    assert log[5:] == [("send", "cuda", 1, side), ("end group",), ("record", log[7][1], side),
                       ("wait", "waiter", log[7][1])], log
    del log[:]
    assert works[1].wait() and log == []                 # a CPU call's wait orders no stream
    works[2].synchronize()
    assert log == [("wait", "waiter", log[0][2])] and works[2].is_completed() and works[2].get_future().done()
    del log[:]
    late = [pg.send([cuda_tensor([2.0], log=log)], 1, 0), pg.allreduce([cuda_tensor([3.0], log=log)])]
    assert [e[0] for e in log if e[0] in ("group", "send", "all_reduce")] == ["group", "send", "all_reduce"], log
    for work in late:   # completed while the fake CUDA is still installed, not in the next test
        work.wait()


def test_a_cuda_works_future_is_completed_on_the_groups_stream(fake, monkeypatch):
    """torch's CUDA-aware future records its events on the stream current when it is completed, and a
    waiter's stream waits for them (NCCL completes it on NCCL's stream): so the future is completed with
    the group's stream current, the one the call ran on, after its end event."""
    from ringcomm import torch_support
    streams = []
    complete = torch_support.Work._complete
    monkeypatch.setattr(torch_support.Work, "_complete",
                        lambda self: (streams.append((self, fake.current)), complete(self)))
    pg, log = _group(fake), fake.log
    work = pg.allreduce([cuda_tensor([3.0], log=log)])
    fake.current = "waiter"
    assert work.wait() and work.get_future().done() and work.is_completed()
    (end,) = [e for e in log if e[0] == "record" and e[2] != "caller"]
    mine = [current for w, current in streams if w is work]      # (an earlier test's work may complete late)
    assert mine == [end[2]] and end[2] not in ("caller", "waiter"), (streams, log)


def test_a_failed_cuda_batch_raises_from_wait_and_chains_no_stream(fake):
    pg, log = _group(fake, fail="recv"), fake.log
    works = [pg.recv([cuda_tensor([0.0], log=log)], 1, 0), pg.send([cuda_tensor([1.0], log=log)], 1, 0)]
    with pytest.raises(RuntimeError, match="recv failed"):
        works[1].wait()
    assert isinstance(works[0].exception(), RuntimeError) and not works[0].is_success()
    with pytest.raises(RuntimeError, match="recv failed"):
        works[0].get_future().wait()
    assert not [e for e in log if e[0] == "record" and e[2] != "caller"], log   # no end event after a failure
    assert not [e for e in log if e[0] == "wait" and e[1] == "caller"], log


def test_cuda_recv_from_any_source_and_tags_as_on_the_host(fake):
    """An any-source irecv posted before the batch's isend: the sends announce themselves first, so the
    receive never waits for its peer's announcement behind the peer's own such receive. An announcement
    names the sender, the tag, the bytes and the kind of memory (c: CUDA). Without announcements it is refused as on the host; a second GPU in one batch is refused."""
    store = HashStore(timeout=2.0)
    store.add("anysrc/0/count", 1)
    store.set("anysrc/0/1", b"1 7 4 c")           # rank 1 announced a message to us: tag 7, 4 bytes, CUDA
    pg, log = _group(fake, store=store), fake.log
    w = pg.recv_anysource([cuda_tensor([0.0], log=log)], 7)
    pg.send([cuda_tensor([1.0], log=log)], 1, 7)
    assert w._source_rank() == 1
    assert [e[:3] for e in log if e[0] in ("send", "recv")] == [("recv", "cuda", 1), ("send", "cuda", 1)], log
    assert store.get("anysrc/1/1", timeout=1.0) == b"0 7 4 c"               # our send's announcement
    with pytest.raises(NotImplementedError, match="any source"):
        _group(fake).recv_anysource([cuda_tensor([0.0], log=log)], 0)
    pg.send([cuda_tensor([1.0], log=log)], 1, 0)
    with pytest.raises(ValueError, match="cuda:1 while this group holds point-to-point calls on cuda:0"):
        pg.recv([cuda_tensor([0.0], index=1, log=log)], 1, 0)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        pg.send([cuda_tensor([1.0], log=log)], 0, 0)


@pytest.mark.timeout(180)
def test_the_batch_on_device_arrays_completes_an_irecv_first_ring_shift_under_the_simulator(monkeypatch):
    """The batch's device path end to end: 3 ranks, each posts its irecvs (a device message 10x the device
    FIFO and a host one) before its isends; the fake GPU lags the host."""
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]' (the test extra has it)")
    import torch_p2p_device_work as work
    from harness import World
    env = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "1024", "RINGCOMM_NSLOTS": "4"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with World(3, env, timeout=30) as w:
        w.run(work.install, 0.002)
        assert w.run(work.ring_shift_irecv_first, 2560, timeout=120) == [[]] * 3
