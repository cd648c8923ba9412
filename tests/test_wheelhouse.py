"""The offline wheelhouse (ttt_bench/wheelhouse.py, docs/offline.md), end to end: built here for this
machine's Python and platform, then installed with the commands its MANIFEST.txt gives, with pip's network
off (no index, no pip config, an unusable proxy), into a fresh virtual environment that then imports
ttt_bench, hydra and datasets and runs `ttt-bench --help` and `ttt-bench doctor`; and with the read-only
variant (--target and PYTHONPATH). The base stack is not in the wheelhouse, as on a GPU image: a fresh
environment sees this one's torch, lightning, numpy, pandas, matplotlib and what they need through one extra
site folder of symlinks to exactly those packages, so hydra, datasets and the rest can only come from the
wheelhouse."""

import importlib.metadata
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging.markers import default_environment

from tests.conftest import REPO
from ttt_bench import wheelhouse
from ttt_bench.wheelhouse import BASE, canonical, needed

PROXIES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")
OFFLINE = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           **dict.fromkeys(PROXIES, "http://127.0.0.1:9")}  # nothing listens on port 9


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request("https://pypi.org/simple/pip/", method="HEAD"),
                               timeout=10)
    except OSError:
        return False
    return True


def installed_requires(name: str) -> list[str] | None:
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return None


def base_site(folder: Path) -> Path:
    """Symlinks to the top-level files and folders (dist-info included) of this environment's base stack and
    of every package it needs, in one folder."""
    folder.mkdir()
    for name in needed(BASE, installed_requires, default_environment(), stop=()):
        if installed_requires(name) is None:
            continue
        dist = importlib.metadata.distribution(name)
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (folder / top).exists() and Path(dist.locate_file(top)).exists():
                (folder / top).symlink_to(dist.locate_file(top))
    return folder


def fresh_venv(path: Path, base: Path) -> Path:
    """A virtual environment of this Python with nothing installed, and `base` on its path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    (site / "base-stack.pth").write_text(f"{base}\n")
    return path / "bin" / "python"


def node_pip(command: str, python: Path) -> str:
    """A manifest's pip command run by this environment's pip for `python` (pip --python: as that
    environment's own pip would, without installing one), not compiling .pyc files (10 s here, and not what
    is tested)."""
    pip = f"{shlex.quote(sys.executable)} -m pip --python {python} install --no-compile"
    assert command.startswith("pip install ")
    return command.replace("pip install", pip, 1)


def run(command: list[str] | str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`command` offline, from outside the checkout, without this environment's settings."""
    base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    done = subprocess.run(command, cwd=cwd, env={**base_env, **OFFLINE, **env},
                          shell=isinstance(command, str), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheelhouse for this machine, its install commands, a base-stack folder and a scratch folder."""
    if not pypi_reachable():
        pytest.skip("PyPI is not reachable: the wheelhouse is downloaded from it")
    root = tmp_path_factory.mktemp("offline")
    out = root / "wheelhouse"
    done = subprocess.run([sys.executable, "-m", "ttt_bench.wheelhouse", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (out / "MANIFEST.txt").read_text().splitlines()
    commands = [ln.split("#   ", 1)[1].split("    (")[0] for ln in lines if ln.startswith("#   ")]
    return {"out": out, "commands": commands, "base": base_site(root / "base"), "root": root}


def test_the_manifest_lists_every_file_with_its_sha256_and_the_base_stack_is_left_out(built):
    out = built["out"]
    files = {p.name for p in out.iterdir()} - {"MANIFEST.txt", "SHA256SUMS"}
    listed = {ln.split()[-1] for ln in (out / "SHA256SUMS").read_text().splitlines()}
    assert files == listed
    subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=out, check=True)
    names = {canonical(f.split("-")[0]) for f in files}
    assert {"ttt-bench", "hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets"} <= names
    assert not names & {*BASE, "nvidia-cudnn-cu12", "sympy"}
    assert built["commands"][0] == f'pip install --no-index --find-links {out} "ttt-bench"'


def test_the_toolkit_installs_from_the_wheelhouse_with_no_network(built):
    root, base = built["root"], built["base"]
    python = fresh_venv(root / "venv", base)
    # before: the base stack is there, what the wheelhouse brings is not
    run([str(python), "-c", "from importlib.util import find_spec as found; "
         "assert all(map(found, ('torch', 'lightning', 'numpy', 'pandas', 'matplotlib'))); "
         "assert not any(map(found, ('hydra', 'datasets', 'ttt_bench')))"], cwd=root)
    run(node_pip(built["commands"][0], python), cwd=root)
    site = next((root / "venv").glob("lib/python*/site-packages"))
    installed = {canonical(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    dependencies = wheelhouse.pyproject()["project"]["dependencies"]
    expected = {wheelhouse._name(r) for r in dependencies} - set(BASE)
    assert expected | {"ttt-bench", "antlr4-python3-runtime", "omegaconf"} <= installed  # from the wheelhouse
    found = run([str(python), "-c", "import ttt_bench, hydra, datasets; print(ttt_bench.__file__)"], cwd=root)
    assert found.stdout.startswith(str(site))
    ttt_bench = root / "venv" / "bin" / "ttt-bench"
    assert "subcommands" in run([str(ttt_bench), "--help"], cwd=root).stdout
    doctor = run([str(ttt_bench), "doctor"], cwd=root, TTT_BENCH_DATA_DIR=str(root),
                 XDG_CACHE_HOME=str(root / "cache"), TTT_BENCH_CACHE=str(root / "cache"))
    assert "kernel paths" in doctor.stdout


def test_the_read_only_variant_installs_with_target_and_pythonpath(built):
    """--target ignores installed packages, so the manifest's command installs the wheelhouse's wheels, no
    more; a Python without pip that has only the base stack then runs the toolkit from that folder."""
    root, target = built["root"], built["root"] / "target"
    python = fresh_venv(root / "read-only", built["base"])
    command = node_pip(built["commands"][2].replace("DIR", str(target)), python)
    check = f"{python} -c 'import ttt_bench, hydra, datasets; print(ttt_bench.__file__)'"
    found = run(f"{command} && {check} && {python} -m ttt_bench.cli.main --help", cwd=root)
    assert str(target / "ttt_bench" / "__init__.py") in found.stdout and "subcommands" in found.stdout


def test_requirements_come_from_pyproject_without_the_base_stack():
    project = wheelhouse.pyproject()
    names = [wheelhouse._name(r) for r in wheelhouse.requirements(project, ["slurm"])]
    assert names == [wheelhouse._name(r) for r in [*project["project"]["dependencies"],
                                                   *project["project"]["optional-dependencies"]["slurm"],
                                                   *project["build-system"]["requires"]]
                     if wheelhouse._name(r) not in BASE]
    with pytest.raises(wheelhouse.UserError, match="make mamba-wheels"):
        wheelhouse.requirements(project, ["cuda"])


def test_the_walk_follows_the_target_not_this_interpreter():
    """pip evaluates markers for the interpreter it runs in; the walk evaluates them for the node's."""
    requires = {"a": ['tomli; python_version < "3.11"', "b[fast]"], "b": ['c; extra == "fast"', "torch"],
                "c": [], "tomli": []}.get
    for python, has_tomli in (("3.10", True), ("3.12", False)):
        found = needed(["a"], requires, wheelhouse.target_markers(python, "manylinux_2_28_x86_64"))
        assert set(found) == {"a", "b", "c"} | ({"tomli"} if has_tomli else set())  # torch: base stack
    assert wheelhouse.platform_tags("manylinux_2_28_x86_64")[-4:] == [
        "manylinux_2_5_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def test_the_mamba_wheels_need_their_sources_first(tmp_path, capsys):
    assert wheelhouse.main(["--step", "mamba-wheels", "--out", str(tmp_path)]) == 2
    assert "no sources in" in capsys.readouterr().err
