"""Every ```python block in docs/*.md runs: each page's blocks in order, in one fresh process."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: pathlib.Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_every_deep_dive_has_code():
    names = [p.name for p in PAGES]
    for want in ("01_ring_all_reduce.md", "02_trees.md", "03_cost_model.md", "04_your_own_algorithm.md",
                 "05_reproducible_sums.md"):
        assert want in names
        assert blocks(DOCS / want), f"{want} has no python block"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_code_blocks_run(page, tmp_path):
    code = blocks(page)
    # one script, each block marked so a failure names it
    script = "\n".join(f"# ---- block {i + 1} of {page.name}\n{c}" for i, c in enumerate(code))
    path = tmp_path / f"{page.stem}.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=170,
                         cwd=tmp_path)
    assert out.returncode == 0, f"{page.name}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
