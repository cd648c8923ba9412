"""`ttt-bench train`: build data and model from the composed config, fit with Lightning, write metrics.json.

Run folder layout (Hydra's output dir):
    .hydra/config.yaml       resolved config            checkpoints/last.ckpt, step-*.ckpt
    metrics.csv              per-step CSV log           metrics.json   final summary
    token_index.csv          final token-index losses
"""

import logging
import time
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..io import write_json
from .evaluate import bits_per_byte, evaluate, save_token_index
from .module import LitLM

log = logging.getLogger(__name__)


def batch_geometry(cfg: DictConfig, world_size: int) -> dict:
    """Sequences per optimizer step from the recipe's fixed tokens-per-batch, and the gradient
    accumulation needed to reach it with the data's micro-batch size."""
    seq_len, micro = cfg.data.seq_len, cfg.data.micro_batch_size
    tokens = cfg.recipe.tokens_per_batch
    if seq_len < 1 or micro < 1 or tokens < 1:
        raise UserError(f"data.seq_len ({seq_len}), data.micro_batch_size ({micro}) and recipe.tokens_per_batch "
                        f"({tokens}) must all be >= 1")
    sequences = max(1, tokens // seq_len)
    per_step = micro * world_size
    if sequences % per_step:
        raise UserError(f"recipe.tokens_per_batch={tokens} gives {sequences} sequences of {seq_len} tokens, not a "
                        f"multiple of data.micro_batch_size x devices = {per_step}; change one of them")
    return {"sequences_per_step": sequences, "accumulate": sequences // per_step, "tokens_per_step": sequences * seq_len}


def build_data(cfg: DictConfig):
    dm = instantiate(cfg.data)
    dm.prepare_data()
    return dm


def build_module(cfg: DictConfig, dm) -> LitLM:
    return LitLM(model_cfg=OmegaConf.to_container(cfg.model, resolve=True),
                 recipe=OmegaConf.to_container(cfg.recipe, resolve=True), vocab_size=dm.vocab_size,
                 tokenizer=dm.build_tokenizer().spec, max_steps=int(cfg.trainer.max_steps),
                 config=OmegaConf.to_container(cfg, resolve=True))


def find_resume_checkpoint(cfg: DictConfig, run_dir: Path) -> str | None:
    if cfg.ckpt_path:
        if not Path(cfg.ckpt_path).is_file():
            raise UserError(f"ckpt_path={cfg.ckpt_path} does not exist; give the path of a .ckpt file")
        return str(cfg.ckpt_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    return str(last) if last.is_file() else None


def train(cfg: DictConfig, run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    L.seed_everything(cfg.seed, workers=True)
    dm = build_data(cfg)
    module = build_module(cfg, dm)
    if cfg.trainer.accelerator == "cpu":
        torch.set_float32_matmul_precision("highest")
    world = int(cfg.trainer.get("num_nodes", 1)) * (torch.cuda.device_count() if cfg.trainer.devices == -1 else int(cfg.trainer.devices))
    geo = batch_geometry(cfg, max(1, world))
    callbacks = [
        ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step-{step}", auto_insert_metric_name=False,
                        every_n_train_steps=cfg.checkpoint_every_n_steps, save_last=True, save_top_k=-1),
        LearningRateMonitor(logging_interval="step"),
    ]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=CSVLogger(run_dir, name="", version=""),
                          default_root_dir=run_dir, accumulate_grad_batches=geo["accumulate"],
                          val_check_interval=cfg.eval_every_n_steps * geo["accumulate"], check_val_every_n_epoch=None,
                          use_distributed_sampler=False)
    dm.samples_per_step = geo["sequences_per_step"]
    resume = find_resume_checkpoint(cfg, run_dir)
    log.info("model %s: %.2fM parameters (%.2fM non-embedding); %d steps of %d tokens (accumulate %d)%s",
             cfg.model.name, module.model.num_params(False) / 1e6, module.model.num_params() / 1e6,
             cfg.trainer.max_steps, geo["tokens_per_step"], geo["accumulate"], f"; resuming {resume}" if resume else "")
    tokens_before = 0
    start = time.perf_counter()
    if resume:
        tokens_before = torch.load(resume, map_location="cpu", weights_only=False).get("tokens_seen", 0)
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    wall = time.perf_counter() - start

    result = evaluate(module.model, dm.val_dataset(), batch_size=cfg.data.micro_batch_size)
    save_token_index(run_dir / "token_index.csv", result.pop("token_index_loss"))
    tokens_seen = module.tokens_seen
    metrics = {
        "status": "finished", "model": cfg.model.name, "size": cfg.size.name, "data": cfg.data.name,
        "seq_len": cfg.data.seq_len, "params": module.model.num_params(False),
        "non_embedding_params": module.model.num_params(), "steps": trainer.global_step,
        "tokens_seen": tokens_seen, "wall_time_s": round(wall, 2),
        "tokens_per_s": round((tokens_seen - tokens_before) / max(wall, 1e-9), 1), **result,
        "val_bpb": bits_per_byte(result["val_loss"], dm.bytes_per_token()), "train_flops": None,
        "run_dir": str(run_dir),
    }
    write_json(run_dir / "metrics.json", metrics)
    log.info("val loss %.4f, ppl %.3f, bpb %.4f; outputs in %s", metrics["val_loss"], metrics["val_ppl"],
             metrics["val_bpb"], run_dir)
    return metrics
