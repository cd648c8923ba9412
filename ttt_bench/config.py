"""Hydra/OmegaConf glue: the config directory, custom resolvers, and composing configs in code."""

import hashlib
import math
import os
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_MODULE = "pkg://ttt_bench.conf"


def _steps(total_tokens, tokens_per_batch, scale=1.0) -> int:
    """Optimizer steps for a token budget: ceil(total x scale / per batch); `scale` is `budget_scale`, the
    trial multiplier of `ttt-bench ablate --scale` (1 otherwise)."""
    from .errors import UserError

    for key, value, example in [("recipe.total_tokens", total_tokens, "2.5e6"),
                                ("recipe.tokens_per_batch", tokens_per_batch, "16384")]:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
            raise UserError(f"{key}={value!r} must be a positive number of tokens, e.g. {key}={example}")
    if tokens_per_batch != int(tokens_per_batch):
        raise UserError(f"recipe.tokens_per_batch={tokens_per_batch!r} must be a whole number of tokens")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
        raise UserError(f"budget_scale={scale!r} must be a positive number, e.g. budget_scale=0.1 for a "
                        "trial at a tenth of the budget")
    return max(1, math.ceil(total_tokens * scale / int(tokens_per_batch)))


def _slug(overrides: str) -> str:
    """A folder name for a list of overrides: readable when short, hashed when long."""
    if not overrides:
        return "default"
    # no '=' or ',' in folder names: they would need quoting in a later `ckpt_path=` override
    safe = "".join(
        c if c.isalnum() or c in ".-_+" else "_" for c in overrides.replace("=", "-").replace(",", "__")
    )
    if len(safe) <= 120:
        return safe
    return safe[:100] + "-" + hashlib.sha256(overrides.encode()).hexdigest()[:12]


def _gpu_precision(accelerator: str = "gpu") -> str:
    """The precision of the GPU trainers (gpu, ddp, fsdp, slurm) for the accelerator they run on: mixed
    precision on a GPU, bf16 where supported (Ampere and later), fp16 otherwise; float32 on CPU processes
    (`trainer=ddp trainer.accelerator=cpu`), as `trainer=cpu` trains: a multi-process CPU run then computes
    what the single-process CPU runs of the project compute. `trainer.precision=bf16-mixed` still asks for
    mixed precision explicitly."""
    import torch

    if str(accelerator) == "cpu":
        return "32-true"
    return "bf16-mixed" if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else "16-mixed"


def env(name: str, default: str) -> str:
    """An environment variable's value, or `default` where it is unset or empty (`TTT_BENCH_RUNS=` must not
    put run folders at /), as a shell's ${NAME:-default}."""
    return os.environ.get(name) or default


def runs_root() -> Path:
    """Where ad-hoc outputs go: $TTT_BENCH_RUNS, else ./runs (conf/paths/default.yaml's `runs`)."""
    return Path(env("TTT_BENCH_RUNS", "runs"))


def _run_name(name) -> str:
    """run_name as a folder under paths.runs: a relative path that stays there (no .., not absolute)."""
    from .errors import UserError

    path = Path(str(name))
    if path.is_absolute() or ".." in path.parts:
        raise UserError(f"run_name={name} would put the run outside paths.runs; use a plain name, e.g. "
                        "run_name=my-run (paths.runs=... chooses the folder of runs)")
    return str(name)


@lru_cache(maxsize=8)
def _checkpoint_id(path: str, size: int, mtime_ns: int) -> str:
    import torch

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    try:  # mmap: the tensors stay on disk, only the step is read
        step = torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("global_step")
    except Exception:  # not a checkpoint: eval says so
        step = None
    return (f"step{step}-" if isinstance(step, int) else "") + digest.hexdigest()[:12]


def checkpoint_id(ckpt_path) -> str | None:
    """What an evaluation evaluates: step<N>-<the first 12 hex digits of the file's sha256> (no step for a
    checkpoint that records none), None where there is no such file. The same bytes are the same checkpoint
    wherever they lie and whatever their modification time; the hash is read once per file and process."""
    try:
        path = Path(str(ckpt_path)).resolve()
        stat = path.stat()
    except (OSError, ValueError):
        return None
    return _checkpoint_id(str(path), stat.st_size, stat.st_mtime_ns) if path.is_file() else None


def _eval_dir(ckpt_path, runs: str, data, seq_len, max_tokens) -> str:
    """Where `ttt-bench eval` writes: <run>/eval/ for a checkpoint in a run's checkpoints/ folder (beside
    the run it describes), else <runs>/eval/; then a folder per data, context, tokens and checkpoint
    evaluated: <data>-T<context>-<tokens>-step<N>-<sha256 of the checkpoint, 12 hex digits>."""
    ckpt = Path(str(ckpt_path)) if ckpt_path else None
    run = ckpt.parent.parent if ckpt is not None and ckpt.parent.name == "checkpoints" else None
    root = run / "eval" if run is not None and (run / "identity.json").is_file() else Path(runs) / "eval"
    name = f"{data or 'trained-data'}-T{seq_len or 'trained'}-{max_tokens or 'all'}"
    if ckpt is not None and (ident := checkpoint_id(ckpt)):
        name += f"-{ident}"
    return str(root / _slug(name))


def register_resolvers() -> None:
    for name, fn in {
        "ttt.env": env,
        "ttt.eval_dir": _eval_dir,
        "ttt.run_name": _run_name,
        "ttt.slug": _slug,
        "ttt.gpu_precision": _gpu_precision,
        "ttt.steps": _steps,
        "ttt.repo_root": lambda: str(REPO_ROOT),
        "ttt.mul": lambda a, b: a * b,
        "ttt.div": lambda a, b: a // b,
    }.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def task_name(cfg: DictConfig) -> str:
    """`lm` (language modelling, the default) or `image` (classification, MTTT): the `task` config group."""
    from .errors import UserError

    name = OmegaConf.select(cfg, "task.name") or "lm"
    if name not in ("lm", "image"):
        raise UserError(f"task={name} is not a task; use task=lm or task=image")
    return name


def compose(config_name: str = "train", overrides: list[str] | None = None) -> DictConfig:
    """Compose a config in code (tests, notebooks), as the CLI would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module("ttt_bench.conf", version_base="1.3"):
        return hydra_compose(
            config_name=config_name, overrides=list(overrides or []), return_hydra_config=False
        )
