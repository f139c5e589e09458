"""``reproducible=True``: sums whose bits depend only on the multiset of the ranks' inputs.

Two collectives over the ordinary schedules, with the kernels of ringcomm.kernels.reproducible around them:

1. every rank computes each element's scale class (a uint8 code: its exponent, coarsened; specials on
   top) and a MAX all_reduce gives every rank the largest code of every element -- the same on all
   ranks, whatever the order;
2. every rank writes its input as wide fixed-point integers at that scale (NL limbs per element), an
   integer SUM all_reduce / reduce_scatter / reduce adds them exactly -- integer addition is associative,
   so the order, grouping and slicing of the schedule cannot change a bit -- and the rank(s) with the
   result round it once to the dtype (to nearest, ties to even). AVG then divides that sum by
   world_size and rounds once (ringcomm.kernels' postprocess).

Two ranks (or one) of float16, bfloat16 or float32 need neither pass: one IEEE addition (float16 /
bfloat16: in float32, then rounded once, which 24 >= 2p + 2 bits make exact) is already the exact sum
rounded once, and it commutes. Where an input lies below the window and the limbs would drop its bits,
it is too small to move the sum across a rounding boundary (float32: under 2^-40 of the larger input,
the boundary at least 2^-25 away; Format.one_add_suffices), so both give the same bits; what differs is
only what IEEE leaves open -- the NaN payload and the sign of an all-zero sum -- which ``canonical``
sets as decode does. float64's window (46 bits) is narrower than that margin (54), so float64 always
takes the limbs. tests/test_reproducible_kernels.py checks the two ways against each other.

reduce_scatter and reduce need every element's scale on every rank (each rank encodes all its blocks),
so their first pass is an all_reduce; their second is the collective itself on the limbs, which is
why block r of reduce_scatter and reduce's root output equal the all_reduce's elements bit for bit.

The passes run on the communicator's scratch (codes, limbs), which no peer maps: algo="read", which
reads the peers' comm.alloc buffers, is checked on the caller's buffers as the plain call checks it, and
the passes on scratch take automatic choice instead (the FIFO algorithms, or CMA reads where those win).
The limbs are integers, so the bits are those of every other algorithm.

Costs (ringcomm.reproducible.wire_bytes, and the notes of ringcomm.model): a 1-byte MAX pass, then
1 + NL * limb bytes per element instead of the dtype's itemsize: float32 13 B (3 x int32) for 4,
float64 17 B (2 x int64) for 8, float16 / bfloat16 9 B (1 x int64) for 2. The two-rank shortcut
moves the plain call's bytes (cost() says which one it priced).
"""
from __future__ import annotations

import numpy as np

from ringcomm.kernels import host, reproducible as kernels

from .ops import AVG, MAX, SUM
from .registered import settle
from .schedule.onecopy import ALGO as READ

OPS = (SUM, AVG)
COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce")


def check(collective: str, dtype, op, world_size: int) -> kernels.Format:
    """The wire format, or the ValueError every rank raises before any byte moves."""
    if op not in OPS:
        raise ValueError(f"{collective}: reproducible=True supports op sum and avg, not {op}")
    try:
        fmt = kernels.format_of(dtype)
    except TypeError:
        names = ", ".join(kernels.DTYPE_NAMES)
        raise ValueError(f"{collective}: reproducible=True needs a float dtype ({names}), got {dtype}") from None
    if world_size > kernels.MAX_WORLD:
        raise ValueError(f"{collective}: reproducible=True supports up to {kernels.MAX_WORLD} ranks "
                         f"(the integer limbs' headroom), this world has {world_size}")
    return fmt


def check_read(comm, collective: str, algo: str, x, y) -> None:
    """algo="read" asked for by name: refused, before any byte moves, where the plain call would refuse
    it (buffers not from comm.alloc), whatever the world size; the passes on scratch never take it (run).
    A forced RINGCOMM_ALGO=read is automatic choice, as for the plain call: nothing to refuse."""
    if algo == READ and comm._forced_algo != READ:
        settle(comm._registry, collective, READ, False, x, y, x.nbytes)


def shortcut(dtype, world_size: int) -> bool:
    """Whether run() takes the two-rank shortcut: the plain collective, made canonical (module docstring)."""
    return world_size <= 2 and kernels.format_of(dtype).one_add_suffices


def wire_bytes(dtype) -> int:
    """Bytes per element that reproducible mode moves: the 1-byte code plus the limbs."""
    return kernels.format_of(dtype).wire_bytes


def cost(collective: str, algo: str, world_size: int, nbytes, alpha, beta, gamma, *, dtype="float32",
         root=None, model="rounds") -> dict:
    """What reproducible mode costs in the alpha-beta-gamma model (ringcomm.cost), against the plain call.

    ``nbytes`` is the plain call's (ringcomm.cost's n) for ``dtype``. Returns the modelled seconds of
    the plain call, of the MAX pass (1 B per element, an all_reduce: every rank needs every scale) and
    of the SUM pass on the limbs (NL limbs per element), their sum and its ratio to plain. Where run()
    takes the two-rank shortcut (``shortcut``: True) it prices what runs there: no MAX pass, the plain
    collective as the SUM pass, the plain bytes per element. ``runs`` says which, in words (describe).
    The kernels that convert (a few ns per element on a CPU) are not in the model."""
    from . import model as _model
    fmt = kernels.format_of(dtype)
    itemsize = fmt_itemsize(dtype)
    plain = _model.cost(collective, algo, world_size, nbytes, alpha, beta, gamma, root=root, model=model)
    if shortcut(dtype, world_size):
        codes, limbs, wire = 0.0, plain, itemsize
    else:
        count = nbytes / itemsize
        code_algo = algo if collective == "all_reduce" else "ring"
        codes = _model.cost("all_reduce", code_algo, world_size, count, alpha, beta, gamma, model=model)
        limbs = _model.cost(collective, algo, world_size, count * fmt.NL * fmt.limb.itemsize, alpha, beta,
                            gamma, root=root, model=model)
        wire = fmt.wire_bytes
    return {"plain": plain, "max_pass": codes, "sum_pass": limbs, "reproducible": codes + limbs,
            "ratio": (codes + limbs) / plain if plain else float("nan"),
            "wire_bytes_per_element": wire, "plain_bytes_per_element": itemsize,
            "shortcut": shortcut(dtype, world_size), "runs": describe(dtype, world_size)}


def describe(dtype, world_size: int | None = None) -> str:
    """One line for reports (ringcomm.verify, ringcomm-bench): what reproducible mode does to a call."""
    fmt = kernels.format_of(dtype)
    if world_size is not None and shortcut(dtype, world_size):
        return ("order-independent: with two ranks one IEEE addition is the exact sum rounded once; "
                "the plain collective's bytes, then NaN and zeros made canonical")
    return (f"order-independent: a MAX pass of 1 B per element, then exact integer sums of {fmt.NL} x "
            f"{fmt.limb} per element ({fmt.wire_bytes} B on the wire against {fmt_itemsize(dtype)} B), "
            f"one rounding; exact within 2^{fmt.range_bits} of each element's largest input, up to "
            f"{kernels.MAX_WORLD} ranks")


def fmt_itemsize(dtype) -> int:
    return host.as_dtype(dtype).itemsize


def run(comm, collective: str, algo: str, x, y, op, root=None) -> None:
    """The two passes for one call; ``algo`` is already checked, ``y`` is where the result goes."""
    fmt = kernels.format_of(x.dtype)
    k = _Kernels(x)
    if shortcut(x.dtype, comm.world_size):
        _two_ranks(comm, collective, algo, x, y, op, root, k)      # on the caller's buffers: algo as given
        return
    if algo == READ:        # the scratch below is not comm.alloc memory: automatic choice (module docstring)
        algo = None
    codes = k.scratch(comm, "codes", np.uint8, x.size)
    k.lib.exponent_codes(x, codes, *k.stream)
    code_algo = algo if collective == "all_reduce" else None    # every rank needs every element's scale
    comm._run("all_reduce", comm._pick_algo("all_reduce", code_algo, codes.nbytes), codes, codes,
              codes.size, MAX, None, codes.nbytes)
    limbs = k.scratch(comm, "limbs", fmt.limb, fmt.NL * x.size)
    k.lib.encode(x, codes, limbs, *k.stream)
    if collective == "all_reduce":
        comm._run("all_reduce", algo, limbs, limbs, limbs.size, SUM, None, limbs.nbytes)
        sums, mine = limbs, codes
    elif collective == "reduce_scatter":
        c = y.size
        sums = k.scratch(comm, "sums", fmt.limb, fmt.NL * c)
        comm._run("reduce_scatter", algo, limbs, sums, sums.size, SUM, None, limbs.nbytes)
        mine = codes[comm.rank * c:(comm.rank + 1) * c]
    else:
        comm._run("reduce", algo, limbs, limbs, limbs.size, SUM, root, limbs.nbytes)
        if comm.rank != root:
            return
        sums, mine = limbs, codes
    k.lib.decode(sums, mine, y, *k.stream)
    if op == AVG:
        k.avg(y, comm.world_size)


def _two_ranks(comm, collective, algo, x, y, op, root, k) -> None:
    """The plain sum, made canonical, then AVG's division: the limbs' bits (see the module docstring)."""
    m = y.size if collective == "reduce_scatter" else x.size
    comm._run(collective, algo, x, y, m, SUM, root, x.nbytes)
    if collective == "reduce" and comm.rank != root:
        return
    k.lib.canonical(y, *k.stream)
    if op == AVG:
        k.avg(y, comm.world_size)


class _Kernels:
    """Host or device kernels, scratch of the same kind, and (device) the caller's stream."""

    def __init__(self, x):
        self.device = not isinstance(x, np.ndarray)
        if self.device:
            from ringcomm.kernels import device, device_reproducible
            self.lib, self.dev = device_reproducible, device
            s = getattr(x, "stream", 0)
            self.stream = (int(s) if s else 0,)         # the caller's stream, as ringcomm.device orders
        else:
            self.lib, self.stream = kernels, ()

    def scratch(self, comm, name, dtype, n):
        """An array of n elements kept on the communicator: a repeated call allocates (and page-faults)
        nothing. Reused only by the next call, which its stream orders after this one."""
        key = (name, self.device, np.dtype(dtype))
        arr = comm._scratch.get(key)
        if arr is None or arr.size < n:
            arr = comm._scratch[key] = self._alloc(dtype, max(n, 1))
        view = arr[:n]
        if self.device:
            view = self._bind(view)
        return view

    def _alloc(self, dtype, n):
        if not self.device:
            return np.empty(n, dtype)
        from numba import cuda
        return cuda.device_array(n, dtype)

    def _bind(self, view):
        view.itemsize = view.dtype.itemsize             # numpy's attribute, which the executor reads
        if not self.dev.SIMULATOR and self.stream[0]:
            view = view.bind(self.dev.as_stream(self.stream[0]))
            view.itemsize = view.dtype.itemsize
        return view

    def avg(self, y, n):
        if self.device:
            self.dev.postprocess(y, "avg", n, self.stream[0])
        else:
            from ringcomm.kernels import host
            host.postprocess(y, "avg", n)
