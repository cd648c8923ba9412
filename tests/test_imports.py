"""The import structure of ttt_bench: the contracts of pyproject.toml's [tool.importlinter] (layers,
kernels/ a leaf, no cycles between sibling modules), and no import cycle between any two modules of the
package.

cli/ and kernels/ install under ttt_bench (pyproject's package-dir) but lie outside ttt_bench/ on disk, and
import-linter (grimp) scans the package's folder: the checks run on a copy of the sources laid out as
installed, in a subprocess whose path finds that copy first. grimp reads every import statement,
function-local ones included (the planted back-import below is one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e '.[dev]')")

import tomllib  # noqa: E402  (Python >= 3.11, as import-linter)

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as lint; sys.exit(lint())"

# the modules of the package and the cycles between them (strongly connected components of the import graph)
GRAPH = """
import json, sys
import grimp

graph = grimp.build_graph("ttt_bench", cache_dir=None)
modules = sorted(graph.modules)
index, low, stack, on_stack, cycles = {}, {}, [], set(), []
sys.setrecursionlimit(10_000)

def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.find_modules_directly_imported_by(v)):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while not component or component[-1] != v:
            component.append(stack.pop())
            on_stack.discard(component[-1])
        if len(component) > 1:
            cycles.append(sorted(component))

for m in modules:
    if m not in index:
        visit(m)
cycles.sort()
chains = [graph.find_shortest_chain(c[0], c[1]) + graph.find_shortest_chain(c[1], c[0])[1:] for c in cycles]
print(json.dumps({"modules": modules, "cycles": cycles, "chains": chains}))
"""


def installed_tree(root: Path) -> Path:
    """A copy of the package's .py files under root/, laid out as pyproject's package-dir installs them."""
    package_dir = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        target = root.joinpath(*package.split("."))
        for src in (REPO / folder).rglob("*.py"):
            dest = target / src.relative_to(REPO / folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(src.read_bytes())
    return root


def run(root: Path, *command: str) -> subprocess.CompletedProcess:
    """command with root first on the path and as the working directory (lint-imports puts it on the path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def lint(root: Path) -> tuple[dict[str, bool], str]:
    """Each contract's id -> kept, and lint-imports' report."""
    done = run(root, sys.executable, "-c", LINT_IMPORTS, str(PYPROJECT), "--no-cache", "--no-logo")
    report = done.stdout + done.stderr
    verdicts = {}
    for contract in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]:
        line = next((ln for ln in report.splitlines() if ln.startswith(f"{contract['name']} ")), "")
        assert line.endswith((" KEPT", " BROKEN")), report
        verdicts[contract["id"]] = line.endswith(" KEPT")
    assert (done.returncode == 0) == all(verdicts.values()), report
    return verdicts, report


def graph(root: Path) -> dict:
    done = run(root, sys.executable, "-c", GRAPH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return installed_tree(tmp_path_factory.mktemp("installed"))


def test_the_import_contracts_hold(tree):
    verdicts, report = lint(tree)
    assert all(verdicts.values()), report


def test_no_import_cycle_between_modules(tree):
    found = graph(tree)
    for module in ("ttt_bench.cli.main", "ttt_bench.kernels.ttt_linear", "ttt_bench.models.ttt.layer"):
        assert module in found["modules"]  # cli/ and kernels/ are seen where they install
    assert not found["cycles"], "\n".join(f"cycle among {', '.join(cycle)}, e.g. {' -> '.join(chain)}"
                                          for cycle, chain in zip(found["cycles"], found["chains"]))


def test_the_checks_catch_a_planted_back_import(tmp_path):
    """kernels/ importing the models (inside a function) breaks the leaf and layer contracts, and two modules
    importing each other are a cycle for both checks; the real tree is not touched."""
    root = installed_tree(tmp_path)
    kernels, models = root / "ttt_bench" / "kernels", root / "ttt_bench" / "models"
    (kernels / "planted.py").write_text("def f():\n    from ttt_bench.models.ttt import layer\n")
    (models / "planted_a.py").write_text("from . import planted_b\n")
    (models / "planted_b.py").write_text("def f():\n    from . import planted_a\n")
    verdicts, report = lint(root)
    assert not verdicts["kernels-leaf"] and not verdicts["layers"] and not verdicts["acyclic"], report
    assert "ttt_bench.kernels.planted -> ttt_bench.models.ttt.layer" in report
    assert "planted_a" in report and "planted_b" in report
    assert ["ttt_bench.models.planted_a", "ttt_bench.models.planted_b"] in graph(root)["cycles"]
