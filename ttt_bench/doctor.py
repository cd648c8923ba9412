"""`ttt-bench doctor`: what this machine gives the toolkit. torch and CUDA, bf16 support, the optional
kernels' packages (Triton, mamba-ssm, causal-conv1d), the data folder the configs read (paths.data_dir, set by
TTT_BENCH_DATA_DIR) and the corpora in it, and the kernel path each language model takes here, as its
layers choose it at run time (on CUDA this runs the one-time Triton check of
ttt_bench/models/ttt/kernel_check.py)."""

import importlib
import importlib.metadata
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .config import compose
from .kernels import HAS_TRITON
from .kernels import mamba as mamba_ops
from .kernels.mamba import scan_cpu
from .models.ttt import kernel_check

CORPORA = {"pile-mini": "pile-mini/train.jsonl.zst", "books-mini": "books-mini/train.jsonl.zst",
           "fashion-mnist": "fashion-mnist"}
LANGUAGE_MODELS = ("transformer", "ttt_linear", "ttt_mlp", "ttt_kernel", "mamba", "linear_attention")


def package(name: str, module: str) -> tuple[str | None, str | None]:
    """(version, None) when `module` imports, (version or None, why not) otherwise."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (mamba-ssm raises more than ImportError without CUDA)
        why = "not installed" if version is None else f"installed but does not import: {type(e).__name__}"
        return version, why
    return version, None


def describe(version: str | None, why: str | None) -> str:
    return why if why else f"{version or 'present'}"


def data_dir() -> Path:
    """paths.data_dir as the train config composes it (TTT_BENCH_DATA_DIR, else ../shared/data)."""
    return Path(OmegaConf.select(compose("train"), "paths.data_dir"))


def triton_path(device: torch.device) -> str:
    """TTT-Linear's kernel path with kernel=auto on `device`."""
    if device.type != "cuda":
        return "PyTorch dual form (the Triton kernels are CUDA-only with kernel=auto)"
    if not HAS_TRITON:
        return "PyTorch dual form (Triton not installed)"
    if os.environ.get("TTT_BENCH_KERNELS") == "torch":
        return "PyTorch dual form (TTT_BENCH_KERNELS=torch)"
    verdict = kernel_check.verdict(device)
    if verdict["ok"]:
        return f"Triton kernels (checked against PyTorch: {verdict['detail']}; {kernel_check.cache_path()})"
    return f"PyTorch dual form (Triton kernels rejected: {verdict['detail']})"


def mamba_path(device: torch.device) -> str:
    if device.type == "cuda":
        if mamba_ops.mamba_inner() is not None:
            return "mamba-ssm CUDA kernels (selective scan, causal-conv1d)"
        return "PyTorch chunked selective scan (mamba-ssm or causal-conv1d missing)"
    if scan_cpu.available():
        return "C++ selective-scan kernel for CPU (built at first use)"
    return "PyTorch chunked selective scan (the C++ kernel did not build: no C++ compiler?)"


def kernel_paths(device: torch.device) -> dict[str, str]:
    """The kernel path of each language model of conf/model/ on `device`."""
    attention = ("scaled_dot_product_attention (flash / memory-efficient kernels)" if device.type == "cuda"
                 else "scaled_dot_product_attention (CPU)")
    return {
        "transformer": attention,
        "ttt_linear": triton_path(device),
        "ttt_mlp": ("Triton kernels (kernels/ttt_mlp.py forward and backward, kernels/ttt_mlp_decode.py), "
                    "head sizes 16-64; PyTorch dual form (dual_scan) elsewhere"
                    if triton_path(device).startswith("Triton kernels") else "PyTorch dual form (dual_scan)"),
        "ttt_kernel": "PyTorch (the kernel learner, Theorem 2)",
        "mamba": mamba_path(device),
        "linear_attention": "PyTorch (chunked causal linear attention)",
    }


def cpu_load() -> str:
    """The machine's load against its cores, and what to do when other work holds them: torch's idle OpenMP
    threads spin by default, which costs 2-4x beside another job and saves 1.1-2.6x on a quiet machine
    (docs/speed.md, "A shared CPU")."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    policy = os.environ.get("OMP_WAIT_POLICY")
    line = f"CPU load: {load:.2f} over the last minute on {cores} cores; OMP_WAIT_POLICY={policy or 'unset'}"
    if load >= 1 and not policy:
        line += (" (busy: beside other jobs, `export OMP_WAIT_POLICY=PASSIVE` made multi-threaded small "
                 "models 2-4x faster; docs/speed.md)")
    return line


def report() -> list[str]:
    """The lines `ttt-bench doctor` prints."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    lines = [f"torch: {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{torch.get_num_threads()} threads)", cpu_load()]
    if cuda:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(f"CUDA: {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {names}")
        lines.append(f"bf16: {'supported' if torch.cuda.is_bf16_supported() else 'not supported'} on the GPU "
                     f"(trainer=gpu uses {'bf16-mixed' if torch.cuda.is_bf16_supported() else '16-mixed'})")
    else:
        built = f"with CUDA {torch.version.cuda}" if torch.version.cuda else "for CPU only"
        lines.append(f"CUDA: not available (torch built {built})")
        lines.append("bf16: CPU autocast (trainer.precision=bf16-mixed); trainer=cpu trains in float32")
    for label, name, module in (("Triton", "triton", "triton"), ("mamba-ssm", "mamba-ssm", "mamba_ssm"),
                                ("causal-conv1d", "causal-conv1d", "causal_conv1d")):
        lines.append(f"{label}: {describe(*package(name, module))}")
    folder = data_dir()
    found = [name for name, rel in CORPORA.items() if (folder / rel).exists()]
    corpora = f"[{', '.join(found)}]" if found else "(no corpus found: data=synthetic needs none)"
    lines.append(f"data folder (paths.data_dir, TTT_BENCH_DATA_DIR): {folder} {corpora}")
    graphs = "CUDA graphs (bench models, generate; ttt_bench/models/graphs.py), the kernel learner eager"
    lines.append(f"decoding: {graphs if cuda else 'eager (CUDA graphs on a GPU)'}")
    lines.append(f"kernel paths on {device.type}:")
    lines += [f"  {model:17s} {path}" for model, path in kernel_paths(device).items()]
    return lines
