"""Reproducible sums in one process: the kernels' arithmetic against exact rational sums, and the
properties the collectives rely on (any order, grouping, position or zero padding: the same bits).

The integer limb sums are simulated here with numpy's wrapping adds in many orders and groupings --
what any schedule does; tests/test_reproducible.py runs the real collectives.
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from exact import BF16, bits, exact_sum, fields, passes, round_exact, simulated, ulps
from ringcomm.kernels import reproducible as R

DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
IDS = [str(d) for d in DTYPES]


def spread(dt, n, m, seed, binades=None):
    """n ranks x m elements: mixed signs over up to ``binades`` binades (default: the documented range,
    or what the dtype has), each element around its own random magnitude; subnormals and zeros too."""
    rng = np.random.default_rng(seed)
    mant, eb = fields(dt)
    emin, emax = 2 - 2 ** (eb - 1), 2 ** (eb - 1) - 1
    binades = min(binades or R.format_of(dt).range_bits, emax - emin - 4)
    top = rng.integers(emin + binades - mant, emax - 4, m)          # each element's largest binade
    exps = top - rng.integers(0, binades, (n, m))
    xs = rng.choice([-1.0, 1.0], (n, m)) * rng.uniform(1, 2, (n, m)) * np.exp2(exps.astype(np.float64))
    xs[:, : m // 20] = 0.0                                           # some elements all zero
    xs[rng.random((n, m)) < 0.05] = 0.0
    out = xs.astype(dt)
    tiny = rng.integers(1, 2 ** mant, (n, m // 10))                  # all-subnormal elements
    sub = (tiny * np.exp2(float(emin - mant))).astype(dt) * rng.choice([-1, 1], (n, m // 10)).astype(dt)
    out[:, -(m // 10):] = sub
    return [out[r].copy() for r in range(n)]


def test_formats_hold_their_promises():
    for dt, fmt in R.FORMATS.items():
        w = 8 * fmt.limb.itemsize
        lower = (fmt.NL - 1) * fmt.B
        assert fmt.range_bits >= 40, dt
        if fmt.NL > 1:      # the digit sums of MAX_WORLD ranks stay below 2^W: read unsigned, exact
            assert R.MAX_WORLD * (2 ** fmt.B - 1) < 2 ** w, dt
        # every |X| < 2^(F+1), so |sum| < MAX_WORLD * 2^(F+1) must fit lower digits + a signed top limb
        assert R.MAX_WORLD * 2 ** (fmt.F + 1) <= 2 ** (lower + w - 1), dt
        assert codes_fit(fmt), dt
        assert fmt.wire_bytes == 1 + fmt.NL * fmt.limb.itemsize


def codes_fit(fmt) -> bool:
    return R.codes_for(fmt)[3] <= 255


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_correctly_rounded_exact_sum_within_the_range(dt):
    xs = spread(dt, 5, 600, seed=1)
    got = simulated(xs)
    worst = 0
    for i in range(got.size):
        fr = exact_sum(x[i] for x in xs)
        want = round_exact(fr, dt)
        assert bits(got[i]) == bits(want), (i, got[i], want, [x[i] for x in xs])
        worst = max(worst, ulps(got[i], fr, dt))
    assert worst <= 0.5


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_same_bits_for_any_order_grouping_position_and_zero_padding(dt):
    xs = spread(dt, 6, 400, seed=2)
    want = bits(simulated(xs))
    rng = np.random.default_rng(3)
    for _ in range(3):                                  # which rank holds which input; order of the adds
        perm = rng.permutation(len(xs))
        assert np.array_equal(bits(simulated([xs[p] for p in perm])), want)
        assert np.array_equal(bits(simulated(xs, order=perm, pairwise=True)), want)
    zeros = [np.zeros_like(xs[0])] * 3                  # a larger world whose extra ranks give zeros
    assert np.array_equal(bits(simulated(xs[:3] + zeros + xs[3:])), want)
    shift = 37                                          # the same multiset at other positions
    moved = [np.concatenate([np.ones(shift, dt), x]) for x in xs]
    assert np.array_equal(bits(simulated(moved))[shift:], want)
    half = xs[0].size // 2                              # sliced: every slice summed on its own
    parts = [simulated([x[:half] for x in xs]), simulated([x[half:] for x in xs])]
    assert np.array_equal(bits(np.concatenate(parts)), want)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_cancellations_are_exact(dt):
    fmt = R.format_of(dt)
    mant, _ = fields(dt)
    big = np.array([1.5, -1.75, 1.0, 1.9], np.float64) * 2.0 ** 10
    s = np.exp2(np.log2(np.abs(big)).astype(int) - fmt.range_bits + 1) * (1 + 2.0 ** -mant)  # odd mantissa
    xs = [big.astype(dt), (-big).astype(dt), s.astype(dt), s.astype(dt)]
    got = simulated(xs)
    want = (2 * s).astype(dt)
    assert np.array_equal(bits(got), bits(want)), (got, want)
    assert all(Fraction_equal(got[i], exact_sum(x[i] for x in xs)) for i in range(big.size))


def Fraction_equal(v, fr) -> bool:
    return exact_sum([v]) == fr


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_specials_zeros_and_overflow(dt):
    big = float(ml_dtypes.finfo(dt).max)
    cases = [  # (inputs of one element over 3 ranks, expected as float64; "nan" for NaN)
        ([np.nan, 1.0, 2.0], "nan"), ([np.inf, 1.0, -5.0], np.inf), ([-np.inf, 1.0, 0.0], -np.inf),
        ([np.inf, -np.inf, 1.0], "nan"), ([np.inf, np.inf, -np.inf], "nan"), ([np.inf, np.nan, 1.0], "nan"),
        ([-np.inf, -np.inf, 3.0], -np.inf), ([big, big, 0.0], np.inf), ([-big, -big, -big], -np.inf),
        ([big, big, -big], big), ([-0.0, -0.0, -0.0], 0.0), ([0.0, -0.0, 0.0], 0.0), ([0.0, 0.0, 0.0], 0.0),
    ]
    xs = [np.array([c[0][r] for c in cases], np.float64).astype(dt) for r in range(3)]
    got = simulated(xs)
    for i, (_, want) in enumerate(cases):
        if want == "nan":
            assert np.isnan(float(got[i])), (i, got[i])
        else:
            assert bits(got[i]) == bits(np.array(want).astype(dt)), (i, got[i], want)
    assert not np.signbit(got[-3:].astype(np.float64)).any()    # zeros, even of -0.0 only, are +0.0


def test_largest_world_does_not_overflow_the_limbs():
    for dt in DTYPES:
        big = float(ml_dtypes.finfo(dt).max)
        one = np.array([big, -big, 1.5, -(2.0 ** -10)], np.float64).astype(dt)
        _, cmax, limbs = passes([one])
        with np.errstate(over="ignore"):
            total = np.sum(np.stack([limbs[0]] * R.MAX_WORLD), axis=0, dtype=limbs[0].dtype)
        got = R.decode(total, cmax, np.empty(one.size, dt))
        want = [round_exact(exact_sum([v]) * R.MAX_WORLD, dt) for v in one]
        assert np.array_equal(bits(got), bits(np.array(want, dt))), (dt, got, want)


def test_inputs_below_the_range_are_dropped_the_same_way_everywhere():
    # Outside the documented range the result may lose the tiny inputs, but never its reproducibility.
    dt = np.dtype(np.float32)
    xs = [np.array([1e30, 1.0], dt), np.array([-1e30, 2.0 ** -60], dt), np.array([3.0, -1e-30], dt)]
    want = bits(simulated(xs))
    assert np.array_equal(bits(simulated(xs, order=[2, 0, 1], pairwise=True)), want)
    assert simulated(xs)[1] == np.float32(1.0)


@pytest.mark.parametrize("dt", DTYPES[:3], ids=IDS[:3])
def test_two_ranks_one_ieee_add_gives_the_limbs_bits(dt):
    # What ringcomm.reproducible does for worlds of two: the plain kernel's sum, made canonical.
    from ringcomm.kernels import host
    assert R.format_of(dt).one_add_suffices
    a, b = spread(dt, 2, 3000, seed=4, binades=80)              # far beyond the range too
    big = float(ml_dtypes.finfo(dt).max)
    edge = np.array([[np.nan, 1.0, np.inf, -np.inf, -0.0, -0.0, 0.0, big, -big, 1.0, 2.0 ** -30],
                     [2.0, -np.nan, -np.inf, -np.inf, -0.0, 0.0, -0.0, big, big, 2.0 ** -60, 1.0]])
    a[:edge.shape[1]], b[:edge.shape[1]] = edge.astype(dt)
    got = R.canonical(host.reduce_copy(np.empty_like(a), a, b, "sum"))
    assert np.array_equal(bits(got), bits(simulated([a, b])))
    assert np.array_equal(bits(got), bits(simulated([b, a])))
    mant, _ = fields(dt)                                        # a sum a hair above a rounding tie
    a, b = np.array([1.0, -1.0], dt), np.array([2.0 ** -(mant + 1) * (1 + 2.0 ** -(mant - 1))] * 2, dt)
    assert np.array_equal(bits(R.canonical(host.reduce_copy(np.empty_like(a), a, b, "sum"))),
                          bits(simulated([a, b])))


def test_float64_two_ranks_need_the_limbs():
    # 1 + (2^-53 + 2^-104): IEEE rounds up past the tie; the window (46 bits) drops 2^-104, the tie
    # goes to even. So float64 never takes the one-add path: its bits must not depend on the world size.
    assert not R.format_of(np.float64).one_add_suffices
    a, b = np.array([1.0]), np.array([2.0 ** -53 + 2.0 ** -104])
    assert simulated([a, b])[0] == 1.0 and (a + b)[0] == 1.0 + 2.0 ** -52


LOAD_KERNELS = """
import json, sys
import numpy as np
from ringcomm.kernels import reproducible as R
dt = np.dtype(np.float32)
R.compile_host(dt)
stats = {}
for name in ("codes", "encode", "decode", "canon"):
    s = R._host(name, dt).stats
    stats[name] = [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
json.dump(stats, sys.stdout)
"""


def test_host_kernels_load_from_numbas_disk_cache_in_a_new_process(tmp_path):
    """A second process loads the four kernels (float32's) from the disk cache. (The decode kernels
    once captured LLVM's ctlz in a closure cell, whose pickled value differs in every process: each
    process compiled them again, ~0.6 s a dtype, and added an entry to the cache index.)"""
    import json
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run([sys.executable, "-c", LOAD_KERNELS], env=env, check=True, timeout=120,
                                      capture_output=True, text=True).stdout) for _ in range(2)]
    assert len(runs[1]) == 4 and all(hits_misses == [1, 0] for hits_misses in runs[1].values()), runs[1]
    assert all(misses == 1 for _, misses in runs[0].values()), runs[0]
