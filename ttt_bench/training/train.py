"""`ttt-bench train`: build data and model from the composed config, fit with Lightning, write metrics.json.

Run folder layout (Hydra's output dir):
    .hydra/config.yaml       resolved config            checkpoints/last.ckpt, step-*.ckpt
    metrics.csv              per-step CSV log           metrics.json   final summary
    token_index.csv          final token-index losses   losses.csv     loss of every optimizer step

metrics.json's `tokens_per_s` divides the tokens by the whole fit's wall time (start-up, validation and
checkpoints included); `steady_tokens_per_s` is the training loop's own throughput (`StepTimer`), the number
to compare with `ttt-bench bench models`' train phase (docs/speed.md).
"""

import logging
import time
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..flops import train_flops
from ..io import write_atomic, write_json
from ..vision.flops import count_flops
from .checkpoint import AtomicCheckpointIO, find_resume_checkpoint, read_checkpoint
from .evaluate import (
    bits_per_byte,
    evaluate,
    evaluate_classifier,
    inner_losses,
    save_inner_losses,
    save_token_index,
)
from .faults import KillDuringStep
from .module import LitBase, LitClassifier, LitLM

log = logging.getLogger(__name__)


def batch_geometry(cfg: DictConfig, world_size: int) -> dict:
    """Sequences per optimizer step from the recipe's fixed tokens-per-batch, and the gradient
    accumulation needed to reach it with the data's micro-batch size."""
    seq_len, micro = cfg.data.seq_len, cfg.data.micro_batch_size
    tokens = cfg.recipe.tokens_per_batch  # all >= 1 (check_config)
    sequences = max(1, tokens // seq_len)
    per_step = micro * world_size
    if sequences % per_step:
        raise UserError(
            f"recipe.tokens_per_batch={tokens} gives {sequences} sequences of {seq_len} tokens, "
            f"not a multiple of data.micro_batch_size x devices = {per_step}; change one of them"
        )
    return {
        "sequences_per_step": sequences,
        "accumulate": sequences // per_step,
        "tokens_per_step": sequences * seq_len,
    }


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint every `every_n_train_steps` steps and at the final step, so last.ckpt is the model that
    metrics.json describes (Lightning saves on multiples of the interval only). It does not save again the
    step a run resumed from: Lightning would rewrite step-N.ckpt and last.ckpt after the first micro-batch,
    mid-accumulation, and a resume from those would misplace the accumulation windows."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_global_step_saved:  # max_steps not a multiple of the interval
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)


class LossLog(Callback):
    """Appends `step,loss` to losses.csv after every optimizer step (its mean loss, exact float32 value; nan
    for a skipped non-finite step), so the losses of a crashed run survive; a resume drops the rows after its
    checkpoint."""

    def __init__(self, path: Path):
        self.path, self.step, self.total = path, 0, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step, self.total = trainer.global_step, None
        rows = self.path.read_text().splitlines()[1:] if self.path.is_file() else []
        kept = [r for r in rows if int(r.split(",")[0]) <= self.step]
        write_atomic(self.path, "\n".join(["step,loss", *kept]) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = (outputs or {}).get("loss")  # divided by the accumulation factor; none for a skipped batch
        if loss is not None:
            self.total = (self.total or 0.0) + loss.item()
        if trainer.global_step != self.step:
            self.step = trainer.global_step
            with self.path.open("a") as f:
                f.write(f"{self.step},{'nan' if self.total is None else repr(self.total)}\n")
            self.total = None


class StepTimer(Callback):
    """Wall time of every optimizer step, from the end of the previous one: loading its micro-batches, their
    forward and backward, the update, logging. `tokens_per_s()` is the steady state: it leaves out the first
    `warmup` steps of the process (allocator, caches, kernels built at first use) and every step during which
    the run validated or wrote a checkpoint."""

    def __init__(self, tokens_per_step: int, warmup: int = 5):
        self.tokens_per_step, self.warmup = tokens_per_step, warmup
        self.times: list[float] = []
        self.step, self.last, self.done, self.excluded = None, None, 0, False

    def on_train_start(self, trainer, pl_module) -> None:
        self.step, self.last, self.done, self.excluded = trainer.global_step, None, 0, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:  # inside an accumulation window
            return
        now = time.perf_counter()
        if self.last is not None and self.done >= self.warmup and not self.excluded:
            self.times.append(now - self.last)
        self.step, self.last, self.done, self.excluded = trainer.global_step, now, self.done + 1, False

    def on_validation_start(self, trainer, pl_module) -> None:
        self.excluded = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.excluded = True

    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step * len(self.times) / sum(self.times) if self.times else None


# Settings that must be positive integers / numbers (checked when present), with an example value each.
POSITIVE_INTS = {
    "data.seq_len": 512,
    "data.micro_batch_size": 8,
    "recipe.tokens_per_batch": 16384,
    "trainer.max_steps": 1000,
    "size.d_model": 768,
    "size.n_layers": 12,
    "size.n_heads": 12,
    "size.mlp_hidden": 2048,
    "checkpoint_every_n_steps": 100,
    "eval_every_n_steps": 100,
}
POSITIVE_NUMBERS = {"recipe.lr": 3e-3, "recipe.grad_clip": 1.0}


def check_config(cfg: DictConfig) -> None:
    """Wrong types, sizes and combinations, caught before any data is prepared."""
    for key, example in {**POSITIVE_INTS, **POSITIVE_NUMBERS}.items():
        value = OmegaConf.select(cfg, key)
        number = int if key in POSITIVE_INTS else (int, float)
        if value is not None and (isinstance(value, bool) or not isinstance(value, number) or value <= 0):
            kind = "a positive integer" if key in POSITIVE_INTS else "a positive number"
            raise UserError(f"{key}={value!r} must be {kind}, e.g. {key}={example}")
    if cfg.size.d_model % cfg.size.n_heads:
        raise UserError(
            f"size.n_heads={cfg.size.n_heads} does not divide size.d_model={cfg.size.d_model}; "
            "pick a number of heads that divides the width"
        )
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(
            f"trainer.accelerator={cfg.trainer.accelerator} needs a CUDA GPU and this machine "
            "has none; use trainer=cpu (the default)"
        )
    seq_len, max_len = cfg.data.seq_len, cfg.model.get("max_seq_len")
    if max_len is not None and seq_len > max_len:
        raise UserError(
            f"data.seq_len={seq_len} is above the model's maximum context "
            f"model.max_seq_len={max_len}; use a shorter data.seq_len or raise model.max_seq_len"
        )
    mini_batch = cfg.model.get("block", {}).get("mini_batch_size")
    if mini_batch is not None and not 1 <= mini_batch <= seq_len:
        raise UserError(
            f"model.block.mini_batch_size={mini_batch} must be between 1 and the context "
            f"data.seq_len={seq_len}; e.g. model.block.mini_batch_size=16"
        )


def task_name(cfg: DictConfig) -> str:
    """`lm` (language modelling, the default) or `image` (classification, MTTT): the `task` config group."""
    name = OmegaConf.select(cfg, "task.name") or "lm"
    if name not in ("lm", "image"):
        raise UserError(f"task={name} is not a task; use task=lm or task=image")
    return name


def check_image_config(cfg: DictConfig) -> None:
    """The image task's settings, before any data is read."""
    for key in ("data.micro_batch_size", "recipe.batch_size", "trainer.max_steps", "size.d_model",
                "size.n_layers", "size.n_heads", "size.mlp_hidden", "checkpoint_every_n_steps",
                "eval_every_n_steps"):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{key}={value!r} must be a positive integer")
    for key in ("recipe.lr", "recipe.grad_clip"):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise UserError(f"{key}={value!r} must be a positive number")
    if cfg.size.d_model % cfg.size.n_heads:
        raise UserError(f"size.n_heads={cfg.size.n_heads} does not divide size.d_model={cfg.size.d_model}; "
                        "pick a number of heads that divides the width")
    if "_target_" not in cfg.data or "ImageDataModule" not in str(cfg.data._target_):
        raise UserError(f"task=image needs image data, got data={cfg.data.get('name')}; use "
                        "data=fashion_mnist or data=synthetic_images")
    if "ViTClassifier" not in str(cfg.model.get("_target_", "")):
        raise UserError(f"task=image needs an image model, got model={cfg.model.get('name')}; use one of "
                        "mttt_linear, mttt_mlp, vit_linear_attention, vit_self_attention, "
                        "vit_nadaraya_watson")
    mixer = cfg.model.get("mixer") or {}
    steps, tokens = mixer.get("steps"), OmegaConf.select(cfg, "data.seq_len")
    if mixer.get("sgd") and isinstance(steps, int) and steps >= 1 and tokens and tokens % steps:
        raise UserError(f"inner SGD splits the {tokens} tokens of an image into model.mixer.steps={steps} "
                        "mini-batches; pick steps that divide the number of tokens")
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.accelerator={cfg.trainer.accelerator} needs a CUDA GPU and this machine "
                        "has none; use trainer=cpu (the default)")


def image_geometry(cfg: DictConfig, world_size: int) -> dict:
    """Images per optimizer step (recipe.batch_size) and the gradient accumulation to reach it."""
    images, per_step = cfg.recipe.batch_size, cfg.data.micro_batch_size * world_size
    if images % per_step:
        raise UserError(f"recipe.batch_size={images} is not a multiple of data.micro_batch_size x devices = "
                        f"{per_step}; change one of them")
    return {"sequences_per_step": images, "accumulate": images // per_step, "tokens_per_step": images}


def build_data(cfg: DictConfig):
    dm = instantiate(cfg.data)
    dm.prepare_data()
    return dm


def build_module(cfg: DictConfig, dm) -> LitBase:
    common = {
        "model_cfg": OmegaConf.to_container(cfg.model, resolve=True),
        "recipe": OmegaConf.to_container(cfg.recipe, resolve=True),
        "max_steps": int(cfg.trainer.max_steps),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "nonfinite": cfg.nonfinite,
    }
    if task_name(cfg) == "image":
        return LitClassifier(num_classes=dm.num_classes, token_dim=dm.token_dim, num_tokens=dm.num_tokens,
                             **common)
    return LitLM(vocab_size=dm.vocab_size, tokenizer=dm.build_tokenizer().spec, **common)


def fit(cfg: DictConfig, run_dir: Path, geo: dict, make_module) -> dict:
    """What the tasks share: resume-checkpoint choice, seeding, data and module, callbacks (checkpoints, loss
    log, step timer, fault hooks), the Lightning fit. `make_module(dm)` builds the LightningModule."""
    found = find_resume_checkpoint(cfg.ckpt_path, run_dir, OmegaConf.to_container(cfg.model, resolve=True))
    resume, units_before = (found[0], found[1].get("tokens_seen", 0)) if found else (None, 0)
    del found  # the trainer loads it again
    L.seed_everything(cfg.seed, workers=True)
    dm = build_data(cfg)
    module = make_module(dm)
    if cfg.trainer.accelerator == "cpu":
        torch.set_float32_matmul_precision("highest")
    fault = cfg.get("fault") or {}  # test-only fault injection, see faults.py
    kill_step, kill_during = fault.get("kill_at_step"), fault.get("kill_during", "step")
    timer = StepTimer(geo["tokens_per_step"])
    callbacks = [
        StepCheckpoint(
            dirpath=run_dir / "checkpoints",
            filename="step-{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=cfg.checkpoint_every_n_steps,
            save_last=True,
            save_top_k=-1,
            enable_version_counter=False,  # a re-run from an older step-N.ckpt rewrites last.ckpt
        ),
        LearningRateMonitor(logging_interval="step"),
        LossLog(run_dir / "losses.csv"),
        timer,
        # the bar redraws every 10th micro-batch (Lightning's default: every one)
        *([TQDMProgressBar(refresh_rate=10)] if cfg.trainer.get("enable_progress_bar", True) else []),
        *([KillDuringStep(kill_step)] if kill_step and kill_during == "step" else []),
    ]
    checkpoint_io = AtomicCheckpointIO(kill_step if kill_during == "checkpoint_write" else None)
    trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=[CSVLogger(run_dir, name="", version="")]
        + ([TensorBoardLogger(run_dir, name="", version="tensorboard")] if cfg.get("tensorboard") else []),
        default_root_dir=run_dir,
        accumulate_grad_batches=geo["accumulate"],
        val_check_interval=cfg.eval_every_n_steps * geo["accumulate"],
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,
        plugins=[checkpoint_io],
    )
    dm.samples_per_step = geo["sequences_per_step"]
    init_from = cfg.recipe.get("init_from")
    if init_from and resume is None:  # TF finetune: pretrained weights, new optimizer state and schedule
        try:
            module.load_state_dict(read_checkpoint(init_from)["state_dict"])
        except RuntimeError as e:
            reason = str(e).splitlines()[0]
            raise UserError(f"recipe.init_from={init_from} does not fit this model: {reason}") from None
    log.info(
        "model %s: %.2fM parameters (%.2fM non-embedding); %d steps of %d %s (accumulate %d)%s",
        cfg.model.name,
        module.model.num_params(False) / 1e6,
        module.model.num_params() / 1e6,
        cfg.trainer.max_steps,
        geo["tokens_per_step"],
        module.unit,
        geo["accumulate"],
        f"; resuming {resume}" if resume else "",
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=False)  # ours, with numpy RNG states
    wall = time.perf_counter() - start
    return {"dm": dm, "module": module, "trainer": trainer, "timer": timer, "wall": wall,
            "units_before": units_before, "init_from": init_from}


def world_size(cfg: DictConfig) -> int:
    """Processes of the run: nodes x devices per node (devices=-1: every GPU of the node)."""
    devices = torch.cuda.device_count() if cfg.trainer.devices == -1 else int(cfg.trainer.devices)
    return max(1, int(cfg.trainer.get("num_nodes", 1)) * devices)


def train(cfg: DictConfig, run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    if task_name(cfg) == "image":
        return train_image(cfg, run_dir)
    for group in ("model", "data"):
        if any(t in str(cfg[group].get("_target_", "")) for t in ("ViTClassifier", "ImageDataModule")):
            raise UserError(f"{group}={cfg[group].get('name')} is for image classification; add task=image")
    check_config(cfg)
    geo = batch_geometry(cfg, world_size(cfg))
    run = fit(cfg, run_dir, geo, lambda dm: build_module(cfg, dm))
    dm, module, trainer, timer, wall = run["dm"], run["module"], run["trainer"], run["timer"], run["wall"]
    tokens_before, init_from = run["units_before"], run["init_from"]

    result = evaluate(module.model, dm.val_dataset(), batch_size=cfg.data.micro_batch_size)
    save_token_index(run_dir / "token_index.csv", result.pop("token_index_loss"))
    save_inner_losses(run_dir / "inner_losses.csv", inner_losses(module.model, dm.val_dataset()))
    tokens_seen = module.tokens_seen
    metrics = {
        "status": "finished",
        "model": cfg.model.name,
        "size": cfg.size.name,
        "data": cfg.data.name,
        "seq_len": cfg.data.seq_len,
        "params": module.model.num_params(False),
        "non_embedding_params": module.model.num_params(),
        "steps": trainer.global_step,
        "tokens_seen": tokens_seen,
        "skipped_steps": module.skipped_steps,
        "wall_time_s": round(wall, 2),
        "tokens_per_s": round((tokens_seen - tokens_before) / max(wall, 1e-9), 1),
        "steady_tokens_per_s": None if timer.tokens_per_s() is None else round(timer.tokens_per_s(), 1),
        "steady_steps": len(timer.times),
        **result,
        "val_bpb": bits_per_byte(result["val_loss"], dm.bytes_per_token()),
        "train_flops": train_flops(cfg, dm.vocab_size, tokens_seen),
        "init_from": init_from,
        "run_dir": str(run_dir),
    }
    write_json(run_dir / "metrics.json", metrics)
    log.info(
        "val loss %.4f, ppl %.3f, bpb %.4f; outputs in %s",
        metrics["val_loss"],
        metrics["val_ppl"],
        metrics["val_bpb"],
        run_dir,
    )
    return metrics


def train_image(cfg: DictConfig, run_dir: Path) -> dict:
    """`task=image`: a ViT classifier (MTTT or an attention baseline) on images; metrics.json has the
    validation and the held-out test accuracy, inner_losses.csv the mean inner loss per layer and step."""
    check_image_config(cfg)
    geo = image_geometry(cfg, world_size(cfg))
    run = fit(cfg, run_dir, geo, lambda dm: build_module(cfg, dm))
    dm, module, trainer, timer, wall = run["dm"], run["module"], run["trainer"], run["timer"], run["wall"]
    batch = cfg.data.micro_batch_size
    val, val_rows = evaluate_classifier(module.model, dm.val_dataset(), batch, "val")
    test, test_rows = evaluate_classifier(module.model, dm.test_dataset(), batch, "test")
    if val_rows:
        import pandas as pd

        save_inner_losses(run_dir / "inner_losses.csv", pd.DataFrame(val_rows + test_rows))
    images = module.tokens_seen
    flops = count_flops(module.model, dm.token_dim, dm.num_tokens)
    metrics = {
        "status": "finished",
        "task": "image",
        "model": cfg.model.name,
        "size": cfg.size.name,
        "data": cfg.data.name,
        "patch_size": dm.patch_size,
        "image_size": dm.side,
        "num_tokens": dm.num_tokens,
        "params": module.model.num_params(False),
        "non_embedding_params": module.model.num_params(),
        "steps": trainer.global_step,
        "images_seen": images,
        "skipped_steps": module.skipped_steps,
        "wall_time_s": round(wall, 2),
        "images_per_s": round((images - run["units_before"]) / max(wall, 1e-9), 1),
        "steady_images_per_s": None if timer.tokens_per_s() is None else round(timer.tokens_per_s(), 1),
        "steady_steps": len(timer.times),
        **val,
        **test,
        "forward_flops_per_image": flops,
        "train_flops": count_flops(module.model, dm.token_dim, dm.num_tokens, backward=True) * images,
        "run_dir": str(run_dir),
    }
    write_json(run_dir / "metrics.json", metrics)
    log.info("val accuracy %.4f, test accuracy %.4f; outputs in %s", metrics["val_accuracy"],
             metrics["test_accuracy"], run_dir)
    return metrics
