"""ringcomm-viz: frames from the schedule, SVG / PNG / HTML output, the HTML page in headless Chromium."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import pytest

from ringcomm import viz

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def test_frames_follow_the_ring():
    fr = viz.frames("all_reduce", "ring", 4)
    assert [f["stage"] for f in fr] == list(range(6))
    assert all(len(f["msgs"]) == 4 for f in fr)
    assert fr[0]["msgs"][0] == (0, 1, [3], [0])            # rank 0 starts with chunk 3, its own
    assert all(who == [0, 1, 2, 3] for *_, who in fr[-1]["msgs"])  # the all-gather half: full sums
    assert [len(who) for *_, who in fr[2]["msgs"]] == [3, 3, 3, 3]


def test_frames_group_a_stage_into_one_message():
    """Rabenseifner on 8 ranks: 3 halving + 3 doubling stages, one message per rank and stage."""
    fr = viz.frames("all_reduce", "rabenseifner", 8)
    assert len(fr) == 6 and all(len(f["msgs"]) == 8 for f in fr)
    assert [len(fr[s]["msgs"][0][2]) for s in range(6)] == [4, 2, 1, 1, 2, 4]  # chunks per message


def test_frames_of_bruck_all_to_all_and_binomial_gather():
    """Bruck on 4 ranks: stage k sends r + 2^k the blocks (s, d) whose distance has bit k set,
    including one that arrived in stage 0; binomial gather: one message per edge, subtrees whole."""
    fr = viz.frames("all_to_all", "bruck", 4)
    assert [f["stage"] for f in fr] == [0, 1]
    assert fr[0]["msgs"][0] == (0, 1, [1, 3], [0])          # blocks 0->1, 0->3: distances 1 and 3
    assert fr[1]["msgs"][0] == (0, 2, [2, 14], [0, 3])      # 0->2, and 3->2 forwarded from rank 3
    fr = viz.frames("gather", "binomial", 5, 1)
    assert [[(a, b, c) for a, b, c, _ in f["msgs"]] for f in fr] == [
        [(2, 1, [2]), (4, 3, [4])], [(3, 1, [3, 4])], [(0, 1, [0])]]


def test_svg_and_html_are_well_formed(tmp_path):
    out = tmp_path / "tree.svg"
    assert viz.main(["broadcast", "--algo", "binomial", "-n", "5", "--root", "2", "--out", str(out)]) == 0
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg") and len(root.findall("{http://www.w3.org/2000/svg}g")) == 3
    page = tmp_path / "ring.html"
    viz.main(["all_gather", "--algo", "bruck", "-n", "6", "--out", str(page)])
    text = page.read_text()
    assert text.count('class="frame"') == 2 * 3  # the large view and the filmstrip
    ids = re.findall(r'marker id="([^"]+)"', text)
    assert len(ids) == len(set(ids)) == 6
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained
    with pytest.raises(SystemExit):
        viz.main(["all_reduce", "--out", str(tmp_path / "x.gif")])
    with pytest.raises(SystemExit):
        viz.main(["all_reduce", "--algo", "nope", "--out", str(tmp_path / "x.svg")])


def test_your_own_algorithm_from_a_file(tmp_path):
    """--from FILE.py:FUNC draws an algorithm of your own: the example's bidirectional ring (a make(n)
    returning a Program), and a builder(rank, n) returning Schedules, each registered under a name."""
    import pathlib
    from ringcomm import algorithms
    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "bidirectional_ring.py"
    out = tmp_path / "bidir.svg"
    try:
        assert viz.main(["all_reduce", "--from", f"{example}:bidirectional_ring", "--algo", "bidir",
                         "-n", "4", "--out", str(out)]) == 0
        assert "bidir" in algorithms.algorithms("all_reduce")
        assert "all_reduce / bidir on 4 ranks" in out.read_text()
        mine = tmp_path / "mine.py"
        mine.write_text("from ringcomm.schedule.ring import ring_all_reduce\n"
                        "def my_ring(rank, n):\n    return ring_all_reduce(rank, n)\n")
        assert viz.main(["all_reduce", "--from", f"{mine}:my_ring", "-n", "3", "--out", str(out)]) == 0
        assert "all_reduce / my_ring on 3 ranks" in out.read_text()
        with pytest.raises(SystemExit):
            viz.main(["all_reduce", "--from", f"{mine}:missing", "--out", str(out)])
    finally:
        for name in ("bidir", "my_ring"):
            if name in algorithms.algorithms("all_reduce"):
                algorithms.unregister_algorithm(name, "all_reduce")


def test_png(tmp_path):
    pytest.importorskip("matplotlib", reason="PNG output needs matplotlib")
    out = tmp_path / "r.png"
    viz.main(["reduce_scatter", "--algo", "halving", "-n", "4", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_script_is_declared():
    import tomllib
    import pathlib
    doc = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert doc["project"]["scripts"]["ringcomm-viz"] == "ringcomm.viz:main"


def _chromium(url, *extra, timeout=90):
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(240)
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_html_animates_in_headless_chromium(tmp_path):
    page = tmp_path / "ring.html"
    viz.main(["all_reduce", "--algo", "ring", "-n", "4", "--out", str(page)])
    # the page's script ran: it shows the step the address asks for, then plays on from step 1
    dom = _chromium(f"file://{page}#step=last", "--virtual-time-budget=500", "--dump-dom").stdout
    assert "step 6 of 6" in dom and dom.count('class="frame now"') == 2
    played = _chromium(f"file://{page}", "--virtual-time-budget=3000", "--dump-dom").stdout
    assert re.search(r"step [2-6] of 6", played), "the animation did not advance"
    shot = tmp_path / "viz.png"
    out = _chromium(f"file://{page}#step=last", "--window-size=1400,1000", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 20_000, out.stderr[-2000:]
    pytest.importorskip("matplotlib", reason="reading the screenshot's pixels needs matplotlib")
    import matplotlib.image
    img = matplotlib.image.imread(str(shot))
    assert img.shape[:2] == (1000, 1400)
    colourful = ((img[..., :3].max(axis=2) - img[..., :3].min(axis=2)) > 0.3).mean()
    assert colourful > 0.005, "the ranks' colours should be on the screenshot"


def test_cli_entry_runs_as_module(tmp_path):
    out = tmp_path / "a.svg"
    r = subprocess.run([sys.executable, "-m", "ringcomm.viz", "reduce", "--algo", "tree", "-n", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "stages" in r.stderr and out.exists()
