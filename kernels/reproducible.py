"""Kernels of reproducible sums: floats to wide fixed-point integers and back, per element.

    exponent_codes(x, codes)        codes[i] = the scale class of x[i] (uint8; 0 for zeros, specials on top)
    encode(x, codes, limbs, block)  x[i] at the scale of the all-reduced MAX code, as integer limbs
    decode(sums, codes, out)        summed limbs -> the float, rounded once (to nearest, ties to even)
    FORMATS[dtype]                  the wire format of each float dtype (limb dtype, limbs, window)

The caller (ringcomm.reproducible) runs them around two collectives: a MAX all_reduce of the codes and
an integer SUM of the limbs. Integer addition is exact and associative, so the summed limbs -- and the
one rounding at the end -- are the same whatever the order, the grouping, the slicing or the world
size (ranks that add zeros add nothing). See docs/05_reproducible_sums.md for the why.

The arithmetic, per element, with M mantissa bits, biased exponent field be and significand s (s has
the hidden bit, so |x| = s * 2^(max(be, 1) - bias - M)):

- code: 0 for +-0; 1 + ceil((max(be, 1) - 1) / Q) for finite x (Q: the exponent quantum that keeps the
  codes below 256); CMAX+1 / +2 / +3 for +inf / -inf / NaN, so the MAX says "NaN", "-inf (maybe +inf
  too)" or "+inf only".
- the element's scale is TB = 1 + (C - 1) * Q for the MAX code C, the largest biased exponent of that
  class, so every |x| < 2^(TB - bias + 1). x becomes the integer X = trunc(x * 2^(F - TB + bias)):
  |X| < 2^(F + 1), exact when x has no bit below 2^(TB - bias - F) -- that is when |x| is within
  2^RANGE of the element's largest input, RANGE = F - M - (Q - 1) (FORMATS lists it: 40 to 46 bits).
- X is stored as NL limbs, two's complement in base 2^B: the lower limbs hold B-bit digits (their
  sum over n <= 2^(W - B) ranks cannot leave W bits), the top limb the rest, and it may wrap freely:
  the total, |sum| < n * 2^(F + 1), fits the NL limbs' combined width, so reading the sums back
  modulo that width gives it exactly.
- specials: where C says +inf / -inf / NaN, limb 0 counts the +infs instead (the only fact that MAX
  cannot give: whether a -inf met a +inf).

Every kernel is one loop body shared by the host (numba njit, compiled at first use) and the device
(numba.cuda, ringcomm.kernels.device_reproducible): the dtype's constants and DEVICE are closure
constants, so numba folds the other branches away. They work on the floats' bit patterns (unsigned
views; float64 through int64), never on floating-point values, so no compiler flag, flush-to-zero or
fused multiply-add can change a bit, and host and device agree by construction.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from . import host
# numba.cuda (or its simulator) once ringcomm.kernels.device_reproducible is imported. The device bodies
# name it as a module global, which is what the simulator swaps for its per-thread grid; the host
# bodies never reach it (DEVICE is a constant, numba prunes the branch).
cuda = None
host_clz = None   # LLVM's count-leading-zeros, for the host's decode kernels (make_decode)
MAX_WORLD = 1024                        # 2^10: the headroom every format's lower limbs keep


class Format(NamedTuple):
    """How one float dtype travels: NL limbs of ``limb`` dtype, lower ones of B-bit digits."""
    bits: np.dtype                      # the view the kernels read and write the floats through
    EB: int                             # exponent field bits
    M: int                              # mantissa field bits
    Q: int                              # exponent quantum of the codes
    F: int                              # fraction bits of the window below the class's top
    limb: np.dtype
    NL: int
    B: int                              # digit bits of the lower limbs

    @property
    def range_bits(self) -> int:
        """Inputs within 2^range_bits of the element's largest input convert exactly."""
        return self.F - self.M - (self.Q - 1)

    @property
    def one_add_suffices(self) -> bool:
        """Whether one IEEE addition of two inputs gives this format's bits. An input the window truncates
        is under 2^-range of the larger one; if that is also under the larger one's distance to the
        nearest rounding boundary (at least 2^-(M+2) of it), truncated or not it rounds the same way.
        True for float16, bfloat16, float32; not for float64 (range 46 < 54)."""
        return self.range_bits >= self.M + 2

    @property
    def wire_bytes(self) -> int:
        """Bytes per element on the wire: the code plus the limbs."""
        return 1 + self.NL * self.limb.itemsize


# Checked by tests/test_reproducible_kernels.py: every lower digit sum of MAX_WORLD ranks fits its
# limb, and MAX_WORLD * 2^(F+1) fits the limbs' combined width (NL*W - (NL-1)*(W-B) bits, signed).
# bfloat16's is kept apart: its dtype is ml_dtypes', imported only at first use (kernels/host.py);
# FORMATS, DTYPES and BFLOAT16 are made when first asked for (__getattr__ below).
_BF16_FORMAT = Format(np.dtype(np.uint16), 8, 7, 2, 52, np.dtype(np.int64), 1, 62)
_NUMPY_FORMATS = {
    np.dtype(np.float16): Format(np.dtype(np.uint16), 5, 10, 1, 52, np.dtype(np.int64), 1, 62),
    np.dtype(np.float32): Format(np.dtype(np.uint32), 8, 23, 2, 64, np.dtype(np.int32), 3, 22),
    np.dtype(np.float64): Format(np.dtype(np.int64), 11, 52, 9, 106, np.dtype(np.int64), 2, 54),
}
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")


def __getattr__(name):
    """FORMATS ({dtype: Format}, bfloat16 second), DTYPES (its keys) and BFLOAT16: they import ml_dtypes."""
    if name == "BFLOAT16":
        return host.bfloat16()
    if name in ("FORMATS", "DTYPES"):
        formats = {host.as_dtype(n): format_of(n) for n in DTYPE_NAMES}
        return formats if name == "FORMATS" else tuple(formats)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def codes_for(fmt: Format) -> tuple[int, int, int, int]:
    """(CMAX, +inf, -inf, NaN): the largest finite code and the three special ones."""
    cmax = 1 + (2 ** fmt.EB - 3 + fmt.Q - 1) // fmt.Q
    return cmax, cmax + 1, cmax + 2, cmax + 3


# --- the kernel bodies (host and device) -----------------------------------------------------------------
def make_codes(fmt: Format, DEVICE: bool):
    """codes[i] = the scale class of x[i]; x is the floats' bit view (Format.bits)."""
    EB, M, Q = fmt.EB, fmt.M, fmt.Q
    WIDTH = 8 * fmt.bits.itemsize
    EXPALL, MMASK = 2 ** EB - 1, 2 ** M - 1
    _, PINF, NINF, NAN = codes_for(fmt)

    def codes_kernel(x, codes):
        if DEVICE:
            i, stride = cuda.grid(1), cuda.gridsize(1)
        else:
            i, stride = 0, 1
        while i < x.size:
            u = np.int64(x[i])
            exp = (u >> M) & EXPALL
            mant = u & MMASK
            if exp == EXPALL:
                c = NAN if mant != 0 else (NINF if (u >> (WIDTH - 1)) & 1 else PINF)
            elif exp == 0 and mant == 0:
                c = 0
            else:
                c = 1 + (max(exp, 1) - 1 + Q - 1) // Q
            codes[i] = c
            i += stride
    return codes_kernel


def make_encode(fmt: Format, DEVICE: bool):
    """limbs <- x at its element's scale: element e's NL limbs at limbs[e*NL:(e+1)*NL], so any block of
    elements (reduce_scatter's) has its limbs in one block too."""
    EB, M, Q, F, NL, B = fmt.EB, fmt.M, fmt.Q, fmt.F, fmt.NL, fmt.B
    WIDTH = 8 * fmt.bits.itemsize
    EXPALL, MMASK, DMASK = 2 ** EB - 1, 2 ** M - 1, 2 ** B - 1
    _, PINF, _, _ = codes_for(fmt)

    def encode_kernel(x, codes, limbs):
        if DEVICE:
            e, stride = cuda.grid(1), cuda.gridsize(1)
        else:
            e, stride = 0, 1
        while e < x.size:
            u = np.int64(x[e])
            C = np.int64(codes[e])
            exp = (u >> M) & EXPALL
            mant = u & MMASK
            sign = (u >> (WIDTH - 1)) & 1
            neg = sign
            s = mant | (np.int64(1) << M) if exp > 0 else mant     # +-0: s = 0, every limb 0
            special = C >= PINF             # a special element: no finite part ...
            s = 0 if special else s
            neg = 0 if special else neg
            # X = s * 2^k, k <= F - M. Digit j holds bits [jB, jB + B) of X, the top limb all above;
            # bits below the window are dropped (toward zero). Shifts are clamped to 63: the lower
            # digits keep only B < 63 bits and the format keeps the top limb from overflowing.
            k = max(exp, 1) - (1 + (C - 1) * Q) + F - M
            carry = neg                     # -X = ~X + 1, digit by digit
            flip = -neg                     # all ones when negative
            for j in range(NL):
                t = k - j * B
                part = (s << min(max(t, 0), 63)) >> min(max(-t, 0), 63)
                if j < NL - 1:
                    part = ((part & DMASK) ^ (flip & DMASK)) + carry
                    carry = part >> B
                    part &= DMASK
                else:
                    part = (part ^ flip) + carry
                if j == 0:                  # ... but limb 0 counts the +infs
                    part += np.int64(special and exp == EXPALL and mant == 0 and sign == 0)
                limbs[e * NL + j] = part
            e += stride
    return encode_kernel


def make_decode(fmt: Format, DEVICE: bool, clz=None):
    """out <- the summed limbs of each element, rounded once to nearest, ties to even. out is the bit view."""
    # Count leading zeros of an int64 (64 for 0): cuda.clz on a GPU, else clz (the simulator's twin)
    # or, on the host, LLVM's ctlz.
    # On the host, LLVM's ctlz is a module global, not a closure cell: numba keys a closure's disk
    # cache entry by its cells' pickled values, and an intrinsic's differ in every process (each one
    # compiled decode again, ~0.6 s a dtype, and added an entry to the index: 2479 of them, 3 MB).
    global host_clz
    GPU_CLZ, HOST_CLZ = DEVICE and clz is None, not DEVICE
    if HOST_CLZ and host_clz is None:
        from numba.cpython.unsafe.numbers import leading_zeros as host_clz
    EB, M, Q, F, NL, B = fmt.EB, fmt.M, fmt.Q, fmt.F, fmt.NL, fmt.B
    EXPALL = 2 ** EB - 1
    INF, QNAN = EXPALL << M, (EXPALL << M) | (1 << (M - 1))
    SIGN = -(2 ** 63) if fmt.bits.itemsize == 8 else 2 ** (8 * fmt.bits.itemsize - 1)  # added to set it
    _, PINF, NINF, NAN = codes_for(fmt)
    # The sum as a sign and a magnitude hi * 2^L + lo, 0 <= lo < 2^L, assembled from the limbs' sums.
    L = 32 if NL == 1 else (B if NL == 2 else 2 * B)
    LMASK = 2 ** L - 1

    def decode_kernel(sums, codes, out):
        if DEVICE:
            e, stride = cuda.grid(1), cuda.gridsize(1)
        else:
            e, stride = 0, 1
        c = out.size
        while e < c:
            # Branch-free (selects, no jumps), so that the host loop vectorises and GPU warps do not
            # diverge: every case is computed and the right one picked at the end.
            C = np.int64(codes[e])
            if NL == 1:                         # one int64, wrapped: |sum| < 2^63
                t = np.int64(sums[e])
                hi, lo = t >> L, t & LMASK
            elif NL == 2:                       # int64 digit sum (unsigned, < 2^64) + wrapped int64 top
                s0 = np.int64(sums[2 * e])
                lo = s0 & LMASK
                hi = np.int64(sums[2 * e + 1]) + ((s0 >> B) & (2 ** (64 - B) - 1))
            else:                               # two int32 digit sums (unsigned) + wrapped int32 top
                lo = (np.int64(sums[3 * e]) & 0xFFFFFFFF) + ((np.int64(sums[3 * e + 1]) & 0xFFFFFFFF) << B)
                hi = np.int64(sums[3 * e + 2]) + (lo >> L)
                lo &= LMASK
                hi = ((hi + 2 ** 31) & 0xFFFFFFFF) - 2 ** 31
            pinfs = np.int64(sums[NL * e])      # for special elements: how many ranks had +inf
            # the magnitude: -(hi * 2^L + lo) = ~hi * 2^L + (~lo mod 2^L) + 1
            neg = (hi >> 63) & 1
            flip = -neg
            lo = (lo ^ (LMASK & flip)) + neg
            hi = (hi ^ flip) + (lo >> L)
            lo &= LMASK
            big = hi > 0
            w = hi if big else lo
            if GPU_CLZ:
                lz = cuda.clz(w)
            elif HOST_CLZ:
                lz = host_clz(w)
            else:
                lz = clz(w)
            nb = (L if big else 0) + 64 - lz    # its bit length
            # v = its top min(nb, 62) bits, the dropped ones OR-ed into the lowest (sticky) bit:
            # rounding v to M+1 <= 53 bits is rounding the whole magnitude.
            d = max(nb - 62, 0)
            low = d < L
            v = (hi << min(L - d, 63) | (lo >> min(d, 63))) if low else (hi >> min(d - L, 63))
            mask = (np.int64(1) << min(d, 62)) - 1 if low else LMASK
            sticky = (lo & mask) | (0 if low else hi & ((np.int64(1) << min(d - L, 62)) - 1))
            v |= np.int64(sticky != 0)
            TB = 1 + (C - 1) * Q
            ebe = max(nb - 1 + TB - F, 1)       # the result's biased exponent; 1: subnormal
            sh = ebe - d - TB + F - M           # bits of v below the result's last place
            up = min(max(-sh, 0), 62)           # sh <= 0: exact, shifted up
            sh = min(max(sh, 1), 63)            # else round to nearest, ties to even (63: to 0)
            rounded = (v + (np.int64(1) << (sh - 1)) - 1 + ((v >> sh) & 1)) >> sh
            sig = (v << up) if up > 0 else rounded
            # sig has the hidden bit: adding it carries into the exponent, as a round-up must;
            # past the largest finite value that gives inf (overflow)
            bits = INF if ebe >= EXPALL else min(((ebe - 1) << M) + sig, INF)   # (no int64 overflow)
            bits += SIGN & flip
            bits = 0 if nb == 0 else bits       # an exact zero is +0.0 (so is an element of zeros)
            special = QNAN if C == NAN or (C == NINF and pinfs > 0) else INF + (SIGN if C == NINF else 0)
            bits = special if C >= PINF else bits
            out[e] = bits
            e += stride
    return decode_kernel


def make_canon(fmt: Format, DEVICE: bool):
    """x <- x with every NaN the canonical quiet NaN and every zero +0.0, in place (the bit view):
    what decode gives for those, so a sum that needs no limbs (two ranks) matches it bit for bit."""
    EB, M = fmt.EB, fmt.M
    WIDTH = 8 * fmt.bits.itemsize
    EXPALL = 2 ** EB - 1
    QNAN = (EXPALL << M) | (1 << (M - 1))
    MAG = 2 ** (EB + M) - 1                     # every bit but the sign

    def canon_kernel(x):
        if DEVICE:
            e, stride = cuda.grid(1), cuda.gridsize(1)
        else:
            e, stride = 0, 1
        while e < x.size:
            u = np.int64(x[e])
            mag = u & MAG
            if mag > (EXPALL << M):
                x[e] = QNAN
            elif mag == 0 and (u >> (WIDTH - 1)) & 1:
                x[e] = 0
            e += stride
    return canon_kernel


# --- host entry points -----------------------------------------------------------------------------------
_cache: dict = {}
_lock = threading.Lock()
_MAKERS = {"codes": make_codes, "encode": make_encode, "decode": make_decode, "canon": make_canon}


def _host(name: str, dt: np.dtype):
    key = (name, dt)
    k = _cache.get(key)
    if k is None:
        with _lock:
            k = _cache.get(key)
            if k is None:
                import numba
                # nogil: other threads run while a rank converts. cache: ranks are processes, compile
                # once per machine (numba keys a closure's cache entry by its cells' values too).
                k = _cache[key] = numba.njit(nogil=True, cache=True)(_MAKERS[name](format_of(dt), False))
    return k


def compile_host(dt) -> None:
    """Compile (or load from numba's disk cache) the four host kernels of ``dt``: what a process
    that has many ranks coming can do once, before they would each compile them at first use."""
    fmt, x, codes = format_of(dt), np.ones(4, dt), np.zeros(4, np.uint8)
    limbs = np.zeros(fmt.NL * x.size, fmt.limb)
    exponent_codes(x, codes)
    encode(x, codes, limbs)
    decode(limbs, codes, x)
    canonical(x)


def format_of(dt) -> Format:
    dt = host.as_dtype(dt)
    fmt = _NUMPY_FORMATS.get(dt) or (_BF16_FORMAT if host.is_bfloat16(dt) else None)
    if fmt is None:
        raise TypeError(f"reproducible sums take {', '.join(DTYPE_NAMES)}; got {dt}")
    return fmt


def exponent_codes(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """codes (uint8, x.size) <- each element's scale class."""
    fmt = format_of(x.dtype)
    _host("codes", x.dtype)(x.view(fmt.bits), codes)
    return codes


def encode(x: np.ndarray, codes: np.ndarray, limbs: np.ndarray) -> np.ndarray:
    """limbs (NL * x.size of the format's limb dtype) <- x at the scale of codes (the MAX over ranks).
    Element e's limbs are limbs[e*NL:(e+1)*NL]."""
    fmt = format_of(x.dtype)
    _host("encode", x.dtype)(x.view(fmt.bits), codes, limbs)
    return limbs


def decode(sums: np.ndarray, codes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out <- the floats whose limbs, summed over the ranks, are ``sums`` (NL per element, as encode lays them)."""
    fmt = format_of(out.dtype)
    _host("decode", out.dtype)(sums, codes, out.view(fmt.bits))
    return out


def canonical(x: np.ndarray) -> np.ndarray:
    """x <- x with NaNs made the canonical quiet NaN and -0.0 made +0.0, in place."""
    fmt = format_of(x.dtype)
    _host("canon", x.dtype)(x.view(fmt.bits))
    return x
