"""docs/architecture.md is the map of the package, and stays current (issue 51): every module or package it
names by its path from the repository root, in backticks (`ttt_bench/flops.py`, `ttt_bench/models/`,
`cli/main.py`, `scripts/gpu_queue.sh`), exists; and every module and package of ttt_bench/ is named there."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
ROOTS = ("ttt_bench", "cli", "kernels", "scripts")  # the folders whose paths the page's names are checked in
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(ROOTS)})/[\w./-]*)")


def named_paths(text: str) -> set[str]:
    """The paths named in backticks, without a trailing slash or full stop (`ttt_bench/models/` -> the
    folder ttt_bench/models)."""
    spans = re.findall(r"`([^`\n]+)`", text)
    return {m.rstrip("./") for span in spans for m in PATH.findall(span)}


def package_modules() -> list[str]:
    """Every module of ttt_bench/ and every package in it (its folder), as paths from the repository root."""
    names = []
    for path in sorted((REPO / "ttt_bench").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(REPO)
        names.append((rel.parent if path.name == "__init__.py" else rel).as_posix())
    return names


def test_the_convention_finds_paths_in_backticks_only():
    text = "`ttt_bench/flops.py`, `ttt_bench/models/`, `cli/main.py`: x; ttt_bench/io.py, `ttt_bench.kernels`"
    assert named_paths(text) == {"ttt_bench/flops.py", "ttt_bench/models", "cli/main.py"}


@pytest.mark.parametrize("name", sorted(named_paths(PAGE.read_text())))
def test_every_path_the_page_names_exists(name):
    assert (REPO / name).exists(), f"docs/architecture.md names `{name}`, which is not in the repository"


def test_every_module_and_package_of_ttt_bench_is_named():
    named = named_paths(PAGE.read_text())
    missing = [m for m in package_modules() if m not in named]
    assert "ttt_bench/models/cost.py" in package_modules()  # the walk sees nested modules
    assert not missing, ("docs/architecture.md's Modules table lacks "
                         + ", ".join(f"`{m}`" for m in missing) + ": add a row for each")
