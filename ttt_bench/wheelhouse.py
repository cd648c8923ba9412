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
against the node's own torch: `--step mamba-wheels --build-venv` (online, nvcc, no GPU: make mamba-wheels)
builds them for one GPU architecture in a virtual environment of its own with PyPI's CUDA build of the node's
torch; or `--step mamba-sources` (online) adds their sources under src/ and the wheels they need, and
`--step mamba-wheels` builds them with an interpreter that has the node's CUDA torch (NODE_PYTHON=).
"""

import argparse
import base64
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
import zipfile
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


# -- mamba-ssm and causal-conv1d: their wheels, for one GPU architecture ------------------------------------

# The gencode pairs of mamba-ssm's and causal-conv1d's setup.py (sm_75 ... sm_121 by nvcc version): every
# .cu file is compiled once per architecture, 9 times with nvcc 13, where a node needs one.
GENCODE = re.compile(r"^(?P<indent>[ \t]*)cc_flag\.append\(\s*[\"']-gencode[\"']\s*\)[ \t]*\n"
                     r"[ \t]*cc_flag\.append\(\s*[\"']arch=compute_\w+,code=\w+[\"']\s*\)[ \t]*$", re.M)
PATCHED = "# ttt-bench: CUDA_ARCH"
# nvcc's -lineinfo (line tables and the PTX text in every cubin, for profilers' source view) is 3/4 of the
# device code: mamba-ssm 2.3.2's selective_scan .so is 38 MB for sm_90 with it. Dropped unless asked for.
LINEINFO = re.compile(r"^[ \t]*[\"']-lineinfo[\"'],[ \t]*\n", re.M)
DEFAULT_PINS = ("mamba-ssm==2.3.2.post1", "causal-conv1d==1.7.0")


def arch_flags(cuda_arch: str) -> list[str]:
    """nvcc's -gencode flags for a TORCH_CUDA_ARCH_LIST such as "9.0", "8.0;9.0" or "8.6+PTX" (PTX too)."""
    flags = []
    for arch in filter(None, re.split(r"[;,\s]+", cuda_arch)):
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", arch)
        if not m:
            raise UserError(f"CUDA_ARCH={cuda_arch}: expected compute capabilities such as 9.0, 8.0;9.0 or "
                            "8.6+PTX")
        sm = f"{m[1]}{m[2]}{m[3]}"
        flags += ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
        if m[4]:
            flags += ["-gencode", f"arch=compute_{sm},code=compute_{sm}"]
    if not flags:
        raise UserError("CUDA_ARCH is empty: give compute capabilities such as 9.0 (H100) or 8.0 (A100)")
    return flags


def patch_setup(setup_py: Path, cuda_arch: str, lineinfo: bool = False) -> None:
    """Make an sdist's setup.py compile for `cuda_arch` only: its first, unconditional cc_flag -gencode pair
    becomes the flags of `cuda_arch`, the others `pass`. A setup.py without that pattern, whose first pair is
    inside an `if`, or with a -gencode left over is a UserError. Without `lineinfo`, its "-lineinfo" nvcc
    flag (a line of its own in a list) goes too, where it has one."""
    text = setup_py.read_text()
    if not lineinfo:
        text, dropped = LINEINFO.subn("", text)
        if not dropped and "-lineinfo" in text:
            print(f"{setup_py}: -lineinfo not on a line of its own: left in", flush=True)
    pairs = list(GENCODE.finditer(text))
    why = None
    if not pairs:
        why = "no cc_flag.append(\"-gencode\") + cc_flag.append(\"arch=compute_XX,code=sm_XX\") lines"
    else:
        before = [ln for ln in text[:pairs[0].start()].splitlines() if ln.strip() and
                  not ln.lstrip().startswith("#")]
        if before and before[-1].rstrip().endswith(":"):
            why = "its first -gencode pair is inside a block (expected it unconditional)"
    if why is None:
        flags = arch_flags(cuda_arch)
        parts, last = [], 0
        for i, m in enumerate(pairs):
            line = f"cc_flag += {flags!r}" if i == 0 else "pass"
            parts += [text[last:m.start()], f"{m['indent']}{line}  {PATCHED}={cuda_arch}"]
            last = m.end()
        text = "".join(parts) + text[last:]
        if re.search(r"arch=compute_|-gencode", text.replace(repr(flags), "")):
            why = "-gencode flags outside the cc_flag.append pairs"
    if why is not None:
        raise UserError(f"{setup_py}: {why}; cannot restrict it to CUDA_ARCH={cuda_arch} (its layout "
                        "changed: update GENCODE in ttt_bench/wheelhouse.py)")
    setup_py.write_text(text)


def find_python(version: str, given: str | None = None) -> str:
    """A working interpreter of CPython `version` (e.g. 3.12): `given`, else pythonX.Y on PATH, else pyenv's
    (a pyenv shim for a version that is not selected fails, hence the check)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(pyenv.glob(f"{version}.*/bin/python{version}"),
                   key=lambda p: [int(x) if x.isdigit() else -1 for x in re.split(r"[.]", p.parts[-3])])
    candidates = [given] if given else [shutil.which(f"python{version}"), *map(str, reversed(found))]
    for python in filter(None, candidates):
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == version:
            return python
    raise UserError(f"no working Python {version} found{f' ({given})' if given else ' (PATH, pyenv)'}: give "
                    f"one with BUILD_PYTHON=/path/to/python{version} (the node's Python version)")


def run_pip(python: str, *args: str, env: dict | None = None, log: bool = False) -> None:
    """`python -m pip ...`: a failure is a UserError with pip's first error line; `log`: pip's output goes to
    the console, each line after the minutes:seconds since the start (long builds)."""
    command, t0 = [python, "-m", "pip", *args], time.monotonic()
    if not log:
        done = subprocess.run(command, env=env, text=True, capture_output=True)
        returncode, lines = done.returncode, (done.stderr or "").splitlines()
    else:
        lines = deque(maxlen=200)
        with subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              errors="replace") as proc:
            for line in proc.stdout:
                s = int(time.monotonic() - t0)
                print(f"[{s // 60:3d}:{s % 60:02d}] {line}", end="", flush=True)
                lines.append(line.rstrip())
        returncode = proc.returncode
    if returncode:
        errors = [ln for ln in lines if ln.lstrip().startswith(("ERROR", "error:"))] or ["see above"]
        raise UserError(f"pip {args[0]} failed ({errors[0].strip()}); the command: {' '.join(command)}")


def build_env(folder: Path, base_python: str, torch: str) -> str:
    """A virtual environment in `folder` of `base_python` with the node's torch (PyPI's Linux wheel of torch
    2.11 is its CUDA 13.0 build, with its nvidia-* libraries and headers) and what building the sdists needs;
    made once and reused (folder/.ready names its torch; one of another Python version is made again).
    Returns its python."""
    python, ready = folder / "bin" / "python", folder / ".ready"
    version = subprocess.run([base_python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    cfg = folder / "pyvenv.cfg"
    same = rf"^version(_info)?\s*=\s*{re.escape(version)}\."
    if cfg.is_file() and not re.search(same, cfg.read_text(), re.M):
        print(f"{folder} is not a Python {version} environment: making it again", flush=True)
        shutil.rmtree(folder)
    if ready.is_file() and ready.read_text().strip() == torch and python.exists():
        return str(python)
    t0 = time.monotonic()
    if not python.exists():
        print(f"creating the build environment {folder} ({base_python})", flush=True)
        done = subprocess.run([base_python, "-m", "venv", str(folder)], capture_output=True, text=True)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"{base_python} -m venv {folder} failed ({why}): give another Python with "
                            "BUILD_PYTHON=")
    print(f"installing torch=={torch} (CUDA build, several GB with its nvidia-* wheels), setuptools, wheel, "
          "packaging, ninja and cuobjdump into it", flush=True)
    run_pip(str(python), "install", "--quiet", "--upgrade", "pip")
    run_pip(str(python), "install", "--quiet", f"torch=={torch}", "setuptools", "wheel", "packaging", "ninja",
            "nvidia-cuda-cuobjdump")
    done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True)
    version, _, cuda = done.stdout.strip().partition(" ")
    if done.returncode or cuda in ("", "None"):
        found = done.stdout.strip() or (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"torch=={torch} in {folder} is not a CUDA build ({found}): give a torch version "
                        "whose default Linux wheel is one, or use NODE_PYTHON=")
    ready.write_text(f"{torch}\n")
    print(f"build environment ready in {time.monotonic() - t0:.0f} s: torch {version}, CUDA {cuda}",
          flush=True)
    return str(python)


def get_sources(src: Path, pins: list[str], python: str) -> list[Path]:
    """The sdists of `pins` (name==version) in `src`, downloaded (with `python`'s pip: reading their metadata
    imports its torch) where they are missing."""
    def sdist(pin: str) -> Path:
        name, _, version = pin.partition("==")
        if not version:
            raise UserError(f"--sources {pin}: expected name==version, e.g. mamba-ssm==2.3.2.post1")
        return src / f"{canonical(name).replace('-', '_')}-{version}.tar.gz"

    missing = [pin for pin in pins if not sdist(pin).is_file()]
    if missing:
        src.mkdir(parents=True, exist_ok=True)
        print(f"downloading the sources of {', '.join(missing)} into {src}", flush=True)
        env = {**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE"}
        run_pip(python, "download", "--quiet", "--no-binary", ":all:", "--no-deps", "--no-build-isolation",
                "--dest", str(src), *missing, env=env)
    lost = [pin for pin in pins if not sdist(pin).is_file()]
    if lost:
        raise UserError(f"pip download gave no {', '.join(sdist(p).name for p in lost)} in {src}")
    return [sdist(pin) for pin in pins]


def cuda_env(python: str, cuda_arch: str) -> dict:
    """The environment of the builds: force a local build for `cuda_arch` (no prebuilt wheel from GitHub),
    CUDA_HOME (default /usr/local/cuda) with its nvcc first on PATH, MAX_JOBS (default 2), and the headers of
    the pip-installed CUDA libraries that torch's headers include (cublas_v2.h, cusparse.h, ...) on CPATH."""
    env = {**os.environ, "MAMBA_FORCE_BUILD": "TRUE", "CAUSAL_CONV1D_FORCE_BUILD": "TRUE",
           "TORCH_CUDA_ARCH_LIST": cuda_arch, "MAX_JOBS": os.environ.get("MAX_JOBS", "2")}
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home:  # a bin/nvcc on PATH may be a wrapper script (/usr/local/bin/nvcc): the toolkit first
        nvcc = shutil.which("nvcc")
        found = ["/usr/local/cuda", *([str(Path(nvcc).resolve().parents[1])] if nvcc else [])]
        cuda_home = next((h for h in found if (Path(h) / "include" / "cuda_runtime.h").is_file()), found[0])
    if not ((Path(cuda_home) / "bin" / "nvcc").is_file() and
            (Path(cuda_home) / "include" / "cuda_runtime.h").is_file()):
        raise UserError(f"no CUDA toolkit in {cuda_home} (bin/nvcc, include/cuda_runtime.h): set CUDA_HOME "
                        "to the CUDA toolkit (nvcc >= 11.6) that matches the node's torch")
    env["CUDA_HOME"] = cuda_home
    env["PATH"] = f"{cuda_home}/bin{os.pathsep}{env.get('PATH', '')}"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    includes = sorted(str(p) for p in Path(site).glob("nvidia/**/include") if p.is_dir())
    env["CPATH"] = os.pathsep.join([f"{cuda_home}/include", *includes, *filter(None, [env.get("CPATH")])])
    return env


def strip_wheel(wheel: Path) -> tuple[int, int]:
    """`strip --strip-debug` on the shared libraries in `wheel`, which is rewritten with a RECORD of the new
    hashes and sizes; returns its bytes before and after."""
    before = wheel.stat().st_size
    if shutil.which("strip") is None:
        print(f"{wheel.name}: strip not found, left as built", flush=True)
        return before, before
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        data = {i.filename: z.read(i) for i in infos}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in data if re.search(r"\.so(\.|$)", n)]:
            so = Path(tmp) / "lib.so"
            so.write_bytes(data[name])
            subprocess.run(["strip", "--strip-debug", str(so)], check=True)
            data[name] = so.read_bytes()
    (record,) = [n for n in data if n.endswith(".dist-info/RECORD")]

    def row(name: str) -> str:
        if name == record:
            return f"{name},,"
        digest = base64.urlsafe_b64encode(hashlib.sha256(data[name]).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data[name])}"

    data[record] = "".join(f"{row(i.filename)}\n" for i in infos if not i.is_dir()).encode()
    tmp_wheel = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp_wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for info in infos:  # the original order: RECORD stays last
            new = zipfile.ZipInfo(info.filename, info.date_time)
            new.external_attr, new.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            z.writestr(new, data[info.filename])
    tmp_wheel.replace(wheel)
    return before, wheel.stat().st_size


def cuobjdump(python: str, cuda_home: str) -> str | None:
    """cuobjdump: the CUDA toolkit's, else the build environment's (nvidia-cuda-cuobjdump), else None."""
    site = Path(python).parents[1]
    found = [Path(cuda_home) / "bin" / "cuobjdump",
             *site.glob("lib/python*/site-packages/nvidia/*/bin/cuobjdump"), shutil.which("cuobjdump")]
    return next((str(p) for p in found if p and Path(p).is_file()), None)


def device_code(wheel: Path, tool: str | None) -> dict[str, list[str]]:
    """The GPU architectures of the device code (cubin ELFs, `cuobjdump --list-elf`) of each shared library in
    `wheel`: its name -> e.g. ["sm_90", "sm_90", ...] (one per ELF)."""
    found = {}
    if tool is None:
        return found
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in z.namelist() if re.search(r"\.so(\.|$)", n)]:
            so = Path(z.extract(name, tmp))
            listing = subprocess.run([tool, "--list-elf", str(so)], capture_output=True, text=True).stdout
            found[name] = re.findall(r"\.(sm_\w+?)\.cubin", listing)
    return found


def build_wheels(python: str, sources: list[Path], cuda_arch: str, work: Path, out: Path,
                 index_args: list[str], lineinfo: bool = False) -> list[tuple[str, int, int, float]]:
    """Wheels of `sources` built with `python` (a CUDA torch and the build requirements in its environment)
    for `cuda_arch` (and nvcc's -lineinfo if `lineinfo`), from copies under `work` whose setup.py is patched
    (`patch_setup`; a copy is reused by the next run, so that ninja compiles only what is missing),
    stripped, into `out`. Returns each wheel's name, bytes before and after stripping, and seconds."""
    env = cuda_env(python, cuda_arch)
    tool = cuobjdump(python, env["CUDA_HOME"])
    tag = re.sub(r"[^0-9A-Za-z.+]+", "_", cuda_arch)
    done = []
    for sdist in sources:
        stem = sdist.name.removesuffix(".tar.gz")
        tree = work / f"{stem}-sm{tag}{'-lineinfo' if lineinfo else ''}"
        stamp = f"CUDA_ARCH={cuda_arch} lineinfo={lineinfo}\n"
        if not ((tree / ".patched").is_file() and (tree / ".patched").read_text() == stamp):
            shutil.rmtree(tree, ignore_errors=True)
            work.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=work) as tmp, tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp)
                (top,) = Path(tmp).iterdir()
                patch_setup(top / "setup.py", cuda_arch, lineinfo)
                shutil.move(str(top), tree)
            (tree / ".patched").write_text(stamp)
        print(f"building {stem} for CUDA_ARCH={cuda_arch} in {tree} (MAX_JOBS={env['MAX_JOBS']})", flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            run_pip(python, "wheel", "-v", *index_args, "--no-build-isolation", "--no-deps", "--wheel-dir",
                    tmp, str(tree), env=env, log=True)
            (wheel,) = Path(tmp).glob("*.whl")
            seconds = time.monotonic() - t0
            before, after = strip_wheel(wheel)
            (out / wheel.name).unlink(missing_ok=True)
            shutil.move(str(wheel), out / wheel.name)
        archs = device_code(out / wheel.name, tool)
        wanted = {f"sm_{f.split('code=sm_')[1]}" for f in arch_flags(cuda_arch) if "code=sm_" in f}
        for so, elfs in archs.items():
            print(f"  {so}: {len(elfs)} device ELFs, {', '.join(sorted(set(elfs))) or 'none'}", flush=True)
            if not elfs or set(elfs) - wanted:
                raise UserError(f"{wheel.name}: {so} has device code for {sorted(set(elfs))}, not "
                                f"{sorted(wanted)}")
        if tool is None:
            print("  (no cuobjdump here: the device code's architectures are not checked)", flush=True)
        print(f"{wheel.name}: built in {seconds / 60:.1f} min, {before / 2**20:.1f} MiB, stripped "
              f"{after / 2**20:.1f} MiB", flush=True)
        done.append((wheel.name, before, after, seconds))
    return done


def mamba_wheels(out: Path, folder: str, cuda_arch: str, build_dir: Path = Path(".cache/mamba-build"),
                 venv: bool = False, python_version: str = "3.12", base_python: str | None = None,
                 torch: str = "2.11.0", pins: list[str] | None = None, lineinfo: bool = False
                 ) -> tuple[int, int]:
    """The wheels of mamba-ssm and causal-conv1d for `cuda_arch`, into `out`, built in build_dir/src. With
    `venv` (online, only nvcc needed here): in a build environment build_dir/venv of Python `python_version`
    with PyPI's CUDA build of torch==`torch`, from the sources `pins` (downloaded into out/src). Without (no
    network needed): with this interpreter, the node's CUDA torch, and the sources and build wheels that
    mamba-sources put in `out`."""
    t0, work = time.monotonic(), build_dir / "src"
    if venv:
        python = build_env(build_dir / "venv", find_python(python_version, base_python), torch)
        sources = get_sources(out / "src", list(pins or DEFAULT_PINS), python)
        needs = sorted({r for sdist in sources for r in _source_requirements(sdist)[1]
                        if _name(r) != "torch"})
        run_pip(python, "install", "--quiet", *needs)
        index_args = []
    else:
        python = sys.executable
        sources = sorted((out / "src").glob("*.tar.gz"))
        if not sources:
            raise UserError(f"no sources in {out / 'src'}: run make mamba-sources on a machine with internet")
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            raise UserError("nvcc not found: build the mamba wheels on a machine with the CUDA toolkit and "
                            "the node's CUDA build of torch (docs/offline.md)")
        import torch as node_torch

        if node_torch.version.cuda is None:
            raise UserError(f"{sys.executable} has a CPU build of torch ({node_torch.__version__}): build "
                            "with the Python of the node's CUDA torch (make mamba-wheels NODE_PYTHON=...), "
                            "or without NODE_PYTHON to build one here")
        build = sorted({r for sdist in sources for r in _source_requirements(sdist)[1]
                        if _name(r) not in BASE})
        index_args = ["--no-index", "--find-links", str(out)]
        run_pip(python, "install", "--quiet", *index_args, *build)  # as --no-build-isolation needs
    out.mkdir(parents=True, exist_ok=True)
    built = build_wheels(python, sources, cuda_arch, work, out, index_args, lineinfo)
    for name, before, after, seconds in built:
        print(f"  {name}: {after / 2**20:.1f} MiB ({before / 2**20:.1f} MiB before strip), "
              f"{seconds / 60:.1f} min")
    print(f"mamba wheels for CUDA_ARCH={cuda_arch} in {time.monotonic() - t0:.0f} s; on the node: pip "
          f"install --no-index --no-deps {' '.join(f'{folder}/{n}' for n, *_ in built)}", flush=True)
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
    p.add_argument("--cuda-arch", default="9.0", help="mamba-wheels: the GPU architectures, as "
                   "TORCH_CUDA_ARCH_LIST: 9.0 (H100, default), 8.0 (A100), 8.0;9.0, ...")
    p.add_argument("--build-venv", action="store_true", help="mamba-wheels: build in a virtual environment "
                   "of its own (BUILD_DIR/venv, Python --python, PyPI's CUDA torch --torch; online) instead "
                   "of with this interpreter (the node's CUDA torch)")
    p.add_argument("--build-dir", default=".cache/mamba-build", help="mamba-wheels: the build environment "
                   "and the patched sources (default .cache/mamba-build)")
    p.add_argument("--build-python", help="mamba-wheels --build-venv: the interpreter that makes the venv "
                   "(default: a Python --python found on PATH or in pyenv)")
    p.add_argument("--torch", default="2.11.0", help="mamba-wheels --build-venv: the node's torch version "
                   "(default 2.11.0)")
    p.add_argument("--sources", default=",".join(DEFAULT_PINS), help="mamba-wheels --build-venv: the sdists, "
                   f"comma-separated (default {','.join(DEFAULT_PINS)})")
    p.add_argument("--lineinfo", action="store_true", help="mamba-wheels: keep nvcc's -lineinfo (source "
                   "lines in profilers; about 4 times the device code)")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        if a.step == "mamba-wheels":
            files, size = mamba_wheels(out, a.out, a.cuda_arch, Path(a.build_dir), a.build_venv,
                                       a.python or "3.12", a.build_python, a.torch,
                                       [s for s in a.sources.split(",") if s], a.lineinfo)
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
