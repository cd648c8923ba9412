"""`ttt-bench train`: build data and model from the composed config, fit with Lightning, write metrics.json.

Run folder layout (Hydra's output dir):
    .hydra/config.yaml       resolved config            checkpoints/last.ckpt, step-*.ckpt
    metrics.csv              per-step CSV log           metrics.json   final summary
    token_index.csv          final token-index losses   losses.csv     loss of every optimizer step
    identity.json            what the result depends on .lock          held by the process training it

metrics.json's `wall_time_s` is the whole run's (summed over resumes; callbacks.StepTimer) and `tokens_per_s`
divides the tokens by it (start-up, validation and checkpoints included); `steady_tokens_per_s` is the
training loop's own throughput, the number to compare with `ttt-bench bench models`' train phase
(docs/speed.md).
"""

import importlib.util
import logging
import math
import os
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from ..config import task_name
from ..data.epochs import trained_loop_warning
from ..errors import UserError
from ..flops import flops_per_token, train_flops
from ..io import write_json
from ..machine import hardware
from ..vision.flops import count_flops
from .callbacks import LossLog, RunCSVLogger, StepCheckpoint, StepProgressBar, StepTimer, StopOnSignal
from .checkpoint import AtomicCheckpointIO, find_resume_checkpoint, read_checkpoint
from .evaluate import (
    bits_per_byte,
    evaluate,
    evaluate_splits,
    inner_losses,
    save_inner_losses,
    save_token_index,
)
from .module import LitBase, LitClassifier, LitLM
from .run_folder import claim, identity, locked, why_new

log = logging.getLogger(__name__)
# Lightning advertises a hosted logger at every fit (a "Tip:" line): not a message for our users.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "Tip:" not in r.getMessage())
# Lightning's warnings at every fit that ask nothing of our users (wherever training runs: the CLI, sweeps,
# the reproduce pipeline): its pytree helper's use of an API torch 2.13 deprecates, few loader workers on
# purpose, TensorBoard absent, a resumed run's checkpoint folder not empty.
warnings.filterwarnings(
    "ignore", message=".*(LeafSpec|does not have many workers|TensorBoard|exists and is not empty).*")


def one_line_per_lightning_message() -> None:
    """`import lightning` gives the `lightning` logger a console handler of its own, and `lightning.pytorch` /
    `lightning.fabric` one each when the root logger had none yet; with the root logger configured (Hydra's
    job logging, the reproduce pipeline) every Lightning line then printed twice, or once without the run's
    log format and log file. Where the root logger has handlers, Lightning's lines go through them alone."""
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


def batch_geometry(cfg: DictConfig, world_size: int) -> dict:
    """Sequences per optimizer step from the recipe's fixed tokens-per-batch, and the gradient
    accumulation needed to reach it with the data's micro-batch size."""
    seq_len, micro = cfg.data.seq_len, cfg.data.micro_batch_size
    tokens = cfg.recipe.tokens_per_batch  # all >= 1 (check_lm_config)
    if tokens % seq_len:
        raise UserError(f"recipe.tokens_per_batch={tokens} is not a whole number of sequences of "
                        f"data.seq_len={seq_len} tokens; use a multiple, e.g. recipe.tokens_per_batch="
                        f"{max(1, round(tokens / seq_len)) * seq_len}")
    sequences = tokens // seq_len
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


# Settings that must be positive integers / numbers, with an example value each: both tasks', then each
# task's own (a language model's checked when present; an image classifier's always)
POSITIVE_INTS = {
    "data.micro_batch_size": 8,
    "trainer.max_steps": 1000,
    "size.d_model": 768,
    "size.n_layers": 12,
    "size.n_heads": 12,
    "size.mlp_hidden": 2048,
    "checkpoint_every_n_steps": 100,
    "eval_every_n_steps": 100,
}
LM_POSITIVE_INTS = {"data.seq_len": 512, "recipe.tokens_per_batch": 16384}
IMAGE_POSITIVE_INTS = {"recipe.batch_size": 256}
POSITIVE_NUMBERS = {"recipe.lr": 3e-3, "recipe.grad_clip": 1.0}


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# The package each logger of conf/logger/ needs (any one of them), and the install extra that has it.
LOGGER_PACKAGES = {"TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
                   "WandbLogger": (("wandb",), "wandb"), "MLFlowLogger": (("mlflow",), "mlflow")}


def check_loggers(cfg: DictConfig) -> None:
    """Each logger of `logger=` has its package, before anything is written (one line naming the extra)."""
    for name, spec in (cfg.get("logger") or {}).items():
        target = str(spec.get("_target_", "")).rsplit(".", 1)[-1]
        modules, extra = LOGGER_PACKAGES.get(target, ((), None))
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            raise UserError(f"logger={name} needs the {modules[0]} package, which is not installed; "
                            f"pip install -e '.[{extra}]' (or drop logger={name})")


def loggers(cfg: DictConfig, run_dir: Path) -> list:
    """The loggers of `logger=` (conf/logger/), each writing under <run>/<name>/."""
    chosen = cfg.get("logger") or {}
    return [instantiate(spec, save_dir=str(run_dir / name)) for name, spec in chosen.items()]


def check_shared(cfg: DictConfig, ints: dict, required: bool) -> None:
    """What both tasks check before any data is prepared: positive integer and number settings (`ints`
    beside the shared ones; `required`: missing ones are errors too), the learning-rate schedule (warm-up
    then cosine to min_lr, module.py), a trainer this machine can run, and heads that divide the width."""
    for key, example in {**POSITIVE_INTS, **ints, **POSITIVE_NUMBERS}.items():
        value = OmegaConf.select(cfg, key)
        if value is None and not required:
            continue
        integer = key not in POSITIVE_NUMBERS
        if not _number(value) or (integer and not isinstance(value, int)) or value <= 0:
            kind = "a positive integer" if integer else "a positive number"
            raise UserError(f"{key}={value!r} must be {kind}, e.g. {key}={example}")
    seed = OmegaConf.select(cfg, "seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UserError(f"seed={seed!r} must be an integer >= 0, e.g. seed=1")
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.accelerator={cfg.trainer.accelerator} needs a CUDA GPU and this machine "
                        "has none; use trainer=cpu (the default)")
    precision = str(cfg.trainer.get("precision", "32"))
    if cfg.trainer.accelerator == "cpu" and precision.startswith("16"):  # Lightning would use bf16 instead
        raise UserError(f"trainer.precision={precision} (float16) needs a GPU; on the CPU use "
                        "trainer.precision=bf16-mixed or 32")
    check_loggers(cfg)
    lr, min_lr, warmup = cfg.recipe.lr, cfg.recipe.get("min_lr", 0.0), cfg.recipe.get("warmup_fraction", 0.0)
    if not (_number(min_lr) and 0 <= min_lr <= lr):
        raise UserError(f"recipe.min_lr={min_lr!r} must be a number between 0 and recipe.lr={lr}")
    if not (_number(warmup) and 0 <= warmup < 1):
        raise UserError(f"recipe.warmup_fraction={warmup!r} must be a fraction of the steps in [0, 1), "
                        "e.g. 0.1")
    if cfg.size.d_model % cfg.size.n_heads:
        raise UserError(
            f"size.n_heads={cfg.size.n_heads} does not divide size.d_model={cfg.size.d_model}; "
            "pick a number of heads that divides the width"
        )


def check_lm_config(cfg: DictConfig) -> None:
    """A language model's settings: the shared checks, its context against the model's, its mini-batch."""
    check_shared(cfg, LM_POSITIVE_INTS, required=False)
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


def check_image_config(cfg: DictConfig) -> None:
    """An image classifier's settings: the shared checks, image data and an image model, inner SGD's
    mini-batches."""
    check_shared(cfg, IMAGE_POSITIVE_INTS, required=True)
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


def image_geometry(cfg: DictConfig, world_size: int) -> dict:
    """Images per optimizer step (recipe.batch_size) and the gradient accumulation to reach it."""
    images, per_step = cfg.recipe.batch_size, cfg.data.micro_batch_size * world_size
    if images % per_step:
        raise UserError(f"recipe.batch_size={images} is not a multiple of data.micro_batch_size x devices = "
                        f"{per_step}; change one of them")
    return {"sequences_per_step": images, "accumulate": images // per_step, "tokens_per_step": images}


def build_data(cfg: DictConfig, train_tokens: int):
    """The data, prepared for training: a datamodule that takes `train_tokens` (LMDataModule) tokenizes only
    the train shards that hold the tokens the run trains on."""
    dm = instantiate(cfg.data)
    if hasattr(dm, "train_tokens"):
        dm.train_tokens = train_tokens
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
    check_fits(common["model_cfg"], dm.vocab_size, cfg)
    return LitLM(vocab_size=dm.vocab_size, tokenizer=dm.build_tokenizer().spec, **common)


def check_fits(model_cfg: dict, vocab_size: int, cfg: DictConfig) -> None:
    """A model whose weights, gradients and AdamW states (16 bytes a parameter, the parameters counted from
    its FLOPs per token at a context of 1) exceed the memory of the machine or GPU it would train on is a
    one-line error before it is built: `size.n_layers=10**9` would exhaust the memory building it."""
    try:
        params = flops_per_token(model_cfg, 1, vocab_size)["forward"] / 2
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # the model's own constructor says what is wrong with such a config
    on_gpu = cfg.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available()
    have = (torch.cuda.get_device_properties(0).total_memory if on_gpu
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if 16 * params > have:
        size = ", ".join(f"size.{k}={cfg.size[k]}" for k in ("n_layers", "d_model") if k in cfg.size)
        need = 16 * params / 2**30
        raise UserError(f"the model ({size}) has about {params:.3g} parameters: {need:,.0f} GiB for weights, "
                        f"gradients and AdamW states, more than the {have / 2**30:,.0f} GiB of "
                        f"this {'GPU' if on_gpu else 'machine'}; choose a smaller size (e.g. size=xs)")


def fit(cfg: DictConfig, run_dir: Path, geo: dict, make_module) -> dict:
    """What the tasks share: resume-checkpoint choice, seeding, data and module, the run folder's identity,
    callbacks (checkpoints, loss log, step timer, progress), the Lightning fit. `make_module(dm)` builds the
    LightningModule. The caller holds the run folder's lock."""
    found = find_resume_checkpoint(cfg.ckpt_path, run_dir, OmegaConf.to_container(cfg.model, resolve=True))
    resume, resume_step = (found[0], found[1]["global_step"]) if found else (None, 0)
    del found  # the trainer loads it again
    one_line_per_lightning_message()
    L.seed_everything(cfg.seed, workers=True)
    dm = build_data(cfg, int(cfg.trainer.max_steps) * geo["tokens_per_step"])
    if rank_zero_only.rank == 0:
        if loops := trained_loop_warning(str(run_dir), dm):  # a small corpus under a paper-sized budget
            log.warning(loops)
        ident = identity(cfg, getattr(dm, "fingerprint", None))
        if why := why_new(run_dir, ident):
            log.info(why)
        claim(run_dir, ident)
    module = make_module(dm)
    if cfg.trainer.accelerator == "cpu":
        torch.set_float32_matmul_precision("highest")
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
        StopOnSignal(),
        *([StepProgressBar()] if cfg.trainer.get("enable_progress_bar", True) else []),
    ]
    trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=[RunCSVLogger(run_dir, resume_step)]
        + loggers(cfg, run_dir),
        default_root_dir=run_dir,
        accumulate_grad_batches=geo["accumulate"],
        val_check_interval=cfg.eval_every_n_steps * geo["accumulate"],
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,
        plugins=[AtomicCheckpointIO()],
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
        f"; resuming from step {resume_step} of {cfg.trainer.max_steps} (checkpoint {resume})" if resume
        else "",
    )
    trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=False)  # ours, with numpy RNG states
    module.to(trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU: evaluate where it ran
    return {"dm": dm, "module": module, "trainer": trainer, "timer": timer, "wall": timer.wall_s(),
            "init_from": init_from}


def run_summary(cfg: DictConfig, run: dict) -> dict:
    """What metrics.json says of any run: what was trained, how long, how fast, in the task's unit
    (`tokens_seen`, `tokens_per_s`, ... or `images_seen`, `images_per_s`, ...)."""
    module, timer, wall, unit = run["module"], run["timer"], run["wall"], run["module"].unit
    steady = timer.tokens_per_s()
    return {
        "status": "finished",
        "model": cfg.model.name,
        "size": cfg.size.name,
        "data": cfg.data.name,
        "params": module.model.num_params(False),
        "non_embedding_params": module.model.num_params(),
        "steps": run["trainer"].global_step,
        f"{unit}_seen": module.tokens_seen,
        "skipped_steps": module.skipped_steps,
        "wall_time_s": round(wall, 2),
        f"{unit}_per_s": round(module.tokens_seen / max(wall, 1e-9), 1),
        f"steady_{unit}_per_s": None if steady is None else round(steady, 1),
        "steady_steps": timer.timed_steps,
        "hardware": hardware(),
    }


def world_size(cfg: DictConfig) -> int:
    """Processes of the run: nodes x devices per node (devices=-1: every GPU of the node)."""
    devices = torch.cuda.device_count() if cfg.trainer.devices == -1 else int(cfg.trainer.devices)
    return max(1, int(cfg.trainer.get("num_nodes", 1)) * devices)


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """`ttt-bench train`: the task's training, holding the run folder's lock (rank 0 only: the other ranks of
    a multi-process run work in the same folder)."""
    run_dir = Path(run_dir)
    with locked(run_dir, enabled=rank_zero_only.rank == 0):
        return (train_image if task_name(cfg) == "image" else train_lm)(cfg, run_dir)


def train_lm(cfg: DictConfig, run_dir: Path) -> dict:
    """`task=lm`: a language model; metrics.json has the validation loss, perplexity and bits per byte."""
    for group in ("model", "data"):
        if any(t in str(cfg[group].get("_target_", "")) for t in ("ViTClassifier", "ImageDataModule")):
            raise UserError(f"{group}={cfg[group].get('name')} is for image classification; add task=image")
    check_lm_config(cfg)
    geo = batch_geometry(cfg, world_size(cfg))
    run = fit(cfg, run_dir, geo, lambda dm: build_module(cfg, dm))
    dm, module = run["dm"], run["module"]
    if not run["trainer"].is_global_zero:  # the other ranks of a multi-process run: rank 0 writes
        return {}
    init_from = run["init_from"]

    result = evaluate(module.model, dm.val_dataset(), batch_size=cfg.data.micro_batch_size)
    save_token_index(run_dir / "token_index.csv", result.pop("token_index_loss"))
    save_inner_losses(run_dir / "inner_losses.csv", inner_losses(module.model, dm.val_dataset()))
    tokens_seen = module.tokens_seen
    metrics = {
        **run_summary(cfg, run),
        "seq_len": cfg.data.seq_len,
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
    dm, module = run["dm"], run["module"]
    if not run["trainer"].is_global_zero:  # the other ranks of a multi-process run: rank 0 writes
        return {}
    splits = evaluate_splits(module.model, dm, cfg.data.micro_batch_size, run_dir)
    images = module.tokens_seen
    flops = count_flops(module.model, dm.token_dim, dm.num_tokens)
    metrics = {
        "task": "image",
        **run_summary(cfg, run),
        "patch_size": dm.patch_size,
        "image_size": dm.side,
        "num_tokens": dm.num_tokens,
        **splits,
        "forward_flops_per_image": flops,
        "train_flops": count_flops(module.model, dm.token_dim, dm.num_tokens, backward=True) * images,
        "run_dir": str(run_dir),
    }
    write_json(run_dir / "metrics.json", metrics)
    log.info("val accuracy %.4f, test accuracy %.4f; outputs in %s", metrics["val_accuracy"],
             metrics["test_accuracy"], run_dir)
    return metrics
