"""The ibverbs transport: slot FIFOs over RC queue pairs, its failure modes, and collectives over it.

Everything marked ``rdma`` needs pyverbs and an active RDMA port; without them it is skipped with
the reason. No machine here has an RDMA NIC: .ci/run runs these tests inside a QEMU guest with
Soft-RoCE (../shared/rdma/run-in-rxe-guest.sh, see tests/rdma_guest.sh). On a host with a real NIC,
`pytest -m rdma` runs them directly.
"""
from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest

from ringcomm.store import HashStore
from ringcomm.transport.base import Aborted, LinkContext, PeerGone, PeerTimeout
from ringcomm.transport import ibverbs, verbs
import jobs
from link_helpers import pattern, recv, run_threads, send
from link_helpers import soon as _soon

WHY_NOT = ibverbs.unavailable()


def rdma(test):
    """Marks a test ``rdma`` and skips it, saying why, where pyverbs or an active RDMA port is missing."""
    test = pytest.mark.skipif(WHY_NOT is not None, reason=f"no RDMA here: {WHY_NOT}")(test)
    return pytest.mark.rdma(test)


SLOT = 16 * 1024


def soon(seconds: float = 10.0) -> float:  # emulated RDMA is slow: a longer default
    return _soon(seconds)


@pytest.fixture
def transports():
    """Ranks of one world in this process, each with its own device context; all closed at the end."""
    made = []

    def factory(rank, store, *, world_size=2, nslots=4, slot_bytes=SLOT, **kw):
        ctx = LinkContext(rank=rank, world_size=world_size, store=store, prefix="ib", token="t",
                          nslots=nslots, slot_bytes=slot_bytes, **kw)
        t = ibverbs.IbverbsTransport(ctx)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()


@pytest.fixture
def links(transports):
    """(t0, t1, s01, r01, s10, r10): sXY sends from rank X to rank Y, rXY receives it at Y."""
    store = HashStore(timeout=10)
    t0, t1 = transports(0, store), transports(1, store)
    s01, s10 = t0.connect_send(1, soon()), t1.connect_send(0, soon())  # never waits for the peer
    r01, r10 = t1.connect_recv(0, soon()), t0.connect_recv(1, soon())
    return t0, t1, s01, r01, s10, r10


# ---- without a device (runs on every machine that has none) ---------------------------------


@pytest.mark.timeout(30)
@pytest.mark.skipif(WHY_NOT is None, reason="an RDMA device is present: the no-device errors cannot show")
def test_forced_ibverbs_without_a_device_fails_clearly(monkeypatch):
    import ringcomm
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "ibverbs")
    with pytest.raises(ringcomm.RingcommError, match=r"RINGCOMM_TRANSPORT=ibverbs.*(pyverbs|RDMA)") as e:
        ringcomm.init(0, 2, store=HashStore(timeout=5), timeout=5)
    assert WHY_NOT in str(e.value)
    with pytest.raises((ImportError, LookupError), match=r"ringcomm\[rdma\]|python3-pyverbs|RDMA"):
        ibverbs.IbverbsTransport(LinkContext(rank=0, world_size=2, store=HashStore(), prefix="x"))


@pytest.mark.timeout(10)
def test_hca_and_gid_selection_follow_nccl_syntax(monkeypatch):
    cases = {"": ("mlx5_0", (True, None)), "mlx5": ("mlx5_1", (True, None)),
             "mlx5_0:2,rxe0": ("mlx5_0", (True, 2)), "=mlx5": ("mlx5_0", (False, None)),
             "^mlx5_1": ("mlx5_1", (False, None)), "^mlx5_1,": ("rxe0", (True, None))}
    for spec, (name, want) in cases.items():
        monkeypatch.setenv("RINGCOMM_IB_HCA", spec)
        assert verbs.hca_filter(name) == want, spec
    monkeypatch.setenv("RINGCOMM_IB_GID_INDEX", "3")
    assert verbs.gid_index("nodev", 1, is_ib=False) == 3
    monkeypatch.setenv("RINGCOMM_IB_GID_INDEX", "x")
    with pytest.raises(ValueError, match="RINGCOMM_IB_GID_INDEX='x' is not an integer"):
        verbs.gid_index("nodev", 1, is_ib=False)
    monkeypatch.delenv("RINGCOMM_IB_GID_INDEX")
    assert verbs.gid_index("nodev", 1, is_ib=True) == 0


# ---- conformance over a real verbs stack ------------------------------------------------------


@rdma
@pytest.mark.timeout(120)
@pytest.mark.parametrize("slot_bytes, nslots, count", [(SLOT, 4, 40), (1 << 20, 2, 6)])
def test_both_directions_at_once_many_slices(transports, slot_bytes, nslots, count):
    # Each rank posts a slice, then waits for the peer's, as a ring step does; many more slices
    # than slots, so credits must flow back; sizes 0, 1, slot - 1 and full slots.
    store = HashStore(timeout=10)
    t0, t1 = (transports(r, store, slot_bytes=slot_bytes, nslots=nslots) for r in (0, 1))
    s01, s10 = t0.connect_send(1, soon()), t1.connect_send(0, soon())
    r01, r10 = t1.connect_recv(0, soon()), t0.connect_recv(1, soon())
    sizes = [slot_bytes, 0, 1, slot_bytes - 1, *[slot_bytes] * (count - 4)]

    def rank(me, out, inp):
        for i, n in enumerate(sizes):
            send(out, pattern(me, i, n), soon(30))
            got = inp.wait(soon(30))
            assert got.size == n and np.array_equal(got, pattern(1 - me, i, n)), f"slice {i}"
            inp.release()

    run_threads(lambda: rank(0, s01, r10), lambda: rank(1, s10, r01), timeout=60.0)
    assert (s01.transport, r01.transport) == ("ibverbs", "ibverbs")


@rdma
@pytest.mark.timeout(60)
def test_sender_runs_ahead_then_waits_for_credit(links):
    _, _, s01, r01, _, _ = links
    for i in range(4):  # nslots slices with nobody reading: the remote slots fill
        send(s01, pattern(0, i, SLOT), soon())
    with pytest.raises(PeerTimeout, match=r"rank 0 \(this process\) timed out waiting for a free slot "
                                          r"to send to rank 1 over ibverbs") as e:
        s01.acquire(soon(1.2))  # long enough for liveness probes, which a live peer acknowledges
    assert (e.value.peer, e.value.transport) == (1, "ibverbs")
    np.testing.assert_array_equal(recv(r01, soon()), pattern(0, 0, SLOT))  # one credit back
    send(s01, pattern(0, 4, SLOT), soon())
    for i in range(1, 5):
        np.testing.assert_array_equal(recv(r01, soon()), pattern(0, i, SLOT))
    with pytest.raises(PeerTimeout):
        r01.wait(soon(1.2))  # the receiver probes too
    assert s01.error is None and r01.error is None
    send(s01, pattern(0, 5, 10), soon())
    np.testing.assert_array_equal(recv(r01, soon()), pattern(0, 5, 10))


@rdma
@pytest.mark.timeout(60)
def test_api_misuse_is_explained_and_several_slots_are_held_in_order(links):
    _, _, s01, r01, _, _ = links
    with pytest.raises(RuntimeError, match="without a slot"):
        s01.post(1)
    a, b = s01.acquire(soon()), s01.acquire(soon())  # two held at once (the device proxy does this)
    assert a.ctypes.data != b.ctypes.data
    a[:3], b[:3] = 1, 2
    with pytest.raises(ValueError, match=f"0..{SLOT}"):
        s01.post(SLOT + 1)
    s01.post(3)  # the oldest held slot goes first
    s01.post(3)
    first, second = r01.wait(soon()), r01.wait(soon())
    assert list(first) == [1, 1, 1] and list(second) == [2, 2, 2]
    r01.release()
    r01.release()
    with pytest.raises(RuntimeError, match="without a slot"):
        r01.release()


@rdma
@pytest.mark.timeout(60)
def test_deadlines_and_abort(links, transports):
    _, _, _, r01, _, _ = links
    with pytest.raises(PeerTimeout, match=r"rank 1 .*timed out waiting for data from rank 0 over ibverbs"):
        r01.wait(soon(0.2))
    lonely = transports(0, HashStore(), world_size=3)
    lonely.connect_send(2, soon())  # returns at once: it never waits for the peer
    with pytest.raises(PeerTimeout, match="rank 2 to publish its ibverbs queue pair"):
        lonely.connect_recv(2, soon(0.2))
    abort = threading.Event()
    store = HashStore(timeout=10)
    a0, a1 = transports(0, store, abort=abort), transports(1, store, abort=abort)
    a0.connect_send(1, soon())
    ra = a1.connect_recv(0, soon())
    caught = []
    waiter = threading.Thread(target=lambda: caught.append(pytest.raises(Aborted, ra.wait, soon(60))))
    waiter.start()
    abort.set()
    waiter.join(10)
    assert len(caught) == 1 and "abort" in str(caught[0].value)


@rdma
@pytest.mark.timeout(60)
def test_peer_closing_gives_peer_gone_after_its_data(links):
    t0, t1, s01, r01, s10, r10 = links
    for i in range(3):
        send(s10, pattern(1, i, 1000), soon())
    t1.close()  # lets those three slices be acknowledged, then announces the close
    t1.close()
    for i in range(3):
        np.testing.assert_array_equal(recv(r10, soon()), pattern(1, i, 1000))
    with pytest.raises(PeerGone, match=r"rank 1 closed its end of the ibverbs link to rank 0") as e:
        r10.wait(soon())
    assert e.value.peer == 1
    with pytest.raises(PeerGone, match=r"rank 1 closed its end of the ibverbs link from rank 0"):
        for i in range(10):
            send(s01, pattern(0, i, 10), soon())
    with pytest.raises(Aborted, match="closed by this process"):
        s10.acquire(soon())


@rdma
@pytest.mark.timeout(60)
def test_closing_before_any_slice_is_announced_both_ways(transports):
    # Neither end has moved a byte: the sender's QP is not even up yet. Each still learns of the
    # other's close (a CLOSE write after bringing the QP up; a note in the store) instead of a timeout.
    store = HashStore(timeout=10)
    t0, t1 = transports(0, store), transports(1, store)
    s01, _ = t0.connect_send(1, soon()), t1.connect_send(0, soon())
    _, r10 = t1.connect_recv(0, soon()), t0.connect_recv(1, soon())
    t1.close()
    with pytest.raises(PeerGone, match="rank 1 closed its end of the ibverbs link to rank 0"):
        r10.wait(soon())
    with pytest.raises(PeerGone, match="rank 1 closed its end of the ibverbs link from rank 0"):
        s01.acquire(soon())


@rdma
@pytest.mark.timeout(60)
def test_dead_peer_becomes_peer_gone_naming_both_ranks(transports, monkeypatch):
    # A crash sends no close notice: the QP just vanishes. The waiter's liveness probe is never
    # acknowledged; with a short ack timeout (4.096 us * 2^14 = 67 ms, 6 retries) that is quick.
    monkeypatch.setenv("RINGCOMM_IB_TIMEOUT", "14")
    store = HashStore(timeout=10)
    t0, t1 = transports(0, store), transports(1, store)
    s01, s10 = t0.connect_send(1, soon()), t1.connect_send(0, soon())
    r01, r10 = t1.connect_recv(0, soon()), t0.connect_recv(1, soon())
    send(s10, pattern(1, 0, 100), soon())
    np.testing.assert_array_equal(recv(r10, soon()), pattern(1, 0, 100))
    for link in (s10, r01):
        link._destroy()  # what the kernel does to a killed process's QPs
    started = time.monotonic()
    with pytest.raises(PeerGone, match=r"between rank 0 \(this process\) and rank 1 over ibverbs failed: "
                                       r".*status 12 \(transport retry counter exceeded"):
        r10.wait(soon(30))
    with pytest.raises(PeerGone, match="rank 0 .* and rank 1 over ibverbs"):
        for i in range(100):
            send(s01, pattern(0, i, SLOT), soon(30))
    assert time.monotonic() - started < 20


@rdma
@pytest.mark.timeout(60)
def test_mismatched_fifo_settings_are_explained(transports):
    store = HashStore(timeout=10)
    t0, t1 = transports(0, store, nslots=4), transports(1, store, nslots=2)
    s01 = t0.connect_send(1, soon())
    t1.connect_recv(0, soon())
    with pytest.raises(PeerGone, match="RINGCOMM_BUFFSIZE and RINGCOMM_NSLOTS alike"):
        s01.acquire(soon())


@rdma
@pytest.mark.timeout(60)
def test_close_is_idempotent_and_releases_fds(transports):
    store = HashStore(timeout=10)
    ctx = dict(world_size=2, store=store, prefix="fd", token="t", nslots=4, slot_bytes=SLOT)
    fds = len(os.listdir("/proc/self/fd"))
    t0 = ibverbs.IbverbsTransport(LinkContext(rank=0, **ctx))
    t1 = ibverbs.IbverbsTransport(LinkContext(rank=1, **ctx))
    try:
        s01, r01 = t0.connect_send(1, soon()), t1.connect_recv(0, soon())
        send(s01, pattern(0, 0, 100), soon())
        recv(r01, soon())
    finally:
        t0.close()
        t1.close()
    t0.close()
    with pytest.raises(Aborted, match="closed"):
        t0.connect_send(1, soon())
    assert len(os.listdir("/proc/self/fd")) == fds


# ---- collectives over ibverbs -----------------------------------------------------------------

# 4 KiB slots: 1000 float32 fill one, 50_003 float64 cross about a hundred, in several rounds.
IB_WORLD = {"RINGCOMM_TRANSPORT": "ibverbs", "RINGCOMM_BUFFSIZE": "16384", "RINGCOMM_NSLOTS": "4"}


def _cases(n: int) -> list[dict]:
    cases, i = [], 0
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for dtype, op, count in (("float32", "sum", 1000), ("int64", "max", 7), ("float64", "sum", 50_003),
                                 ("uint8", "min", 12_345), ("int32", "prod", 1)):
            algo = (None, "ring", "tree")[i % 3] if coll in ("all_reduce", "broadcast") else "ring"
            cases.append(dict(collective=coll, dtype=dtype, op=op, count=count, algo=algo,
                              root=(0, n - 1)[i % 2], inplace=bool(i % 2), seed=i))
            i += 1
    return cases


def _over_ibverbs(comm):
    from cases import run_cases
    kinds = {comm.transport_to(p) for p in range(comm.world_size) if p != comm.rank}
    return kinds, run_cases(comm, _cases(comm.world_size))


@rdma
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_over_ibverbs(n):
    from harness import World
    with World(n, IB_WORLD, timeout=120) as w:
        results = w.run(_over_ibverbs, timeout=240)
    assert [kinds for kinds, _ in results] == [{"ibverbs"}] * n
    assert [errs for _, errs in results] == [[]] * n, "\n".join(e for _, errs in results for e in errs)


@rdma
@pytest.mark.timeout(180)
def test_killed_rank_is_reported_not_a_hang(tmp_path):
    # Ranks 0 and 2 are rank 1's ring neighbours: one writes to its vanished QP, the other waits
    # for it and probes. Both must report rank 1 over ibverbs; the default ack timeout and retry
    # count (18: ~1.07 s, 6 retries: ~7.5 s) bound how long that takes.
    n, victim = 3, 1
    env = dict(os.environ, RINGCOMM_TIMEOUT="60", PID_DIR=str(tmp_path), RINGCOMM_TRANSPORT="ibverbs",
               COUNT=str(1 << 16), RINGCOMM_JOB_ID=f"ibkill{os.getpid()}")
    proc = jobs.launch(n, env)
    with jobs.running([proc]):
        jobs.wait_for_ranks(tmp_path, range(n), [proc], timeout=90)
        jobs.kill_rank(tmp_path, victim)
        (out,), elapsed = jobs.finish([proc], timeout=100)
    assert proc.returncode != 0
    assert elapsed < 45, f"the job took {elapsed:.1f} s to end:\n{out}"
    errors = jobs.survivor_errors(out, set(range(n)) - {victim})
    for r, line in errors.items():
        # A survivor may see the victim's QP fail, or its other neighbour leave because of it.
        assert re.search(rf"rank {r} \(this process\).* all_reduce #\d+ .*rank \d over ibverbs", line), line
    lines = list(errors.values())
    assert any(f"rank {victim} over ibverbs" in x and "retry counter exceeded" in x for x in lines), out
    assert f"rank {victim} failed first (killed by SIGKILL)" in out
    print(f"survivors reported the kill {elapsed:.1f} s after it:\n{out}")
