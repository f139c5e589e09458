"""reproducible=True across real rank processes: the same bits for every rank order, algorithm, slot
setting, and for a larger world whose extra ranks give zeros; reduce_scatter's blocks and reduce's root
output equal all_reduce's bits. The bits are checked against the kernels' passes simulated in this
process (tests/exact.py), which tests/test_reproducible_kernels.py checks against exact rational sums."""
from __future__ import annotations

import numpy as np
import pytest

import ringcomm
from exact import BF16, bits, simulated
from harness import World
from ringcomm import reproducible as repro

DTYPES = (np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64))
ALL_REDUCE = (None, "ring", "tree", "rabenseifner", "oneshot")
C = 251                     # elements per reduce_scatter block: a prime, so slices never line up


def inputs(dt, n, seed):
    """n ranks' inputs of n * C elements: magnitudes over 24 binades, both signs, a few zeros."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, n * C)) * np.exp2(rng.integers(-12, 12, (n, n * C)).astype(float))
    xs[rng.random(xs.shape) < 0.05] = 0.0
    return [x.astype(dt) for x in xs]


def every_call(comm, xs):
    """This rank's results of every reproducible call on xs[rank] (the same multiset on every rank
    order the test chooses): {name: bit pattern}; reduce results only on its root."""
    x = xs[comm.rank]
    got = {}
    for algo in ALL_REDUCE:
        y = x.copy()                                        # in place
        comm.all_reduce(y, "sum", algo=algo, reproducible=True)
        got[f"all_reduce {algo}"] = y
    got["all_reduce avg"] = comm.all_reduce(x, "avg", out=np.empty_like(x), reproducible=True)
    c = x.size // comm.world_size
    for algo in ("ring", "halving"):
        if algo == "halving" and comm.world_size & (comm.world_size - 1):
            continue                                        # halving needs a power-of-two world
        out = np.empty(c, x.dtype)
        comm.reduce_scatter(x, out, algo=algo, reproducible=True)
        got[f"reduce_scatter {algo}"] = out
    y = x.copy()                                            # in place: buf's own block
    comm.reduce_scatter(y, y[comm.rank * c:(comm.rank + 1) * c], reproducible=True)
    got["reduce_scatter in place"] = y[comm.rank * c:(comm.rank + 1) * c]
    for algo, root in (("ring", 0), ("tree", comm.world_size - 1), ("binomial", 1)):
        out = np.zeros_like(x)
        comm.reduce(x, root, out=out, algo=algo, reproducible=True)
        if comm.rank == root:
            got[f"reduce {algo}"] = out
    return {k: bits(v).copy() for k, v in got.items()}


def check_world(results, want, avg, n_real):
    c = want.size // n_real
    for rank, got in enumerate(results):
        for name, b in got.items():
            if name == "all_reduce avg":
                assert np.array_equal(b, avg), (rank, name)
            elif name.startswith("reduce_scatter"):
                if rank < n_real:     # blocks of a padded world's extra ranks hold other elements
                    assert np.array_equal(b, want[rank * c:(rank + 1) * c]), (rank, name)
            else:
                assert np.array_equal(b, want[:b.size]), (rank, name)


def avg_of(total, n):
    from ringcomm.kernels import host
    return bits(host.postprocess(total.copy(), "avg", n)).copy()


@pytest.mark.timeout(400)
def test_same_bits_for_rank_orders_algorithms_and_slot_settings():
    n = 3
    cases = [(dt, inputs(dt, n, seed=10 + i)) for i, dt in enumerate(DTYPES)]
    small = {"RINGCOMM_BUFFSIZE": "2048", "RINGCOMM_NSLOTS": "4"}       # many slices and rounds
    with World(n, small, timeout=120) as w:
        for dt, xs in cases:
            total = simulated(xs)
            want, avg = bits(total).copy(), avg_of(total, n)
            for perm in ([0, 1, 2], [2, 0, 1]):                       # which rank holds which input
                check_world(w.run(every_call, [xs[p] for p in perm], timeout=300), want, avg, n)


@pytest.mark.timeout(400)
def test_zero_padded_world_and_other_slots_give_the_same_bits():
    # The 3 inputs of a world of 3, held by ranks 3, 1, 2 of a world of 4 whose rank 0 gives zeros
    # (4: a power of two, so halving and Rabenseifner's exchange run too).
    xs3 = [x[:3 * C] for x in inputs(np.dtype(np.float32), 3, seed=12)]
    xs4 = [np.zeros_like(xs3[0]), xs3[1], xs3[2], xs3[0]]
    want = bits(simulated(xs3)).copy()
    other = {"RINGCOMM_BUFFSIZE": "8192", "RINGCOMM_NSLOTS": "2"}
    with World(4, other, timeout=120) as w:
        results = w.run(every_call, [np.concatenate([x, x[:C]]) for x in xs4], timeout=300)
    for rank, got in enumerate(results):
        assert "reduce_scatter halving" in got
        for name, b in got.items():
            if name.startswith(("all_reduce ", "reduce ")) and "avg" not in name:
                assert np.array_equal(b[:3 * C], want), (rank, name)
            elif name.startswith("reduce_scatter") and rank < 3:
                assert np.array_equal(b, want[rank * C:(rank + 1) * C]), (rank, name)


def read_and_ring(comm, xs):
    """Every reproducible collective with algo="read" on comm.alloc buffers, and with "ring" on plain
    copies: {name: (read bits, ring bits)}; reduce only on its root. A plain buffer with "read" must
    still be refused, as the plain call refuses it."""
    x = xs[comm.rank]
    c, root = xs[0].size // comm.world_size, comm.world_size - 1
    buf, out = comm.alloc(x.size, x.dtype), comm.alloc(c, x.dtype)
    got = {}
    buf[:] = x
    comm.all_reduce(buf, "sum", algo="read", reproducible=True)
    got["all_reduce"] = buf.copy(), comm.all_reduce(x.copy(), algo="ring", reproducible=True)
    buf[:] = x
    comm.all_reduce(buf, "avg", algo="read", reproducible=True)
    got["all_reduce avg"] = buf.copy(), comm.all_reduce(x.copy(), "avg", algo="ring", reproducible=True)
    buf[:] = x
    comm.reduce_scatter(buf, out, algo="read", reproducible=True)
    ring = comm.reduce_scatter(x, np.empty(c, x.dtype), algo="ring", reproducible=True)
    got["reduce_scatter"] = out.copy(), ring
    buf[:] = x
    comm.reduce(buf, root, algo="read", reproducible=True)
    ring = comm.reduce(x.copy(), root, algo="ring", reproducible=True)
    if comm.rank == root:
        got["reduce"] = buf.copy(), ring
    with pytest.raises(ValueError, match="must come from comm.alloc"):
        comm.all_reduce(x.copy(), algo="read", reproducible=True)
    return {k: (bits(a).copy(), bits(b).copy()) for k, (a, b) in got.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_read_on_registered_buffers_gives_the_ring_bits(n):
    # More than two ranks (and float64 on two) reduce limbs in scratch that no peer maps: "read" must
    # not be asked of them, and the bits must be every other algorithm's. Two ranks of float32 take
    # the shortcut: the plain "read" collective on the caller's buffers.
    cases = [inputs(dt, n, seed=20 + n) for dt in (np.dtype(np.float32), np.dtype(np.float64))]
    with World(n, timeout=120) as w:
        for xs in cases:
            want = bits(simulated(xs)).copy()
            c = want.size // n
            for rank, got in enumerate(w.run(read_and_ring, xs, timeout=200)):
                assert set(got) >= {"all_reduce", "all_reduce avg", "reduce_scatter"}
                assert ("reduce" in got) == (rank == n - 1)
                for name, (read, ring) in got.items():
                    assert np.array_equal(read, ring), (rank, name)
                    if name == "reduce_scatter":
                        assert np.array_equal(read, want[rank * c:(rank + 1) * c]), (rank, name)
                    elif name != "all_reduce avg":
                        assert np.array_equal(read, want), (rank, name)


def test_refused_before_any_byte_moves():
    with ringcomm.init() as comm:
        x = np.ones(8, np.float32)
        for op in ("max", "min", "prod"):
            with pytest.raises(ValueError, match="reproducible=True supports op sum and avg"):
                comm.all_reduce(x, op, reproducible=True)
        with pytest.raises(ValueError, match="needs a float dtype"):
            comm.reduce_scatter(np.ones(8, np.int32), np.ones(8, np.int32), reproducible=True)
        with pytest.raises(ValueError, match="needs a float dtype"):
            comm.reduce(np.ones(8, np.int64), reproducible=True)
        with pytest.raises(TypeError, match="reproducible must be True or False"):
            comm.all_reduce(x, reproducible="yes")
        # Integers: ringcomm reduces them, reproducible mode does not (ValueError). A dtype ringcomm
        # reduces in no mode fails the argument check every call makes first (TypeError), as docs/05 says.
        with pytest.raises(ValueError, match="needs a float dtype"):
            comm.all_reduce(np.ones(8, np.int32), reproducible=True)
        for dt in (np.complex64, np.bool_):
            with pytest.raises(TypeError, match="which ringcomm does not reduce"):
                comm.all_reduce(np.ones(8, dt), reproducible=True)
            with pytest.raises(TypeError, match="which ringcomm does not reduce"):
                comm.all_reduce(np.ones(8, dt))
        with pytest.raises(ValueError, match="has no algorithm"):
            comm.all_reduce(x, algo="nope", reproducible=True)
        with pytest.raises(ValueError, match="up to 1024 ranks"):
            repro.check("all_reduce", np.float32, ringcomm.SUM, 1025)
        y = np.array([1.5, -0.0, np.inf, 2.0 ** -140], np.float32)   # one rank: the input, zeros made +0.0
        comm.all_reduce(y, reproducible=True)
        assert bits(y).tolist() == bits(np.array([1.5, 0.0, np.inf, 2.0 ** -140], np.float32)).tolist()


def test_cost_prices_both_passes():
    c = repro.cost("all_reduce", "ring", 4, 1 << 20, alpha=3e-5, beta=2.5e-10, gamma=4e-10)
    plain = ringcomm.cost("all_reduce", "ring", 4, 1 << 20, alpha=3e-5, beta=2.5e-10, gamma=4e-10)
    codes = ringcomm.cost("all_reduce", "ring", 4, (1 << 20) // 4, alpha=3e-5, beta=2.5e-10, gamma=4e-10)
    assert c["plain"] == plain and c["max_pass"] == codes and c["reproducible"] == codes + c["sum_pass"]
    assert c["sum_pass"] == ringcomm.cost("all_reduce", "ring", 4, 3 << 20, alpha=3e-5, beta=2.5e-10, gamma=4e-10)
    assert "13 B on the wire" in repro.describe("float32") and "two ranks" in repro.describe("float32", 2)
    assert not c["shortcut"] and c["wire_bytes_per_element"] == 13 and c["runs"] == repro.describe("float32", 4)


def test_cost_on_two_ranks_prices_the_shortcut_that_runs():
    # Two ranks of float32 run the plain collective (run's shortcut): its bytes and seconds, no MAX pass.
    args = dict(alpha=3e-5, beta=2.5e-10, gamma=4e-10)
    for coll, root in (("all_reduce", None), ("reduce_scatter", None), ("reduce", 1)):
        c = repro.cost(coll, "ring", 2, 16 << 20, root=root, **args)
        plain = ringcomm.cost(coll, "ring", 2, 16 << 20, root=root, **args)
        assert c["shortcut"] and "two ranks" in c["runs"]
        assert c["plain"] == c["sum_pass"] == c["reproducible"] == plain and c["max_pass"] == 0.0
        assert c["ratio"] == 1.0 and c["wire_bytes_per_element"] == c["plain_bytes_per_element"] == 4
    # float64 takes the limbs even on two ranks: both passes, 17 B per element.
    c = repro.cost("all_reduce", "ring", 2, 16 << 20, dtype="float64", **args)
    assert not c["shortcut"] and c["wire_bytes_per_element"] == 17 and c["max_pass"] > 0 and c["ratio"] > 1


@pytest.mark.timeout(200)
@pytest.mark.parametrize("corrupt", [False, True])
def test_bench_reproducible_times_both_and_checks_bits(corrupt):
    from ringcomm.bench import worker
    from test_bench import _run_cli
    rc, out, err = _run_cli(["all_reduce", "-n", "3", "-b", "3K", "-e", "12K", "-f", "4", "--iters", "3",
                             "--warmup", "1", "--algo", "ring,tree", "--reproducible", "--no-progress"],
                            env_extra={worker.CORRUPT_ENV: "1"} if corrupt else None)
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [(r[0], r[2]) for r in rows] == [("3072", "ring"), ("12288", "ring"), ("3072", "tree"),
                                            ("12288", "tree")], out
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and float(r[5]) > 0 for r in rows), out
    if corrupt:
        assert rc == 1 and "bit identity across iterations, ranks and algorithms: FAILED" in out, out
        assert all(int(r[6]) > 0 for r in rows), out
    else:
        assert rc == 0 and "bit identity across iterations, ranks and algorithms: OK" in out, (out, err)
        assert len({r[7] for r in rows if r[0] == "3072"}) == 1     # one CRC for every algorithm


def test_bench_refuses_what_reproducible_mode_does_not_do(capsys):
    from ringcomm.bench import cli
    for args in (["all_gather"], ["all_reduce", "-o", "max"], ["all_reduce", "-d", "int32"]):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(args + ["--reproducible"])
        assert e.value.code == 2
    assert "--reproducible works for" in capsys.readouterr().err
