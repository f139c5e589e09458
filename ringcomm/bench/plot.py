"""--plot: bus bandwidth against message size, one line per library and algorithm, with the memcpy
bandwidth measured in the same run as a dashed ceiling. matplotlib (the `bench` extra), Agg backend."""
from __future__ import annotations


def _size_label(b: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale}{unit}"
    return f"{b}"


def draw(path: str, title: str, lines: dict, memcpy_gbps: float | None) -> None:
    """``lines``: label -> [(size in bytes, busbw in GB/s), ...]; written to ``path`` as PNG."""
    try:
        import matplotlib
        import matplotlib.pyplot  # noqa: F401 - what fails when one of matplotlib's own dependencies is missing
    except ImportError as e:
        raise RuntimeError(f"--plot needs matplotlib, which did not import ({e}): "
                           f"pip install 'ringcomm[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    sizes = sorted({s for pts in lines.values() for s, _ in pts if s > 0})
    for label, pts in lines.items():
        pts = [(s, b) for s, b in pts if s > 0]
        if pts:
            ax.plot([s for s, _ in pts], [b for _, b in pts], marker="o", markersize=3.5, label=label)
    if memcpy_gbps:
        ax.axhline(memcpy_gbps, linestyle="--", color="gray",
                   label=f"memcpy, one core ({memcpy_gbps:.1f} GB/s)")
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes)
        ax.set_xticklabels([_size_label(s) for s in sizes], rotation=45)
    ax.set_xlabel("message size (bytes, nccl-tests' size column)")
    ax.set_ylabel("bus bandwidth (GB/s, out-of-place)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
