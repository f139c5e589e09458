"""What only the ibverbs transport has: device selection, its close and crash notices, collectives over it.
The contract every transport shares is tests/test_conformance.py's (its ibverbs cases carry ``rdma``).

Everything marked ``rdma`` needs pyverbs and an active RDMA port; without them it is skipped with
the reason. No machine here has an RDMA NIC: .ci/run runs these tests inside a QEMU guest with
Soft-RoCE (../shared/rdma/run-in-rxe-guest.sh, see .ci/rdma-guest). On a host with a real NIC,
`pytest -m rdma` runs them directly.
"""
from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from ringcomm.store import HashStore
from ringcomm.transport.base import LinkContext, PeerGone
from ringcomm.transport import ibverbs, verbs
import jobs
from link_helpers import pattern, recv, send
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
             "^mlx5_1": ("mlx5_1", (False, None)), "^mlx5_1,": ("rxe0", (True, None)),
             "^mlx5_1:1": ("mlx5_1", (True, None)), "^=mlx5_1:2,mlx5_1": ("mlx5_1", (False, None))}
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
    monkeypatch.setenv("RINGCOMM_IB_GID_INDEX", "-1")          # automatic, as NCCL_IB_GID_INDEX=-1
    assert verbs.gid_index("nodev", 1, is_ib=True) == 0 and verbs.gid_index("nodev", 1, is_ib=False) == 0


class _FakeVerbs:
    """pyverbs' device list, contexts and port states, enough for verbs.find_device."""

    def __init__(self, ports: dict):  # device name -> {port: active?}
        from types import SimpleNamespace as NS
        fake = self

        class Context:
            def __init__(self, name):
                self.name = name

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def query_device(self):
                return NS(phys_port_cnt=len(ports[self.name]))

            def query_port(self, p):
                return NS(state=fake.ACTIVE if ports[self.name][p] else 0)

        self.ACTIVE = 4
        self.e = NS(IBV_PORT_ACTIVE=self.ACTIVE)
        self.device = NS(get_device_list=lambda: [NS(name=n.encode()) for n in ports],
                         Context=lambda name: Context(name))


@pytest.mark.timeout(10)
def test_hca_port_excludes_pick_the_next_port_or_say_why(monkeypatch):
    """NCCL_IB_HCA's "^dev:port" leaves the device's other ports usable; "^dev" the whole device."""
    monkeypatch.delenv("RINGCOMM_IB_PORT", raising=False)
    monkeypatch.setattr(verbs, "pyverbs", lambda: _FakeVerbs({"mlx5_0": {1: True, 2: True}, "rxe0": {1: True}}))
    for spec, want in (("", ("mlx5_0", 1)), ("^mlx5_0:1", ("mlx5_0", 2)), ("^mlx5_0:1,mlx5_0:2", ("rxe0", 1)),
                       ("^mlx5_0", ("rxe0", 1)), ("mlx5_0:2", ("mlx5_0", 2))):
        monkeypatch.setenv("RINGCOMM_IB_HCA", spec)
        assert verbs.find_device() == want, spec
    monkeypatch.setenv("RINGCOMM_IB_HCA", "^mlx5_0:1,rxe")
    monkeypatch.setattr(verbs, "pyverbs", lambda: _FakeVerbs({"mlx5_0": {1: True, 2: False}, "rxe0": {1: True}}))
    with pytest.raises(LookupError, match=r"mlx5_0 port 1 \(excluded by RINGCOMM_IB_HCA\), mlx5_0 port 2 "
                                          r"\(not active\), rxe0 \(not selected"):
        verbs.find_device()
    monkeypatch.setenv("RINGCOMM_IB_HCA", "mlx5_0:x")
    with pytest.raises(ValueError, match="port after ':' must be a number"):
        verbs.find_device()


@pytest.mark.timeout(10)
def test_ib_settings_out_of_range_are_errors_not_another_transport(monkeypatch):
    """A RINGCOMM_IB_* setting that cannot be right is a ValueError naming it, before any device is
    looked for: not a reason to fall back to tcp, nor a verbs error at the first collective."""
    for name, bad in (("RINGCOMM_IB_TIMEOUT", "0"), ("RINGCOMM_IB_TIMEOUT", "32"), ("RINGCOMM_IB_RETRY_CNT", "9"),
                      ("RINGCOMM_IB_PORT", "0"), ("RINGCOMM_IB_GID_INDEX", "-2")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}={bad} is out of range"):
            verbs.unavailable()
        monkeypatch.delenv(name)
    monkeypatch.setenv("RINGCOMM_IB_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="RINGCOMM_IB_TIMEOUT='abc' is not an integer"):
        verbs.unavailable()


@pytest.mark.timeout(30)
@pytest.mark.skipif(WHY_NOT is None, reason="an RDMA device is present: the no-device error cannot show")
def test_forced_ibverbs_fails_at_init_in_a_world_of_one_too(monkeypatch):
    import ringcomm
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "ibverbs")
    with pytest.raises(ringcomm.RingcommError, match=r"RINGCOMM_TRANSPORT=ibverbs, but rank 0 \(this process\)"):
        ringcomm.init(0, 1, store=HashStore(timeout=5), timeout=5)


@pytest.mark.timeout(30)
def test_a_transport_librarys_own_error_at_connect_becomes_a_ringcomm_error(monkeypatch):
    """pyverbs raises its own PyverbsRDMAError (a QP that does not reach RTR, say): the connect error
    is a RingcommError naming both ranks, the call and the transport, with the library's error."""
    import ringcomm
    from ringcomm import links

    class PyverbsRDMAError(Exception):
        pass

    class Refusing:
        def connect_send(self, peer, deadline):
            raise PyverbsRDMAError("Failed to modify QP state to RTR. Errno: 110, Connection timed out")
        connect_recv = connect_send

        def close(self):
            pass

    monkeypatch.setattr(links, "_make_transport", lambda name, ctx: Refusing())
    with ringcomm.init(0, 1, store=HashStore(timeout=5), timeout=5) as comm:
        with pytest.raises(ringcomm.RingcommError, match=r"rank 0 \(this process\) could not connect to rank 1 "
                           r"\(send\) over tcp: PyverbsRDMAError: Failed to modify QP state to RTR"):
            comm._links._connect(1, "send", "tcp")


# ---- over a real verbs stack -------------------------------------------------------------------


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


# ---- collectives over ibverbs -----------------------------------------------------------------

# 4 KiB slots: 1000 float32 fill one, 20_003 float64 cross about forty, ten rounds of the 4 slots.
IB_WORLD = {"RINGCOMM_TRANSPORT": "ibverbs", "RINGCOMM_BUFFSIZE": "16384", "RINGCOMM_NSLOTS": "4"}


def _cases(n: int) -> list[dict]:
    cases, i = [], 0
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for dtype, op, count in (("float32", "sum", 1000), ("int64", "max", 7), ("float64", "sum", 20_003),
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
def test_a_rank_killed_before_it_wrote_is_reported_not_waited_out(tmp_path):
    """Rank 1 is killed after init, before any collective: it never published a queue pair nor wrote
    on a link. Its neighbours' waits (rank 0 for rank 1's queue pair, rank 2 for its first slice)
    cannot probe a QP; the roster's liveness names it long before the 60 s timeout."""
    n, victim = 3, 1
    env = dict(os.environ, RINGCOMM_TIMEOUT="60", PID_DIR=str(tmp_path), RINGCOMM_TRANSPORT="ibverbs",
               RINGCOMM_JOB_ID=f"ibpre{os.getpid()}")
    proc = jobs.launch(n, env, script=os.path.join(os.path.dirname(__file__), "scripts", "broadcast_after_go.py"))
    with jobs.running([proc]):
        jobs.wait_for_ranks(tmp_path, range(n), [proc], timeout=90)
        jobs.kill_rank(tmp_path, victim)
        (tmp_path / "go").write_text("")
        (out,), elapsed = jobs.finish([proc], timeout=100)
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end:\n{out}"
    errors = jobs.survivor_errors(out, set(range(n)) - {victim})
    assert any(re.search(rf"rank {victim} \(pid \d+\) died", line) for line in errors.values()), out


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
    # The victim's QP stops answering (retries run out, status 12), or its memory goes first: the
    # kernel drops a dead process's registrations and QPs one by one, and a write that lands between
    # the two is refused (status 10; seen once, with the guest's CPUs starved by a busy host). Both
    # explanations say the process may have died.
    assert any(f"rank {victim} over ibverbs" in x and re.search(r"status 1[02] \(.*its process died", x)
               for x in lines), out
    assert f"rank {victim} failed first (killed by SIGKILL)" in out
    print(f"survivors reported the kill {elapsed:.1f} s after it:\n{out}")
