"""An offline wheelhouse: every wheel ttt-bench needs beyond a GPU image's base stack, for one Python and one
platform, gathered on a machine with internet for a GPU node without it (docs/offline.md).

    python -m ttt_bench.wheelhouse --python 3.12 --platform manylinux_2_28_x86_64 --out wheelhouse

The requirements are pyproject.toml's (`project.dependencies`, the `--extras` and the build system, so that
`pip install -e .` works offline too), minus the base stack (`BASE`: a stock PyTorch GPU image has it) and
whatever only the base stack needs. pip resolves them for the target (wheels only), downloads them, builds
the pure-Python wheels of packages PyPI has only as sources (antlr4-python3-runtime, for Hydra), and the
toolkit's own wheel; MANIFEST.txt lists every file with its size and sha256 and the commands that install
from the folder with no network, SHA256SUMS checks a copy (`sha256sum -c SHA256SUMS`).

mamba-ssm and causal-conv1d (the `cuda` extra) are CUDA extensions that PyPI has only as sources, built
against the node's own torch: `--step mamba-sources` (online) adds their sources under src/ and the wheels
they need, `--step mamba-wheels` builds them where nvcc and the node's CUDA torch are (make mamba-wheels).
"""

import argparse
import email.parser
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import UserError

# What a stock PyTorch GPU image (NGC, the cluster's module) already has: never put in the wheelhouse, nor
# what only these need (CUDA libraries, sympy, jinja2, ...). Dependencies they share with the toolkit's
# other requirements (fsspec, packaging, PyYAML, ...) are in it: pip on the node keeps the image's version
# where it fits.
BASE = ("torch", "triton", "lightning", "numpy", "pandas", "matplotlib")
CUDA_EXTRA = "cuda"  # its packages other than BASE are built from source: --step mamba-sources / mamba-wheels
REPO = Path(__file__).resolve().parents[1]
MANIFEST, SUMS = "MANIFEST.txt", "SHA256SUMS"


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


# -- what the toolkit needs ---------------------------------------------------------------------------------


def pyproject() -> dict:
    """The pyproject.toml of the checkout this module runs from."""
    try:
        import tomllib
    except ModuleNotFoundError:
        raise UserError("building a wheelhouse needs Python >= 3.11 (tomllib) on the online machine"
                        ) from None
    path = REPO / "pyproject.toml"
    if not path.is_file():
        raise UserError(f"{path} not found: run python -m ttt_bench.wheelhouse from a checkout of ttt-bench")
    return tomllib.loads(path.read_text())


def requirements(project: dict, extras: Iterable[str]) -> list[str]:
    """pyproject's dependencies, those of `extras` and the build system's, without the base stack."""
    declared = project["project"].get("optional-dependencies", {})
    unknown = sorted(set(extras) - declared.keys())
    if unknown:
        raise UserError(f"--extras {','.join(unknown)}: ttt-bench's extras are {', '.join(declared)}")
    if CUDA_EXTRA in extras:
        raise UserError(f"the {CUDA_EXTRA} extra's mamba-ssm and causal-conv1d are built from source: leave "
                        "it out of --extras and run make mamba-wheels (docs/offline.md)")
    reqs = [*project["project"]["dependencies"], *(r for e in extras for r in declared[e]),
            *project["build-system"]["requires"]]
    return [r for r in reqs if _name(r) not in BASE]


def needed(roots: Iterable[str], requires: Callable[[str], list[str] | None], markers: dict,
           stop: Iterable[str] = BASE) -> dict[str, set[str]]:
    """Every package `roots` need on a machine with these environment markers, not looking into `stop` (the
    base stack: what only it needs is left out): canonical name -> the requirements (markers dropped) that
    ask for it, in the order found (pip's resolver depends on the order of its requirements: the roots keep
    pyproject's). `requires(name)` gives a package's Requires-Dist (None: unknown here)."""
    from packaging.requirements import Requirement

    stop, found, seen = set(stop), {}, set()
    todo = deque((Requirement(r), "") for r in roots)
    while todo:
        req, extra = todo.popleft()
        name = canonical(req.name)
        if name in stop or (req.marker and not req.marker.evaluate({**markers, "extra": extra})):
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        found.setdefault(name, set()).add(f"{req.name}{extras}{req.specifier}")
        for wanted in ("", *sorted(req.extras)):
            if (name, wanted) not in seen:
                seen.add((name, wanted))
                todo += [(Requirement(dep), wanted) for dep in requires(name) or []]
    return found


# -- the target machine -------------------------------------------------------------------------------------


def this_machine() -> tuple[str, str]:
    """This interpreter's Python version and manylinux platform (the defaults of --python and --platform)."""
    libc, version = platform.libc_ver()
    if platform.system() != "Linux" or libc != "glibc":
        raise UserError("this machine is not a glibc Linux: give the node's --python and --platform")
    glibc = version.replace(".", "_")
    return f"{sys.version_info[0]}.{sys.version_info[1]}", f"manylinux_{glibc}_{platform.machine()}"


def platform_tags(platform_tag: str) -> list[str]:
    """pip takes --platform literally, but a manylinux_2_28 machine also runs the wheels of older glibcs
    (manylinux_2_17 alias manylinux2014, ...), and a musllinux_1_2 one those of musl 1.1: all of them."""
    m = re.fullmatch(r"(manylinux|musllinux)_(\d+)_(\d+)_(\w+)", platform_tag)
    if not m:
        return [platform_tag]
    family, major, minor, arch = m[1], int(m[2]), int(m[3]), m[4]
    lowest = 5 if family == "manylinux" else 1
    tags = [f"{family}_{major}_{k}_{arch}" for k in range(minor, lowest - 1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"} if family == "manylinux" else {}
    return tags + [f"{alias}_{arch}" for glibc, alias in legacy.items() if glibc <= minor]


def target_markers(python: str, platform_tag: str) -> dict:
    """The environment markers of CPython `python` on a Linux `platform_tag` (pip evaluates markers for the
    interpreter it runs in, whatever --python-version says)."""
    m = re.fullmatch(r"(?:many|musl)?linux\w*?_(x86_64|aarch64|ppc64le|s390x|armv7l|i686)", platform_tag)
    if not (m and re.fullmatch(r"3\.\d+", python)):
        raise UserError(f"--python {python} --platform {platform_tag}: expected a version such as 3.12 and a "
                        "Linux wheel platform such as manylinux_2_28_x86_64")
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "implementation_version": f"{python}.0", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": m[1],
            "platform_release": "", "platform_version": ""}


def _target_args(python: str, platform_tag: str) -> list[str]:
    tags = [a for tag in platform_tags(platform_tag) for a in ("--platform", tag)]
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", *tags]


# -- pip ----------------------------------------------------------------------------------------------------


def pip(*args: str, env: dict | None = None, show: bool = False) -> None:
    """Run this interpreter's pip; a failure is a UserError with pip's first error line. `show`: pip's output
    goes to the console (long builds) instead of being kept for the error."""
    command = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(command, env=env, text=True, capture_output=not show)
    if done.returncode:
        errors = [ln for ln in (done.stderr or "").splitlines() if ln.startswith("ERROR")] or ["see above"]
        raise UserError(f"pip {args[0]} failed ({errors[0]}); the command: {' '.join(command)}")


def resolve(reqs: list[str], out: Path, target_args: list[str]) -> dict[str, dict]:
    """What pip would install for `reqs`, wheels in `out` included: canonical name -> its metadata."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "--find-links", str(out), *target_args, *reqs)
        items = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): {**i["metadata"], "url": i["download_info"]["url"]}
            for i in items}


def build_sdist_only(reqs: list[str], out: Path) -> None:
    """Wheels of the packages that PyPI has only as sources (found by resolving for this interpreter),
    built into `out`; each must be pure Python (it then runs on any target)."""
    for item in resolve(reqs, out, ["--prefer-binary"]).values():
        if item["url"].endswith(".whl"):
            continue
        name, version = item["name"], item["version"]
        print(f"building {name} {version} (no wheel on the index)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            pip("wheel", "--quiet", "--no-deps", "--wheel-dir", tmp, f"{name}=={version}")
            (wheel,) = Path(tmp).glob("*.whl")
            if not wheel.name.endswith("-none-any.whl"):
                raise UserError(f"{name} {version} has no wheel on the index and builds a compiled one "
                                f"({wheel.name}): build it on a machine like the node and put it in {out}")
            shutil.move(str(wheel), out / wheel.name)


def _requires_dist(items: dict[str, dict]) -> Callable[[str], list[str] | None]:
    """A package's requirements as `resolve` found them, None for a package it did not resolve."""
    return lambda name: items[name].get("requires_dist", []) if name in items else None


def fetch(reqs: list[str], out: Path, python: str, platform_tag: str) -> list[str]:
    """Download into `out` the wheels that `reqs` need on the target, less the base stack; returns them as
    name==version. pip resolves for the target's tags, `needed` keeps what the target's markers ask for
    (and adds what pip left out because the markers of the interpreter it runs in differ)."""
    markers, target_args = target_markers(python, platform_tag), _target_args(python, platform_tag)
    roots = [r for found in needed(reqs, lambda name: [], markers).values() for r in sorted(found)]
    build_sdist_only(roots, out)
    added: list[str] = []
    for _ in range(5):
        items = resolve(roots + added, out, target_args)
        wanted = needed(roots, _requires_dist(items), markers)
        missing = sorted(wanted.keys() - items.keys())
        if not missing:
            break
        added += [r for name in missing for r in sorted(wanted[name])]
    else:
        raise UserError(f"pip does not resolve {', '.join(missing)} for CPython {python} on {platform_tag}")
    pins = [f"{items[name]['name']}=={items[name]['version']}" for name in sorted(wanted)]
    print(f"downloading {len(pins)} wheels for CPython {python} on {platform_tag}", flush=True)
    pip("download", "--quiet", "--no-deps", "--dest", str(out), "--find-links", str(out), *target_args, *pins)
    return pins


def own_wheel(project: dict, out: Path) -> None:
    """ttt-bench's wheel, built from a copy of the checkout's sources (no build/ left in the checkout)."""
    with tempfile.TemporaryDirectory() as tmp:
        for folder in {"ttt_bench", *project["tool"]["setuptools"]["package-dir"].values()}:
            shutil.copytree(REPO / folder, Path(tmp) / folder, ignore=shutil.ignore_patterns("__pycache__"))
        for file in ("pyproject.toml", project["project"]["readme"]):
            shutil.copy(REPO / file, Path(tmp) / file)
        pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), tmp)


# -- the manifest -------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install_commands(project: dict, out: Path, folder: str) -> list[str]:
    """pip commands that install the toolkit from `folder` (= `out`) with no network, with every extra whose
    packages (other than the base stack) all have a wheel there: into the environment, editable from a
    checkout, and with --target for a read-only environment (--target ignores installed packages, so it
    installs the folder's wheels, no more)."""
    have = {canonical(w.name.split("-")[0]) for w in out.glob("*.whl")}
    extras = [extra for extra, reqs in project["project"].get("optional-dependencies", {}).items()
              if {_name(r) for r in reqs} - set(BASE) <= have]
    suffix = f"[{','.join(extras)}]" if extras else ""
    return [f'pip install --no-index --find-links {folder} "ttt-bench{suffix}"',
            f'pip install --no-index --find-links {folder} -e ".{suffix}"',
            f"pip install --no-index --no-deps --target DIR {folder}/*.whl && export PYTHONPATH=DIR "
            "PATH=DIR/bin:$PATH"]


def write_manifest(project: dict, out: Path, folder: str, built_for: str) -> tuple[int, int]:
    """MANIFEST.txt (every file with its size and sha256, and the install commands) and SHA256SUMS; returns
    the number of files and their bytes."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name not in (MANIFEST, SUMS))
    rows = [(_sha256(p), p.stat().st_size, p.relative_to(out).as_posix()) for p in files]
    size = sum(r[1] for r in rows)
    commands = install_commands(project, out, folder)
    written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# ttt-bench wheelhouse {built_for}, written {written}",
             f"# {len(rows)} files, {size / 1e6:.1f} MB; not in it: the base stack of a GPU image "
             f"({', '.join(BASE)}), which the node must have.",
             "# Install on the node, with no network (docs/offline.md):",
             f"#   {commands[0]}",
             f"#   {commands[1]}    (from a checkout of ttt-bench)",
             f"#   {commands[2]}    (read-only environment)",
             f"# Check a copy: cd {folder} && sha256sum -c {SUMS}",
             "# sha256 bytes file",
             *(f"{sha} {n} {name}" for sha, n, name in rows)]
    (out / MANIFEST).write_text("\n".join(lines) + "\n")
    (out / SUMS).write_text("".join(f"{sha}  {name}\n" for sha, _, name in rows))
    return len(rows), size


# -- the steps ----------------------------------------------------------------------------------------------


def wheels(out: Path, folder: str, python: str, platform_tag: str, extras: list[str]) -> tuple[int, int]:
    """The wheelhouse (see the module's docstring); returns its number of files and bytes."""
    project = pyproject()
    reqs = requirements(project, extras)
    out.mkdir(parents=True, exist_ok=True)
    fetch(reqs, out, python, platform_tag)
    own_wheel(project, out)
    return write_manifest(project, out, folder, f"for CPython {python} on {platform_tag}")


def _source_requirements(sdist: Path) -> tuple[list[str], list[str]]:
    """An sdist's run-time requirements (PKG-INFO's Requires-Dist) and build-system requirements."""
    import tomllib

    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        info = email.parser.Parser().parsestr(tar.extractfile(f"{top}/PKG-INFO").read().decode())
        build = tomllib.loads(tar.extractfile(f"{top}/pyproject.toml").read().decode())
    return info.get_all("Requires-Dist") or [], build["build-system"]["requires"]


def mamba_sources(out: Path, folder: str, python: str, platform_tag: str) -> tuple[int, int]:
    """Online: the sources of the cuda extra's packages under out/src, and the wheels they need to run and to
    build (einops, transformers, ninja, ...)."""
    project = pyproject()
    reqs = [r for r in project["project"]["optional-dependencies"][CUDA_EXTRA] if _name(r) not in BASE]
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    print(f"downloading the sources of {', '.join(reqs)}", flush=True)
    # pip reads each source's metadata, which imports torch (this environment's): no CUDA build for that
    env = {**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE"}
    pip("download", "--quiet", "--no-binary", ":all:", "--no-deps", "--no-build-isolation",
        "--dest", str(src), *reqs, env=env)
    built_from_source = {_name(r) for r in reqs}
    needs = [r for sdist in sorted(src.glob("*.tar.gz")) for part in _source_requirements(sdist) for r in part
             if _name(r) not in built_from_source]
    fetch(needs, out, python, platform_tag)
    return write_manifest(project, out, folder, f"for CPython {python} on {platform_tag}")


def mamba_wheels(out: Path, folder: str, cuda_arch: str) -> tuple[int, int]:
    """Where nvcc and the node's CUDA torch are (no network needed): the wheels of the sources under out/src,
    for `cuda_arch`, into `out`."""
    sources = sorted((out / "src").glob("*.tar.gz"))
    if not sources:
        raise UserError(f"no sources in {out / 'src'}: run make mamba-sources on a machine with internet")
    if shutil.which("nvcc") is None:
        raise UserError("nvcc not found: build the mamba wheels on a machine with the CUDA toolkit and the "
                        "node's CUDA build of torch (docs/offline.md)")
    import torch

    if torch.version.cuda is None:
        raise UserError(f"{sys.executable} has a CPU build of torch ({torch.__version__}): build with the "
                        "Python of the node's CUDA torch (make mamba-wheels NODE_PYTHON=...)")
    build = sorted({r for sdist in sources for r in _source_requirements(sdist)[1] if _name(r) not in BASE})
    pip("install", "--quiet", "--no-index", "--find-links", str(out), *build)  # as --no-build-isolation needs
    env = {**os.environ, "MAMBA_FORCE_BUILD": "TRUE", "CAUSAL_CONV1D_FORCE_BUILD": "TRUE",
           "TORCH_CUDA_ARCH_LIST": cuda_arch}
    pip("wheel", "--no-index", "--find-links", str(out), "--no-build-isolation", "--no-deps",
        "--wheel-dir", str(out), *map(str, sources), env=env, show=True)
    manifest = (out / MANIFEST).read_text() if (out / MANIFEST).is_file() else ""
    built_for = re.search(r"wheelhouse (for .*?), written", manifest)  # the wheels step's target
    return write_manifest(pyproject(), out, folder, built_for.group(1) if built_for else "for this machine")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ttt_bench.wheelhouse", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", help="the node's Python version, e.g. 3.12 (default: this interpreter's)")
    p.add_argument("--platform", help="the node's wheel platform, e.g. manylinux_2_28_x86_64 (default: "
                   "this machine's)")
    p.add_argument("--out", default="wheelhouse", help="the folder (default: wheelhouse)")
    p.add_argument("--extras", default="", help="extras of ttt-bench to include, comma-separated, e.g. slurm")
    p.add_argument("--step", choices=("wheels", "mamba-sources", "mamba-wheels"), default="wheels",
                   help="wheels (default), or the cuda extra: mamba-sources (online), mamba-wheels (nvcc)")
    p.add_argument("--cuda-arch", default="9.0", help="mamba-wheels: TORCH_CUDA_ARCH_LIST (default 9.0)")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        if a.step == "mamba-wheels":
            files, size = mamba_wheels(out, a.out, a.cuda_arch)
        else:
            here = (None, None) if a.python and a.platform else this_machine()
            python, platform_tag = a.python or here[0], a.platform or here[1]
            target_markers(python, platform_tag)  # a bad --python or --platform stops before any download
            if a.step == "wheels":
                files, size = wheels(out, a.out, python, platform_tag, [e for e in a.extras.split(",") if e])
            else:
                files, size = mamba_sources(out, a.out, python, platform_tag)
    except UserError as e:
        print(f"ttt-bench wheelhouse: error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {files} files, {size / 1e6:.1f} MB; how to install it on the node: {out / MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
