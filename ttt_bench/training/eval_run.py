"""`ttt-bench eval`: perplexity, bits per byte and token-index losses of a language-model checkpoint;
accuracy on the validation and held-out test images, and the inner losses, of an image classifier."""

import json
import logging
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..config import checkpoint_id
from ..errors import UserError
from ..io import write_json
from .checkpoint import load_checkpoint, torch_device
from .evaluate import (
    bits_per_byte,
    evaluate,
    evaluate_splits,
    inner_losses,
    save_inner_losses,
    save_token_index,
)

log = logging.getLogger(__name__)


def check_options(cfg: DictConfig) -> None:
    for key, example, nullable in [("batch_size", 8, False), ("max_tokens", 1048576, True),
                                   ("seq_len", 4096, True)]:
        value = cfg.get(key)
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            null = " or null" if nullable else ""
            raise UserError(f"{key}={value!r} must be a positive integer{null}, e.g. {key}={example}")


def run_eval(cfg: DictConfig, out_dir: Path) -> dict:
    if OmegaConf.is_missing(cfg, "ckpt_path") or not str(cfg.ckpt_path or "").strip():
        raise UserError("no checkpoint given; run ttt-bench eval ckpt_path=runs/<run>/checkpoints/last.ckpt")
    check_options(cfg)
    done, ckpt_id = Path(out_dir) / "metrics.json", checkpoint_id(cfg.ckpt_path)
    if done.is_file() and not cfg.get("force"):
        metrics = json.loads(done.read_text())
        if ckpt_id is not None and metrics.get("ckpt_id") == ckpt_id:  # the same bytes, wherever they lie
            keys = ("val_loss", "val_ppl", "val_bpb", "val_accuracy", "test_accuracy")
            shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics)
            log.info("%s (this eval ran before on the same checkpoint: %s; force=true evaluates again)",
                     shown, done)
            return metrics
    module, _ = load_checkpoint(cfg.ckpt_path, map_location=torch_device(cfg.device), task=None)
    hp = module.hparams
    if cfg.get("data"):
        data = OmegaConf.to_container(cfg.data, resolve=True)
    elif (hp.get("config") or {}).get("data"):
        data = hp["config"]["data"]
    else:
        raise UserError(f"{cfg.ckpt_path} does not say what data it was trained on; pass data=<name>")
    data_cfg = OmegaConf.create(data)
    image_model, image_data = "num_classes" in hp, "ImageDataModule" in str(data_cfg.get("_target_", ""))
    if image_model != image_data:
        model, text = ("an image classifier", "text") if image_model else ("a language model", "images")
        raise UserError(f"{cfg.ckpt_path} holds {model} and data={data_cfg.get('name')} is {text}; pass a "
                        "data config of its kind, or leave data= out for the data it was trained on")
    if "num_classes" in hp:
        return eval_classifier(cfg, module, data_cfg, Path(out_dir))
    data_cfg.tokenizer = hp["tokenizer"]  # always the model's own tokenizer
    if cfg.seq_len:
        data_cfg.seq_len = cfg.seq_len
    dm = instantiate(data_cfg)  # not prepare_data, training's splits: val_dataset prepares validation alone
    result = evaluate(module.model, dm.val_dataset(cfg.max_tokens), batch_size=cfg.batch_size)
    save_token_index(Path(out_dir) / "token_index.csv", result.pop("token_index_loss"))
    save_inner_losses(
        Path(out_dir) / "inner_losses.csv", inner_losses(module.model, dm.val_dataset(cfg.max_tokens))
    )
    metrics = {
        "ckpt_path": str(cfg.ckpt_path),
        "ckpt_id": ckpt_id,
        "model": hp["model_cfg"].get("name"),
        "data": data_cfg.name,
        "seq_len": data_cfg.seq_len,
        **result,
        "val_bpb": bits_per_byte(result["val_loss"], dm.bytes_per_token()),
    }
    write_json(Path(out_dir) / "metrics.json", metrics)
    log.info(
        "val loss %.4f, ppl %.3f, bpb %.4f over %d tokens; outputs in %s",
        metrics["val_loss"],
        metrics["val_ppl"],
        metrics["val_bpb"],
        metrics["val_tokens"],
        out_dir,
    )
    return metrics


def eval_classifier(cfg: DictConfig, module, data_cfg: DictConfig, out_dir: Path) -> dict:
    """An image checkpoint: loss and accuracy on the validation split and the held-out test split, and the
    inner losses per layer and step (as `train` writes them at the end of a run)."""
    if cfg.seq_len:
        raise UserError(f"seq_len={cfg.seq_len} applies to language models; {cfg.ckpt_path} is an image "
                        "classifier, whose tokens come from data.patch_size and data.image_size")
    dm = instantiate(data_cfg)
    dm.prepare_data()
    if (dm.token_dim, dm.num_tokens) != (module.hparams["token_dim"], module.hparams["num_tokens"]):
        raise UserError(f"data {data_cfg.name} gives {dm.num_tokens} tokens of {dm.token_dim} values, "
                        f"{cfg.ckpt_path} was trained on {module.hparams['num_tokens']} of "
                        f"{module.hparams['token_dim']}; use its patch_size and image_size")
    splits = evaluate_splits(module.model, dm, cfg.batch_size, out_dir)
    metrics = {"ckpt_path": str(cfg.ckpt_path), "ckpt_id": checkpoint_id(cfg.ckpt_path), "task": "image",
               "data": data_cfg.name, "model": module.hparams["model_cfg"].get("name"), **splits}
    write_json(out_dir / "metrics.json", metrics)
    log.info("val accuracy %.4f, test accuracy %.4f; outputs in %s", metrics["val_accuracy"],
             metrics["test_accuracy"], out_dir)
    return metrics
