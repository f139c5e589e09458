"""The repository's promises about itself: what the wheel holds and which way imports point."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each folder is installed, and the project packages each may import.
PACKAGES = {
    "ringcomm/schedule": ("ringcomm.schedule", set()),
    "kernels": ("ringcomm.kernels", set()),
    "transport": ("ringcomm.transport", set()),
}


def _modules(folder: pathlib.Path):
    return sorted(p for p in folder.glob("*.py"))


@pytest.mark.timeout(300)
def test_wheel_holds_every_module(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(tmp_path.glob("ringcomm-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"ringcomm/{p.relative_to(ROOT / 'ringcomm')}" for p in (ROOT / "ringcomm").rglob("*.py")}
    expected |= {f"ringcomm/kernels/{p.name}" for p in _modules(ROOT / "kernels")}
    expected |= {f"ringcomm/transport/{p.name}" for p in _modules(ROOT / "transport")}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not any(n.startswith(("kernels/", "transport/")) for n in names), "generic top-level package"


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_dependencies_point_one_way(folder):
    """schedule imports nothing of the project; transport and kernels never import the core."""
    own = PACKAGES[folder][0]
    for path in _modules(ROOT / folder):
        for name in _imports(path):
            if name == "ringcomm" or name.startswith("ringcomm."):
                assert name.startswith(own), f"{path.relative_to(ROOT)} imports {name}"


def _core_imports(path: pathlib.Path, package: str):
    """The project modules ``path`` imports, at the top or late inside a function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                yield f"{package}.{node.module.split('.')[0]}"
            else:
                yield from (f"{package}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ringcomm."):
            yield ".".join(node.module.split(".")[:2])


def test_core_modules_import_no_circle():
    """comm, model, algorithms, device and init read one catalogue instead of each other."""
    graph = {f"ringcomm.{p.stem}": set(_core_imports(p, "ringcomm"))
             for p in _modules(ROOT / "ringcomm") if p.stem != "__init__"}
    state: dict = {}

    def visit(mod, path):
        if state.get(mod) == "done" or mod not in graph:
            return
        assert state.get(mod) != "open", "import circle: " + " -> ".join(path + [mod])
        state[mod] = "open"
        for dep in sorted(graph[mod]):
            visit(dep, path + [mod])
        state[mod] = "done"

    for mod in sorted(graph):
        visit(mod, [])
