"""LightningModule: next-token cross-entropy, AdamW with the recipe's warmup + cosine schedule."""

import logging
import math

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

from ..errors import UserError

log = logging.getLogger(__name__)


def warmup_cosine(step: int, total: int, warmup_fraction: float, peak: float, end: float) -> float:
    """Multiplier of the peak LR: linear warmup over `warmup_fraction` of `total`, cosine to `end`."""
    warmup = max(1, int(warmup_fraction * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (end + 0.5 * (peak - end) * (1 + math.cos(math.pi * progress))) / peak


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B, L+1], loss_mask [B, L] or None). A batch is a token tensor, or a dict with `tokens` and an
    optional boolean `loss_mask`: True where the target tokens[:, t + 1] counts (e.g. MQAR's answers)."""
    if isinstance(batch, dict):
        return batch["tokens"], batch.get("loss_mask")
    return batch, None


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, reduction: str = "mean"):
    """Cross-entropy and accuracy (argmax == target) over the positions where `mask` is True only:
    (loss, accuracy, number of positions). reduction='none' gives every position's loss, 0 off the mask."""
    mask = mask.bool()
    picked, answers = logits[mask].float(), targets[mask]
    losses = F.cross_entropy(picked, answers, reduction="none")
    count = mask.sum()
    with torch.no_grad():
        accuracy = (picked.argmax(-1) == answers).sum() / count.clamp_min(1)
    if reduction == "none":
        return losses.new_zeros(mask.shape).masked_scatter(mask, losses).flatten(), accuracy, count
    total = losses.sum()
    return (total if reduction == "sum" else total / count.clamp_min(1)), accuracy, count


class LitBase(L.LightningModule):
    """The training recipe shared by the tasks: AdamW with the recipe's warmup + cosine schedule, clipping by
    the global gradient norm, the non-finite policy, and the RNG states in checkpoints for bitwise resume.
    A task defines `loss_and_accuracy(batch) -> (loss, accuracy or None, count or None)`, `units(batch)` (what
    `tokens_seen` counts: tokens for language models, images for classifiers) and `validation_step`.

    `nonfinite`: what a NaN/inf loss or gradient does: `stop` the run (UserError with the step; the last good
    checkpoint stays) or `skip` the optimizer update of that step (counted in `skipped_steps`, logged)."""

    unit = "tokens"

    def __init__(self, recipe: dict, max_steps: int = 1, nonfinite: str = "stop"):
        super().__init__()
        if nonfinite not in ("stop", "skip"):
            raise UserError(f"nonfinite must be 'stop' or 'skip', got '{nonfinite}'")
        self.recipe, self.max_steps, self.nonfinite = recipe, max_steps, nonfinite
        self.tokens_seen = self.skipped_steps = 0  # tokens (or images, `unit`) of the optimizer steps so far
        self._resume_rng_states = None

    def loss(self, batch, reduction: str = "mean") -> torch.Tensor:
        return self.loss_and_accuracy(batch, reduction)[0]

    def loss_and_accuracy(self, batch, reduction: str = "mean"):
        raise NotImplementedError

    def units(self, batch) -> int:
        raise NotImplementedError

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, accuracy, _ = self.loss_and_accuracy(batch)
        if not torch.isfinite(loss):
            self._nonfinite(f"training loss ({loss.item()})")
            return None  # skip: Lightning does no backward and no update for this batch
        self.tokens_seen += self.units(batch) * self.trainer.world_size
        if self._logs_written():
            self.log("train/loss", loss, prog_bar=True)
            if accuracy is not None:
                self.log("train/accuracy", accuracy)
            self.log(f"train/{self.unit}", float(self.tokens_seen))
            self.log_extra()
        return loss

    def log_extra(self) -> None:
        """Task-specific values logged with the training loss (e.g. MTTT's inner losses)."""

    def _logs_written(self) -> bool:
        """Whether Lightning writes what this micro-batch logs: the last micro-batch of an optimizer step,
        every `trainer.log_every_n_steps` steps (Lightning's own tests, which give the same answer before the
        step as after it). A `self.log` call costs about a millisecond, so the values no logger would see are
        not logged (the progress bar's loss updates on the written steps). On a Lightning without these
        internals: every micro-batch."""
        trainer = self.trainer
        try:
            return not trainer.fit_loop._should_accumulate() and trainer._logger_connector.should_update_logs
        except AttributeError:
            return True

    def _nonfinite(self, what: str) -> None:
        step = self.global_step + 1  # 1-based, as in losses.csv
        if self.nonfinite == "stop":
            raise UserError(f"non-finite {what} at step {step}; the last good checkpoint is kept in the "
                            "run's checkpoints/ folder; lower the learning rate, or skip such steps with "
                            "nonfinite=skip")
        self.skipped_steps += 1
        log.warning("non-finite %s at step %d: update skipped (%d so far)", what, step, self.skipped_steps)

    def on_before_optimizer_step(self, optimizer) -> None:
        """NaN/inf gradients stop the run or skip the update (`nonfinite`), found from the global gradient
        norm (one fused pass over the gradients), which `configure_gradient_clipping` then clips with."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if self._grad_norm is not None and not torch.isfinite(self._grad_norm):
            self._grad_norm = None
            self._nonfinite("gradient")
            optimizer.zero_grad(set_to_none=True)  # skip: AdamW leaves parameters without gradients alone

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning's clipping by the global norm (recipe.grad_clip), with the norm that
        `on_before_optimizer_step` computed for this step (Lightning calls this hook right after it) instead
        of a second pass over the gradients."""
        norm, self._grad_norm = getattr(self, "_grad_norm", None), None
        if norm is not None and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            params = [p for p in self.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._resume_rng_states is not None:  # where the interrupted run was (see on_save_checkpoint)
            _set_rng_states(self._resume_rng_states)
            self._resume_rng_states = None
        for block in self.model.blocks:  # e.g. TTT-MLP's inner-LR warmup over the outer warmup
            if hasattr(block, "on_train_step"):
                block.on_train_step(self.global_step, int(self.recipe["warmup_fraction"] * self.max_steps))

    def configure_optimizers(self):
        r = self.recipe
        # no weight decay on vectors (norms, biases) nor on parameters flagged `_no_weight_decay` (Mamba A, D)
        decayed = lambda p: p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)
        decay = [p for p in self.parameters() if p.requires_grad and decayed(p)]
        no_decay = [p for p in self.parameters() if p.requires_grad and not decayed(p)]
        o = r["optimizer"]
        try:
            opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": o["weight_decay"]},
                 {"params": no_decay, "weight_decay": 0.0}],
                lr=r["lr"], betas=tuple(o["betas"]), eps=o["eps"])
        except (ValueError, TypeError) as e:  # torch's message names no config key
            raise UserError(f"recipe.optimizer (betas={list(o['betas'])}, eps={o['eps']}, weight_decay="
                            f"{o['weight_decay']}) or recipe.lr={r['lr']}: {e}; e.g. "
                            "recipe.optimizer.betas=[0.9,0.95]") from None
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, self.max_steps, r["warmup_fraction"], r["lr"], r["min_lr"]))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"], checkpoint["skipped_steps"] = self.tokens_seen, self.skipped_steps
        # Checkpoints are written after a step; the RNG states are restored before the next one on resume.
        checkpoint["rng_states"] = _collect_rng_states()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.skipped_steps = checkpoint.get("skipped_steps", 0)
        self._resume_rng_states = checkpoint.get("rng_states")


class LitLM(LitBase):
    """Next-token cross-entropy over a `LanguageModel` built from `model_cfg`. Hyper-parameters (the model
    config, recipe and tokenizer spec) are saved in every checkpoint, so `LitLM.load_from_checkpoint` rebuilds
    it."""

    def __init__(self, model_cfg: dict, recipe: dict, vocab_size: int, tokenizer: dict, max_steps: int = 1,
                 config: dict | None = None, nonfinite: str = "stop"):
        super().__init__(recipe, max_steps, nonfinite)
        self.save_hyperparameters()
        self.model = instantiate(model_cfg, vocab_size=vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def units(self, batch) -> int:
        return split_batch(batch)[0][:, 1:].numel()

    def loss_and_accuracy(self, batch: torch.Tensor | dict, reduction: str = "mean"):
        """(loss, accuracy, positions). Without a loss mask (see `split_batch`): the cross-entropy of every
        target, accuracy and positions None. With one: loss and accuracy over the masked targets only."""
        tokens, mask = split_batch(batch)
        logits = self.model(tokens[:, :-1])
        if mask is None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction=reduction)
            return loss, None, None
        return masked_loss(logits, tokens[:, 1:], mask, reduction)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, accuracy, positions = self.loss_and_accuracy(batch)
        if accuracy is None:
            self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        elif positions := int(positions):  # weighted by masked positions: the epoch value is their mean
            self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=positions)
            self.log("val/accuracy", accuracy, prog_bar=True, sync_dist=True, batch_size=positions)


class LitClassifier(LitBase):
    """Image classification (`task=image`): cross-entropy and accuracy of a `ViTClassifier` built from
    `model_cfg` with the data's token geometry. Hyper-parameters are saved in every checkpoint, so
    `LitClassifier.load_from_checkpoint` rebuilds it. With TTT layers, the inner losses of the last
    training batch are logged per layer and inner step (train/inner_loss/L<layer>_t<step>)."""

    unit = "images"

    def __init__(self, model_cfg: dict, recipe: dict, num_classes: int, token_dim: int, num_tokens: int,
                 max_steps: int = 1, config: dict | None = None, nonfinite: str = "stop"):
        super().__init__(recipe, max_steps, nonfinite)
        self.save_hyperparameters()
        self.model = instantiate(model_cfg, num_classes=num_classes, token_dim=token_dim,
                                 num_tokens=num_tokens)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def units(self, batch: dict) -> int:
        return len(batch["label"])

    def loss_and_accuracy(self, batch: dict, reduction: str = "mean"):
        """(loss, accuracy, images) of a batch {"tokens" [B, n, p*p*C], "label" [B]}."""
        logits = self.model(batch["tokens"]).float()
        loss = F.cross_entropy(logits, batch["label"], reduction=reduction)
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == batch["label"]).float().mean()
        return loss, accuracy, len(batch["label"])

    def log_extra(self) -> None:
        inner = self.model.inner_losses()
        if inner is not None:
            for layer, losses in enumerate(inner.tolist()):
                for t, value in enumerate(losses):
                    self.log(f"train/inner_loss/L{layer}_t{t}", value)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, accuracy, images = self.loss_and_accuracy(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=images)
        self.log("val/accuracy", accuracy, prog_bar=True, sync_dist=True, batch_size=images)
