"""Loading checkpoints for eval and generate, with clear errors."""

from pathlib import Path

import torch

from ..data.tokenizers import from_spec
from ..errors import UserError
from .module import LitLM


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> tuple[LitLM, object]:
    """The trained module and its tokenizer from a Lightning checkpoint written by `ttt-bench train`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass the .ckpt file of a run (runs/<run>/checkpoints/last.ckpt)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}): truncated or not a checkpoint; "
                        "use another one from the run's checkpoints/ folder") from None
    hp = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "model_cfg" not in hp:
        raise UserError(f"{path} was not written by ttt-bench train (no model config inside)")
    try:
        module = LitLM(**hp)
        module.load_state_dict(ckpt["state_dict"])
    except RuntimeError as e:
        raise UserError(f"{path} does not match its model config: {str(e).splitlines()[0]}") from None
    module.eval()
    return module, from_spec(hp["tokenizer"])
