"""The offline wheelhouse (ttt_bench/wheelhouse.py, docs/offline.md), end to end: built here for this
machine's Python and platform, then installed with the commands its MANIFEST.txt gives, with pip's network
off (no index, no pip config, an unusable proxy), into a fresh virtual environment that then imports
ttt_bench, hydra and datasets and runs `ttt-bench --help` and `ttt-bench doctor`; and with the read-only
variant (--target and PYTHONPATH). The base stack is not in the wheelhouse, as on a GPU image: a fresh
environment sees this one's torch, lightning, numpy, pandas, matplotlib and what they need through one extra
site folder of symlinks to exactly those packages, so hydra, datasets and the rest can only come from the
wheelhouse."""

import base64
import csv
import hashlib
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import urllib.request
import zipfile
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


# The layout of mamba-ssm 2.3.2's and causal-conv1d 1.7.0's setup.py: an unconditional list, then more by
# nvcc version, then the flags in the CUDA compile arguments (make mamba-wheels patches it, no nvcc here).
FAKE_SETUP = '''import os
cc_flag = []
if HIP_BUILD:
    cc_flag.append("-DBUILD_PYTHON_PACKAGE")
else:
    check_if_cuda_home_none(PACKAGE_NAME)

    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_75,code=sm_75")
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_80,code=sm_80")
    if bare_metal_version >= Version("11.8"):
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_90,code=sm_90")
    if bare_metal_version >= Version("13.0"):
        cc_flag.append("-gencode")
        cc_flag.append('arch=compute_121,code=sm_121')
nvcc = [
    "-O3",
    "-lineinfo",
] + cc_flag
'''


def patched_flags(setup_py, hip=False, cuda="13.0"):
    """The nvcc flags that the (patched) fake setup.py computes."""
    version = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
    scope = {"HIP_BUILD": hip, "PACKAGE_NAME": "x", "check_if_cuda_home_none": lambda name: None,
             "bare_metal_version": version(cuda), "Version": version}
    exec(compile(setup_py.read_text(), str(setup_py), "exec"), scope)
    return scope["nvcc"]


@pytest.mark.parametrize(("arch", "flags"), [
    ("9.0", ["-gencode", "arch=compute_90,code=sm_90"]),
    ("8.0;9.0", ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]),
    ("8.6+PTX", ["-gencode", "arch=compute_86,code=sm_86", "-gencode", "arch=compute_86,code=compute_86"])])
def test_the_mamba_setup_py_is_patched_to_compile_for_one_architecture(tmp_path, arch, flags):
    setup_py = tmp_path / "setup.py"
    setup_py.write_text(FAKE_SETUP)
    assert patched_flags(setup_py)[2:] == ["-gencode", "arch=compute_75,code=sm_75", "-gencode",
                                           "arch=compute_80,code=sm_80", "-gencode",
                                           "arch=compute_90,code=sm_90", "-gencode",
                                           "arch=compute_121,code=sm_121"]
    wheelhouse.patch_setup(setup_py, arch, lineinfo=True)
    for cuda in ("11.7", "13.0"):  # the nvcc versions' branches add nothing now
        assert patched_flags(setup_py, cuda=cuda) == ["-O3", "-lineinfo", *flags]
    assert patched_flags(setup_py, hip=True) == ["-O3", "-lineinfo", "-DBUILD_PYTHON_PACKAGE"]
    assert "arch=compute_75" not in setup_py.read_text()
    with pytest.raises(wheelhouse.UserError, match="no cc_flag.append"):  # once only
        wheelhouse.patch_setup(setup_py, arch)
    setup_py.write_text(FAKE_SETUP)
    wheelhouse.patch_setup(setup_py, arch)  # the default: without -lineinfo (3/4 of the device code)
    assert patched_flags(setup_py) == ["-O3", *flags]


@pytest.mark.parametrize(("setup", "why"), [
    ('cc_flag = []\ncc_flag += ["-gencode", "arch=compute_90,code=sm_90"]\n', "no cc_flag.append"),
    (FAKE_SETUP.replace('    cc_flag.append("-gencode")\n    cc_flag.append("arch=compute_75,code=sm_75")\n'
                        '    cc_flag.append("-gencode")\n    cc_flag.append("arch=compute_80,code=sm_80")\n',
                        ""), "first -gencode pair is inside a block"),
    (FAKE_SETUP + 'nvcc += ["-gencode", "arch=compute_100,code=sm_100"]\n', "-gencode flags outside"),
])
def test_a_setup_py_of_another_layout_is_a_one_line_error_and_left_alone(tmp_path, capsys, setup, why):
    setup_py = tmp_path / "setup.py"
    setup_py.write_text(setup)
    with pytest.raises(wheelhouse.UserError, match=why) as error:
        wheelhouse.patch_setup(setup_py, "9.0")
    assert "\n" not in str(error.value) and "CUDA_ARCH=9.0" in str(error.value)
    assert setup_py.read_text() == setup
    with pytest.raises(wheelhouse.UserError, match="expected compute capabilities"):
        wheelhouse.arch_flags("sm_90")


def test_a_stripped_wheel_has_a_record_that_matches_its_files(tmp_path):
    """strip_wheel rewrites the wheel with the new hash and size of each file in RECORD."""
    if shutil.which("strip") is None or shutil.which("cc") is None:
        pytest.skip("no strip or cc here")
    (tmp_path / "x.c").write_text("int answer(void) { return 42; }\n")
    subprocess.run(["cc", "-g", "-shared", "-fPIC", "-o", str(tmp_path / "x.so"), str(tmp_path / "x.c")],
                   check=True)
    wheel = tmp_path / "x-1.0-cp312-cp312-linux_x86_64.whl"
    files = {"x.so": (tmp_path / "x.so").read_bytes(), "x-1.0.dist-info/METADATA": b"Name: x\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("x-1.0.dist-info/RECORD", "x.so,sha256=old,1\nx-1.0.dist-info/METADATA,,\n"
                   "x-1.0.dist-info/RECORD,,\n")
    before, after = wheelhouse.strip_wheel(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
        rows = list(csv.reader(z.read("x-1.0.dist-info/RECORD").decode().splitlines()))
        assert [r[0] for r in rows] == ["x.so", "x-1.0.dist-info/METADATA", "x-1.0.dist-info/RECORD"]
        for name, digest, size in rows[:2]:
            data = z.read(name)
            sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={sha}"
            assert int(size) == len(data)
        assert len(z.read("x.so")) < len(files["x.so"])
