"""What a benchmark row means, as nccl-tests defines it: sizes, element counts, algbw and busbw.

nccl-tests (src/common.cu, src/<collective>.cu) names a row by its size in bytes, the largest of the
send and receive buffers, and computes from one mean iteration time
    algbw = size / time
    busbw = algbw * factor(collective, n)
where the factor turns algbw into what each rank's link must carry, so that busbw is comparable
between collectives and world sizes (a ring all-reduce moves 2(n-1)/n of the data per rank).
"""
from __future__ import annotations

import re

import numpy as np

from ringcomm.kernels import host

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv", "all_to_all",
               "gather", "scatter")
REDUCING = {"all_reduce", "reduce_scatter", "reduce"}
ROOTED = {"broadcast", "reduce", "gather", "scatter"}
# No in-place form: nccl-tests does not check its in-place alltoall, ringcomm refuses it.
NEVER_IN_PLACE = {"all_to_all"}
OPS = ("sum", "prod", "min", "max", "avg")

# nccl-tests' type names (the `type` column), and the names people also type.
DTYPES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
          "uint64": "uint64", "half": "float16", "float": "float32", "double": "float64",
          "bfloat16": "bfloat16"}
ALIASES = {"float16": "half", "fp16": "half", "float32": "float", "fp32": "float", "float64": "double",
           "fp64": "double", "bf16": "bfloat16", "char": "int8", "int": "int32"}

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGkmg]?)[Bb]?\s*$")


def parse_size(text: str) -> int:
    """Bytes from nccl-tests' size syntax: a number with an optional K, M or G suffix (powers of 1024)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: use a number of bytes with an optional K, M or G "
                         f"suffix, e.g. 8, 64K, 1.5M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min*factor, ... up to max (inclusive), as nccl-tests' -b / -e / -f."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise ValueError(f"invalid sizes: minimum {min_bytes} B must be >= 0 and <= maximum {max_bytes} B")
    if factor < 2:
        raise ValueError(f"the step factor (-f) must be at least 2, got {factor}")
    if min_bytes == 0:
        return [0] if max_bytes == 0 else [0] + sweep(1, max_bytes, factor)
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def dtype_name(text: str) -> str:
    """nccl-tests' name for a dtype given by either naming."""
    name = ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {text!r}: use one of {', '.join(DTYPES)} "
                         f"(or numpy's names: float16, float32, float64)")
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for nccl-tests' (or numpy's) dtype name."""
    return host.as_dtype(DTYPES[dtype_name(name)])


def counts(collective: str, size: int, itemsize: int, n: int) -> tuple[int, int, int, int]:
    """(count, send elements, recv elements, row size in bytes) for a requested size, as nccl-tests'
    getCollByteCount: `count` is what one rank passes to the call (the `count` column)."""
    total = size // itemsize
    if collective == "all_gather":
        count = total // n
        return count, count, count * n, count * n * itemsize
    if collective == "reduce_scatter":
        count = total // n
        return count, count * n, count, count * n * itemsize
    if collective == "all_to_all":  # alltoall.cu: count/nranks to each peer
        count = total // n
        return count, count * n, count * n, count * n * itemsize
    if collective == "gather":      # gather.cu: each rank's count/nranks; the root's whole
        count = total // n
        return count, count, count * n, count * n * itemsize
    if collective == "scatter":     # scatter.cu: count/nranks, rounded down to whole 16 bytes
        step = max(1, 16 // itemsize)
        count = total // n // step * step
        return count, count * n, count, count * n * itemsize
    if collective in COLLECTIVES:
        return total, total, total, total * itemsize
    raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw: the share of the data each rank's link carries (nccl-tests' getBw)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def bandwidth(collective: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes) for a row of ``size_bytes`` taking ``seconds`` per iteration."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size_bytes / 1e9 / seconds
    return algbw, algbw * bus_factor(collective, n)
