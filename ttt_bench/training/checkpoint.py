"""Checkpoints: atomic writes for Lightning, loading for eval and generate, and choosing the checkpoint to
resume from, with clear errors naming the file."""

import logging
from pathlib import Path

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO

from ..data.tokenizers import from_spec
from ..errors import UserError
from ..io import atomic_file, write_failed
from .module import LitClassifier, LitLM

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writes (step-*.ckpt and last.ckpt) go through a temporary file and a rename,
    so a crash mid-write leaves the previous file whole."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        with atomic_file(path) as f:
            try:
                torch.save(checkpoint, f)
            except RuntimeError as e:  # a full disk: torch.save's "file write failed", no OSError
                raise write_failed(e, path) from e


def torch_device(name: str, option: str = "device") -> torch.device:
    """The device `name` (cpu, cuda, cuda:1, ...), or a UserError saying why it cannot be used here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"{option}={name!r} is not a device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{option}={name} needs a CUDA GPU and this machine has none; use {option}=cpu")
    return device


def read_checkpoint(path: str | Path, map_location: str = "cpu") -> dict:
    """The contents of a checkpoint written by `ttt-bench train`, or a UserError naming the file."""
    if isinstance(path, bool) or not isinstance(path, str | Path | int | float) or not str(path).strip():
        raise UserError(f"checkpoint path {path!r} is not a file path; pass the .ckpt file of a run "
                        "(runs/<run>/checkpoints/last.ckpt)")
    path = Path(str(path))  # ckpt_path=123 reaches here as an int
    torch_device(str(map_location))  # no GPU: say so, rather than call a good checkpoint unreadable
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass the .ckpt file of a run "
                        "(runs/<run>/checkpoints/last.ckpt)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}): truncated or not a "
                        "checkpoint; use another one from the run's checkpoints/ folder") from None
    if "model_cfg" not in (ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}):
        raise UserError(f"{path} was not written by ttt-bench train (no model config inside)")
    return ckpt


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def find_resume_checkpoint(ckpt_path: str | None, run_dir: Path, model_cfg: dict) -> tuple[str, dict] | None:
    """The checkpoint to resume training from and its contents: `ckpt_path` if given, else the newest readable
    checkpoint of the run folder (last.ckpt, or a step-*.ckpt when last.ckpt is truncated or corrupt)."""
    if ckpt_path:
        found = str(ckpt_path), read_checkpoint(ckpt_path)
    else:
        folder = run_dir / "checkpoints"
        for partial in folder.glob(".*.tmp"):  # left by a crash mid-write
            partial.unlink()
        files = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        found = None
        for path in files:
            try:
                found = str(path), read_checkpoint(path)
                break
            except UserError as e:
                log.warning("%s; trying the previous checkpoint", e)
        if found is None:
            return None
    theirs, ours = _flat(found[1]["hyper_parameters"]["model_cfg"]), _flat(model_cfg)
    diff = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if diff:
        show = lambda cfg: ", ".join(f"{k}={cfg.get(k)}" for k in diff[:4])
        raise UserError(f"checkpoint {found[0]} holds another model ({show(theirs)}, this run has "
                        f"{show(ours)}); use the model/size overrides it was trained with, or another "
                        "ckpt_path")
    return found


def load_checkpoint(path: str | Path, map_location: str = "cpu", task: str | None = "lm"):
    """The trained module and its tokenizer (None for an image classifier) from a Lightning checkpoint
    written by `ttt-bench train`. `task` ("lm", "image" or None for either) is what the caller can use:
    a checkpoint of the other task is a one-line error."""
    ckpt = read_checkpoint(path, map_location)
    hp = ckpt["hyper_parameters"]
    found = "image" if "num_classes" in hp else "lm"
    if task is not None and found != task:
        what = {"lm": "a language model", "image": "an image classifier (task=image)"}
        raise UserError(f"{path} holds {what[found]}, this command needs {what[task]}; "
                        "ttt-bench eval ckpt_path=... evaluates either")
    try:
        module = (LitClassifier if found == "image" else LitLM)(**hp)
        module.load_state_dict(ckpt["state_dict"])
    except RuntimeError as e:
        raise UserError(f"{path} does not match its model config: {str(e).splitlines()[0]}") from None
    module.to(map_location).eval()
    return module, (from_spec(hp["tokenizer"]) if found == "lm" else None)
