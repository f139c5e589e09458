"""ringcomm.cost reproduces Thakur, Rabenseifner and Gropp (IJHPCA 2005) exactly, from the schedules.

p ranks, n bytes (the vector; for all_gather the gathered total, for reduce_scatter the
input), lg = log2. The formulas as the paper and MPICH's sources (same authors) state them;
for non-power-of-two Rabenseifner, MPICH's allreduce.c with p' the largest power of two <= p.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction as F

import pytest

import ringcomm
from ringcomm.schedule.cost import model_cost

ALPHA, BETA, GAMMA = F(3, 1000), F(7, 10**6), F(11, 10**7)
N = F(3 * 2**20 + 5)


def lg(p):
    return F(p.bit_length() - 1)


def clg(p):
    return F((p - 1).bit_length())


def pof2(p):
    return 1 << (p.bit_length() - 1)


FORMULAS = {  # (collective, algo): (which p, cost(p, n, a, b, g))
    ("all_reduce", "ring"): ("all", lambda p, n, a, b, g:
                             2 * (p - 1) * a + 2 * F(p - 1, p) * n * b + F(p - 1, p) * n * g),
    ("all_reduce", "doubling"): ("pof2", lambda p, n, a, b, g: lg(p) * (a + n * b + n * g)),
    ("all_reduce", "rabenseifner"): ("pof2", lambda p, n, a, b, g:
                                     2 * lg(p) * a + 2 * F(p - 1, p) * n * b + F(p - 1, p) * n * g),
    ("reduce_scatter", "ring"): ("all", lambda p, n, a, b, g:  # the paper's pairwise exchange
                                 (p - 1) * a + F(p - 1, p) * n * b + F(p - 1, p) * n * g),
    ("reduce_scatter", "halving"): ("pof2", lambda p, n, a, b, g:
                                    lg(p) * a + F(p - 1, p) * n * b + F(p - 1, p) * n * g),
    ("all_gather", "ring"): ("all", lambda p, n, a, b, g: (p - 1) * a + F(p - 1, p) * n * b),
    ("all_gather", "doubling"): ("pof2", lambda p, n, a, b, g: lg(p) * a + F(p - 1, p) * n * b),
    ("all_gather", "bruck"): ("all", lambda p, n, a, b, g: clg(p) * a + F(p - 1, p) * n * b),
    ("broadcast", "binomial"): ("all", lambda p, n, a, b, g: clg(p) * (a + n * b)),
    ("reduce", "binomial"): ("all", lambda p, n, a, b, g: clg(p) * (a + n * b + n * g)),
    # all_to_all: n is what each rank sends (p blocks of n/p)
    ("all_to_all", "pairwise"): ("all", lambda p, n, a, b, g: (p - 1) * (a + n / p * b)),
    ("all_to_all", "bruck"): ("pof2", lambda p, n, a, b, g: clg(p) * a + n / 2 * lg(p) * b),
    ("gather", "binomial"): ("all", lambda p, n, a, b, g: clg(p) * a + F(p - 1, p) * n * b),
    ("scatter", "binomial"): ("all", lambda p, n, a, b, g: clg(p) * a + F(p - 1, p) * n * b),
    ("gather", "linear"): ("all", lambda p, n, a, b, g: (p - 1) * a + F(p - 1, p) * n * b),
    ("scatter", "linear"): ("all", lambda p, n, a, b, g: (p - 1) * a + F(p - 1, p) * n * b),
}
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def rabenseifner_any_p(p, n, a, b, g):
    """MPICH allreduce.c: (2 lg p' + 2) alpha + (2 (p'-1)/p' + 2) n beta + (1 + (p'-1)/p') n gamma."""
    q = pof2(p)
    return (2 * lg(q) + 2) * a + (2 * F(q - 1, q) + 2) * n * b + (1 + F(q - 1, q)) * n * g


@pytest.mark.parametrize("key", sorted(FORMULAS))
def test_paper_closed_forms_exactly(key):
    which, formula = FORMULAS[key]
    sizes = [2, 4, 8, 16, 32] if which == "pof2" else list(range(2, 13)) + [16, 17]
    for p in sizes:
        for root in ((0, p - 1) if key[0] in ROOTED else (None,)):
            got = ringcomm.cost(*key, p, N, ALPHA, BETA, GAMMA, root=root)
            assert got == formula(p, N, ALPHA, BETA, GAMMA), (key, p, root)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 9, 12, 13])
def test_rabenseifner_non_power_of_two_fold(p):
    assert ringcomm.cost("all_reduce", "rabenseifner", p, N, ALPHA, BETA, GAMMA) == \
        rabenseifner_any_p(p, N, ALPHA, BETA, GAMMA)


def test_floats_agree_to_1e12_and_critical_path_never_exceeds_rounds():
    rnd = random.Random(3)
    for _ in range(40):
        (coll, algo), (which, formula) = rnd.choice(sorted(FORMULAS.items()))
        p = rnd.choice([2, 4, 8, 16]) if which == "pof2" else rnd.randint(2, 12)
        a, b, g, n = rnd.uniform(1e-6, 1e-4), rnd.uniform(1e-11, 1e-9), rnd.uniform(1e-12, 1e-10), rnd.randint(1, 1 << 26)
        root = 0 if coll in ROOTED else None
        got = ringcomm.cost(coll, algo, p, n, a, b, g, root=root)
        assert math.isclose(got, float(formula(p, F(n), F(a), F(b), F(g))), rel_tol=1e-12)
        assert ringcomm.cost(coll, algo, p, n, a, b, g, root=root, model="critical_path") <= got * (1 + 1e-12)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 9, 12, 13])
def test_recursive_doubling_non_power_of_two_fold(p):
    """MPICH's fold: the extra ranks' inputs come in (stage 0) and the results go back (stage
    lg p' + 1) around the lg p' exchanges, the first of which carries a reduction more."""
    lgq = lg(pof2(p))
    assert ringcomm.cost("all_reduce", "doubling", p, N, ALPHA, BETA, GAMMA) == \
        (lgq + 2) * (ALPHA + N * BETA) + (lgq + 1) * N * GAMMA


@pytest.mark.parametrize("p", [3, 5, 6, 7, 9, 12, 13])
def test_bruck_all_to_all_any_p(p):
    """Stage k carries the blocks whose distance j (1 <= j < p) has bit k set: p/2 of them for a
    power of two (the paper's n/2 a stage), their exact number otherwise."""
    blocks = sum(bin(j).count("1") for j in range(p))
    assert ringcomm.cost("all_to_all", "bruck", p, N, ALPHA, BETA, GAMMA) == clg(p) * ALPHA + blocks * N / p * BETA


def test_critical_path_lets_an_idle_leaf_send_early():
    """Binomial reduce on 5 ranks: rank 4 has nothing to wait for, so off the rounds its message
    arrives while ranks 2 and 3 still work; the rounds model charges it a round of its own."""
    rounds = ringcomm.cost("reduce", "binomial", 5, N, ALPHA, BETA, GAMMA, root=0)
    path = ringcomm.cost("reduce", "binomial", 5, N, ALPHA, BETA, GAMMA, root=0, model="critical_path")
    assert rounds == 3 * (ALPHA + N * BETA + N * GAMMA)
    assert path == 2 * (ALPHA + N * BETA) + 3 * N * GAMMA


def test_breakdown_and_errors():
    c = ringcomm.cost_breakdown("all_reduce", "ring", 4, N, ALPHA, BETA, GAMMA)
    assert (c.alphas, c.beta_bytes, c.gamma_bytes) == (6, F(3, 2) * N, F(3, 4) * N)
    assert len(c.stages) == 6
    assert ringcomm.cost("all_reduce", "ring", 1, N, ALPHA, BETA, GAMMA) == 0
    with pytest.raises(ValueError, match="nbytes"):
        ringcomm.cost("all_reduce", "ring", 4, -1, ALPHA, BETA, GAMMA)
    with pytest.raises(ValueError, match="no algorithm"):
        ringcomm.cost("all_reduce", "nope", 4, N, ALPHA, BETA, GAMMA)
    with pytest.raises(ValueError, match="model"):
        ringcomm.cost("all_reduce", "ring", 4, N, ALPHA, BETA, GAMMA, model="fast")


def test_fit_recovers_known_parameters_and_reads_bench_json(tmp_path):
    truth = (F(25, 10**6), F(3, 10**10), F(5, 10**10))
    keys = [("all_reduce", "ring"), ("all_reduce", "tree"), ("all_gather", "ring"), ("reduce_scatter", "ring")]
    rows = [(c, a, p, nb, float(ringcomm.cost(c, a, p, nb, *truth)))
            for c, a in keys for p in (2, 4, 5) for nb in (1024, 65536, 1 << 20, 1 << 23)]
    got = ringcomm.fit(rows)
    for want, have in zip(truth, (got.alpha, got.beta, got.gamma)):
        assert math.isclose(have, float(want), rel_tol=1e-6)
    assert got.rms_relative_error < 1e-9 and got.rows == len(rows)
    doc = {"config": {"collective": "all_reduce", "ranks": 4}, "ringcomm": {"rows": {
        "ring": [{"size": nb, "oop": {"seconds": float(ringcomm.cost("all_reduce", "ring", 4, nb, *truth))}}
                 for nb in (0, 1024, 1 << 16, 1 << 20)],
        "tree": [{"size": nb, "oop": {"seconds": float(ringcomm.cost("all_reduce", "tree", 4, nb, *truth))}}
                 for nb in (1024, 1 << 16, 1 << 20)],
        "auto": [{"size": 8, "oop": {"seconds": 1.0}},          # written before rows said what ran
                 {"size": 1 << 18, "oop": {"seconds": float(ringcomm.cost("all_reduce", "ring", 4, 1 << 18,
                                                                            *truth)), "ran": "ring"}}]}}}
    path = tmp_path / "bench.json"
    path.write_text(__import__("json").dumps(doc))
    from ringcomm.model import load_bench
    rows = load_bench(path)
    assert len(rows) == 7 and rows[-1][1:4] == ("ring", 4, 1 << 18)  # size 0 and unnamed automatic rows left out
    one = ringcomm.fit(str(path))  # all_reduce alone cannot tell beta from gamma: only the times
    assert one.rms_relative_error < 1e-9 and math.isclose(one.alpha, float(truth[0]), rel_tol=1e-6)
    with pytest.raises(ValueError, match="at least 3"):
        ringcomm.fit(rows[:2])


def test_automatic_choice_uses_the_model_and_says_why(monkeypatch, capsys):
    from ringcomm import model
    monkeypatch.setattr(model, "_logged", set())
    monkeypatch.setenv("RINGCOMM_DEBUG", "info")
    assert model.choose("all_reduce", 8, 1000) == "doubling"    # latency: log2 p exchanges
    assert model.choose("all_reduce", 8, 1000) == "doubling"
    assert model.choose("all_reduce", 8, 1000, swap_safe=False) == "tree"  # float min/max: 2 log-depth trees
    assert model.choose("all_reduce", 8, 4 << 20) == "ring"     # bandwidth
    assert model.choose("all_reduce", 8, 64 << 10) != "doubling"  # measured slower from 48 KiB (model.py)
    err = capsys.readouterr().err
    assert err.count("ringcomm INFO: all_reduce on 8 ranks, 513..1024 B: chose doubling") == 1
    assert "chose ring" in err and "ring " in err and " us" in err
    assert model.choose("all_reduce", 100, 1000) == "tree"      # beyond the model's reach: the old rule
    assert model.choose("all_to_all", 8, 4096) == "bruck"        # 3 messages instead of 7
    assert model.choose("all_to_all", 8, 4 << 20) == "pairwise"  # each block once, not lg p / 2 times
    assert model.choose("all_to_all", 3, 64) == "pairwise"       # 2 stages either way: a tie
    assert model.choose("gather", 8, 4096) == "binomial" and model.choose("scatter", 2, 4096) == "linear"
    with ringcomm.init(0, 1) as comm:                           # a collective call goes through it
        comm.all_reduce(__import__("numpy").ones(300, "float32"))
    assert "all_reduce on 1 ranks, 1025..2048 B: chose ring" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_debug_info_says_when_the_read_steps_replace_the_models_choice(tmp_path):
    """With plain buffers read by CMA (RINGCOMM_CMA_MIN=1: every size), automatic choice runs "read"
    whatever the model chose: RINGCOMM_DEBUG=info says so, once, with the reason."""
    import os
    import subprocess
    import sys
    from ringcomm.transport import cma
    if not cma.available():
        pytest.skip("cross-memory attach (process_vm_readv) is not available here")
    script = tmp_path / "auto.py"
    script.write_text("import numpy as np, ringcomm\n"
                      "with ringcomm.init() as comm:\n"
                      "    x = np.ones(1 << 16, np.float32)\n"
                      "    for _ in range(3):\n"
                      "        comm.all_reduce(x)\n"
                      "    assert (x == 8).all(), x[:4]\n")
    env = dict(os.environ, RINGCOMM_DEBUG="info", RINGCOMM_CMA_MIN="1", RINGCOMM_TIMEOUT="30")
    r = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", str(script)], env=env,
                       capture_output=True, text=True, timeout=100)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        said = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ringcomm INFO: all_reduce")
                and "runs read, not the model's" in line]
        assert len(said) == 1 and "reads by CMA" in said[0], out
