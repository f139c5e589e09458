"""Exact references for reproducible sums: rational sums (fractions.Fraction) rounded once, and the
kernels' passes simulated in one process with any order and grouping of the integer sums."""
from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np

from ringcomm.kernels import reproducible as R

BF16 = np.dtype(ml_dtypes.bfloat16)


def fields(dt) -> tuple[int, int]:
    """(mantissa bits, exponent bits) of a float dtype."""
    dt = np.dtype(dt)
    if dt == BF16:
        return 7, 8
    fi = np.finfo(dt)
    return fi.nmant, fi.nexp


def round_exact(fr: Fraction, dt):
    """The dtype value nearest the rational fr, ties to even; inf past the largest finite; 0 is +0.0."""
    dt = np.dtype(dt)
    if fr == 0:
        return dt.type(0.0)
    m, eb = fields(dt)
    bias = 2 ** (eb - 1) - 1
    a = abs(fr)
    e = max(binade(a), 1 - bias)                                # subnormals share the smallest exponent
    q = a / Fraction(2) ** (e - m)
    n, r = divmod(q.numerator, q.denominator)
    if 2 * r > q.denominator or (2 * r == q.denominator and n % 2):
        n += 1
    val = Fraction(n) * Fraction(2) ** (e - m)
    f = np.inf if val > (2 - Fraction(2) ** -m) * Fraction(2) ** bias else float(val)   # float(val) is exact
    return np.array(-f if fr < 0 else f, np.float64).astype(dt)


def binade(a: Fraction) -> int:
    """e with 2^e <= a < 2^(e+1), for a > 0."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e = e - 1 if Fraction(2) ** e > a else e
    return e + 1 if Fraction(2) ** (e + 1) <= a else e


def exact_sum(values) -> Fraction:
    return sum((Fraction(float(v)) for v in values), Fraction(0))


def ulps(got, fr: Fraction, dt) -> Fraction:
    """|got - fr| in units of the dtype's last place at fr."""
    m, eb = fields(dt)
    e = max(binade(abs(fr)) if fr else -10 ** 4, 2 - 2 ** (eb - 1))
    return abs(Fraction(float(got)) - fr) / Fraction(2) ** (e - m)


def passes(inputs):
    """Each rank's (codes, ) then limbs, as the two collectives see them: ([codes], cmax, [limbs])."""
    dt = inputs[0].dtype
    fmt = R.format_of(dt)
    codes = [R.exponent_codes(x, np.empty(x.size, np.uint8)) for x in inputs]
    cmax = np.maximum.reduce(codes)
    limbs = [R.encode(x, cmax, np.empty(fmt.NL * x.size, fmt.limb)) for x in inputs]
    return codes, cmax, limbs


def simulated(inputs, order=None, pairwise=False):
    """The reproducible sum of per-rank arrays, the limbs added in ``order`` (default: rank order),
    one after the other or as a pairwise tree -- wrapping integer adds, as the collectives do."""
    _, cmax, limbs = passes(inputs)
    limbs = [limbs[i] for i in (order if order is not None else range(len(limbs)))]
    with np.errstate(over="ignore"):
        while len(limbs) > 1:
            if pairwise:
                limbs = [limbs[i] + limbs[i + 1] if i + 1 < len(limbs) else limbs[i]
                         for i in range(0, len(limbs), 2)]
            else:
                limbs = [limbs[0] + limbs[1]] + limbs[2:]
    return R.decode(limbs[0], cmax, np.empty(inputs[0].size, inputs[0].dtype))


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")
