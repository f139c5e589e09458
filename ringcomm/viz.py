"""`ringcomm-viz`: draw a collective's schedule stage by stage, as SVG, PNG or an animated HTML page.

    ringcomm-viz all_reduce --algo ring -n 4 --out ring.html     (or .svg, .png)

Each panel is one stage of the cost model (schedule/cost.py: a step's declared stage, or its
depth in the dataflow): the ranks on a circle and, for every message of the stage, an arrow
from sender to receiver labelled with the chunks it carries and a strip coloured by the ranks
whose contributions are in it (from a symbolic run, schedule/simulate.py). The HTML page is
self-contained (no network): it plays the stages one after another over a filmstrip of all of
them. SVG and HTML are written by hand; PNG needs matplotlib.
"""
from __future__ import annotations

import argparse
import html
import math
import sys
from collections import defaultdict

from . import algorithms
from .schedule import peer_read
from .schedule.cost import messages
from .schedule.trace import TracingSim

W, H, R = 260, 250, 88  # panel size and the radius of the ranks' circle


def frames(collective: str, algo: str, n: int, root: int | None = None) -> list[dict]:
    """[{stage, msgs: [(src, dst, [chunks], sorted contributing ranks)]}] in stage order."""
    if collective in algorithms.ROOTED and root is None:
        root = 0
    scheds = algorithms.schedules(collective, algo, n, root)
    m = messages(scheds, 1)
    order = defaultdict(list)  # (a, b) -> stage of each send, in FIFO order
    for (a, b, stage), steps in sorted(m.items.items()):
        order[a, b] += [(i, stage) for i in steps]
    sim = _Recording(scheds, 1 << 30, 1, 1)
    sim.run()
    grouped = defaultdict(lambda: ([], set()))
    sent = defaultdict(int)
    for a, b, chunk, ranks, *read in sim.sent:
        if read:  # b read a's registered buffer: the stage is the read's own (peer_read.stage)
            stage = read[0]
        else:
            stages = sorted(order[a, b])  # a's sends to b in step order, as the FIFO carries them
            stage = stages[sent[a, b]][1]
            sent[a, b] += 1
        chunks, who = grouped[stage, a, b]
        chunks.append(chunk)
        who.update(ranks)
    out = defaultdict(list)
    for (stage, a, b), (chunks, who) in sorted(grouped.items()):
        out[stage].append((a, b, chunks, sorted(who)))
    return [{"stage": s, "msgs": out[s]} for s in sorted(out)]


class _Recording(TracingSim):
    def __init__(self, *args):
        self.sent = []
        super().__init__(*args)

    def _compute(self, st, step):
        me, index, sched = st.sched.rank, st.index, st.sched
        super()._compute(st, step)
        for b in step.dst:
            self.sent.append((me, b, step.chunk, sorted(self.conn(me, b).queue[-1].value.ranks)))
        if step.reads:  # an arrow from each peer whose registered buffer this step read
            cell = me % sched.nchunks if sched.out_layout == "own" else step.chunk
            value = self.outputs[0][me][cell]
            for q in step.remote:
                if q != me:
                    ranks = [q] if step.reads == "in" else sorted(value.ranks)
                    self.sent.append((q, me, step.chunk, ranks, peer_read.stage(sched, index)))
        if step.writes:  # an arrow to each peer whose buffer this step wrote into
            for q in step.remote:
                self.sent.append((me, q, step.chunk, [me], peer_read.stage(sched, index)))


def color(r: int, n: int) -> str:
    return f"hsl({round(360 * r / max(n, 1))},70%,48%)"


def _pos(r, n, cx, cy):
    a = 2 * math.pi * r / n - math.pi / 2
    return cx + R * math.cos(a), cy + R * math.sin(a)


def panel_svg(frame: dict, n: int, title: str, marker: str = "arrow") -> str:
    """One stage as an SVG <g> of size W x H; ``marker`` is the id of its arrowhead (see _defs)."""
    cx, cy = W / 2, H / 2 + 12
    parts = [f'<rect width="{W}" height="{H}" rx="8" fill="#fafafa" stroke="#ccc"/>',
             f'<text x="10" y="20" font-size="14" font-weight="bold">{html.escape(title)}</text>']
    for a, b, chunks, who in frame["msgs"]:
        (x1, y1), (x2, y2) = _pos(a, n, cx, cy), _pos(b, n, cx, cy)
        bend = 0.18 if n > 2 else 0.35  # curve both ways so a->b and b->a do not overlap
        mx, my = (x1 + x2) / 2 - (y2 - y1) * bend, (y1 + y2) / 2 + (x2 - x1) * bend
        parts.append(f'<path d="M{x1:.1f},{y1:.1f} Q{mx:.1f},{my:.1f} {x2:.1f},{y2:.1f}" fill="none" '
                     f'stroke="#555" stroke-width="1.6" marker-end="url(#{marker})"/>')
        lx, ly = (x1 + 2 * mx + x2) / 4, (y1 + 2 * my + y2) / 4
        w = 6 * len(who)
        for k, q in enumerate(who):
            parts.append(f'<rect x="{lx - w / 2 + 6 * k:.1f}" y="{ly - 9:.1f}" width="6" height="7" '
                         f'fill="{color(q, n)}"/>')
        label = ",".join(f"c{c}" for c in chunks[:4]) + ("..." if len(chunks) > 4 else "")
        parts.append(f'<text x="{lx:.1f}" y="{ly + 9:.1f}" font-size="9" text-anchor="middle">{label}</text>')
    for r in range(n):
        x, y = _pos(r, n, cx, cy)
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="13" fill="{color(r, n)}" stroke="#222"/>'
                     f'<text x="{x:.1f}" y="{y + 4:.1f}" font-size="11" text-anchor="middle" '
                     f'fill="white" font-weight="bold">{r}</text>')
    return "\n".join(parts)


def _defs(marker: str = "arrow") -> str:
    """The arrowhead. An HTML page holds many SVGs: each needs its own id, since a marker inside a
    hidden SVG is not drawn and ids are looked up document-wide."""
    return (f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="22" refY="5" markerWidth="8" '
            f'markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/>'
            f'</marker></defs>')


def svg(fr: list[dict], n: int, heading: str, cols: int = 4) -> str:
    """Every stage, left to right and top to bottom, in one SVG document."""
    rows = max(1, math.ceil(len(fr) / cols))
    width, height = cols * (W + 10) + 10, rows * (H + 10) + 40
    body = [f'<g transform="translate({10 + (i % cols) * (W + 10)},{40 + (i // cols) * (H + 10)})">'
            f'{panel_svg(f, n, _title(i, f, len(fr)))}</g>' for i, f in enumerate(fr)]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif">{_defs()}<text x="10" y="26" font-size="18">{html.escape(heading)}</text>'
            + "\n".join(body) + "</svg>\n")


def _title(i, f, total):
    return f"step {i + 1}/{total} (stage {f['stage']}): {len(f['msgs'])} msg"


def page(fr: list[dict], n: int, heading: str) -> str:
    """A self-contained HTML page: the current stage large, played in a loop, over a filmstrip."""
    def one(i, f, where):
        marker = f"arrow-{where}-{i}"
        return (f'<svg class="frame" data-i="{i}" viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg" '
                f'font-family="sans-serif">{_defs(marker)}{panel_svg(f, n, _title(i, f, len(fr)), marker)}</svg>')
    big = "".join(one(i, f, "big") for i, f in enumerate(fr))
    strip = "".join(one(i, f, "strip") for i, f in enumerate(fr))
    legend = "".join(f'<span class="key" style="background:{color(r, n)}">rank {r}</span>' for r in range(n))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(heading)}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; }}
#stage svg {{ width: 420px; height: 404px; }}
#strip svg {{ width: 200px; height: 192px; margin: 3px; border: 3px solid transparent; }}
#strip svg.now {{ border-color: #e67e22; }}
#stage svg.frame {{ display: none; }} #stage svg.frame.now {{ display: inline; }}
.key {{ color: white; padding: 2px 6px; margin-right: 4px; border-radius: 3px; font-size: 12px;
        white-space: nowrap; display: inline-block; }}
</style></head><body>
<h2>{html.escape(heading)}</h2>
<p>Arrows are the messages of one stage, labelled with their chunks; the coloured strip on an arrow
shows whose contributions it carries. {legend}</p>
<p><button id="play">pause</button> <button id="prev">&larr;</button> <button id="next">&rarr;</button>
<span id="label"></span></p>
<div id="stage">{big}</div>
<h3>All stages (click one; #step=N or #step=last in the address shows it)</h3><div id="strip">{strip}</div>
<script>
const big = document.querySelectorAll('#stage svg.frame'), small = document.querySelectorAll('#strip svg.frame');
let i = 0, timer = null;
function show(k) {{
  i = (k + big.length) % big.length;
  big.forEach((e, j) => e.classList.toggle('now', j === i));
  small.forEach((e, j) => e.classList.toggle('now', j === i));
  document.getElementById('label').textContent = 'step ' + (i + 1) + ' of ' + big.length;
}}
function play() {{ timer = setInterval(() => show(i + 1), 1200); }}
document.getElementById('play').onclick = e => {{
  if (timer) {{ clearInterval(timer); timer = null; e.target.textContent = 'play'; }}
  else {{ play(); e.target.textContent = 'pause'; }} }};
document.getElementById('prev').onclick = () => show(i - 1);
document.getElementById('next').onclick = () => show(i + 1);
small.forEach((e, j) => e.onclick = () => show(j));
const m = /step=(\\d+|last)/.exec(location.hash);
show(m ? (m[1] === 'last' ? big.length - 1 : parseInt(m[1]) - 1) : 0);
if (!m) play();
</script></body></html>
"""


def png(fr: list[dict], n: int, heading: str, path: str, cols: int = 4) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch
    except ImportError as e:  # absent, or installed but broken (a dependency missing): say which
        raise SystemExit(f"ringcomm-viz: PNG output needs matplotlib, which did not import ({e}); pip "
                         f"install matplotlib, or the 'bench' extra. SVG and HTML need nothing") from None
    rows = max(1, math.ceil(len(fr) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    rgb = [matplotlib.colors.hsv_to_rgb((r / max(n, 1), 0.75, 0.85)) for r in range(n)]
    for ax in axes.flat:
        ax.set_axis_off()
        ax.set_xlim(0, W)
        ax.set_ylim(H, 0)
    for i, f in enumerate(fr):
        ax = axes.flat[i]
        ax.set_title(_title(i, f, len(fr)), fontsize=8)
        for a, b, chunks, who in f["msgs"]:
            p1, p2 = _pos(a, n, W / 2, H / 2), _pos(b, n, W / 2, H / 2)
            ax.add_patch(FancyArrowPatch(p1, p2, connectionstyle="arc3,rad=0.2", arrowstyle="-|>",
                                         mutation_scale=10, color=rgb[who[0]] if len(who) == 1 else "0.35"))
            ax.text((p1[0] + p2[0]) / 2, (p1[1] + p2[1]) / 2, ",".join(f"c{c}" for c in chunks[:3]), fontsize=6)
        for r in range(n):
            x, y = _pos(r, n, W / 2, H / 2)
            ax.add_patch(plt.Circle((x, y), 13, color=rgb[r]))
            ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=8)
    fig.suptitle(heading)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _register_from(source: str, collective: str, name, n: int, root) -> str:
    """Load FUNC from FILE.py:FUNC or MODULE:FUNC and register it for ``collective`` (as
    register_algorithm does, which verifies it first); return the name it was registered under."""
    import importlib
    import runpy

    from .schedule.lang import Program, program_builder
    where, _, func_name = source.rpartition(":")
    if not where or not func_name:
        raise ValueError("expected FILE.py:FUNC or MODULE:FUNC")
    space = runpy.run_path(where, run_name="ringcomm_viz_source") if where.endswith(".py") else \
        vars(importlib.import_module(where))
    if func_name not in space:
        raise AttributeError(f"{where} has no {func_name!r}")
    func = space[func_name]
    rooted = collective in algorithms.ROOTED
    try:    # make(n[, root]) -> Program, or a builder(rank, n[, root]) -> Schedule?
        made = func(n, 0 if root is None else root) if rooted else func(n)
    except TypeError:
        made = None
    builder = program_builder(func) if isinstance(made, Program) else func
    name = name or func_name
    algorithms.register_algorithm(name, collective, builder)
    return name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ringcomm-viz", description=__doc__.splitlines()[0])
    p.add_argument("collective", choices=algorithms.COLLECTIVES)
    p.add_argument("--algo", help="an algorithm name (ringcomm.algorithms.algorithms; default ring)")
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--root", type=int, default=None)
    p.add_argument("--out", required=True, help="FILE.svg, FILE.png or FILE.html")
    p.add_argument("--from", dest="source", metavar="FILE.py:FUNC",
                   help="draw your own algorithm: FUNC of FILE.py (or of a module, MODULE:FUNC), a builder(rank, "
                        "n[, root]) returning a Schedule or a make(n[, root]) returning a Program (schedule/lang.py); "
                        "registered as --algo's name (default: FUNC's)")
    p.set_defaults(algo=None)
    a = p.parse_args(argv)
    if a.source:
        try:
            a.algo = _register_from(a.source, a.collective, a.algo, a.ranks, a.root)
        except (OSError, ImportError, AttributeError, TypeError, ValueError) as e:
            p.error(f"--from {a.source}: {type(e).__name__}: {e}")
    a.algo = a.algo or "ring"
    try:
        fr = frames(a.collective, a.algo, a.ranks, a.root)
    except ValueError as e:
        p.error(str(e))
    heading = f"{a.collective} / {a.algo} on {a.ranks} ranks" + (f", root {a.root}" if a.root is not None else "")
    ext = a.out.rsplit(".", 1)[-1].lower()
    if ext == "png":
        png(fr, a.ranks, heading, a.out)
    elif ext in ("svg", "html", "htm"):
        with open(a.out, "w") as f:
            f.write(svg(fr, a.ranks, heading) if ext == "svg" else page(fr, a.ranks, heading))
    else:
        p.error(f"--out must end in .svg, .png or .html, got {a.out!r}")
    print(f"wrote {a.out}: {len(fr)} stages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
