"""The Lightning callbacks and logger of `ttt-bench train`. Everything a run records survives a kill and a
resume: checkpoints at the final step, per-step losses, the CSV log, the wall clock and step timings (kept
in the checkpoints), a progress bar that counts optimizer steps."""

import csv
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from ..io import atomic_file, write_atomic


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
    checkpoint. With several processes the step's loss is averaged over the ranks (all-reduce), the loss of
    the global batch, as one process computes it."""

    def __init__(self, path: Path):
        self.path, self.step, self.total = path, 0, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step, self.total = trainer.global_step, None
        if trainer.is_global_zero:
            rows = self.path.read_text().splitlines()[1:] if self.path.is_file() else []
            kept = [r for r in rows if int(r.split(",")[0]) <= self.step]
            write_atomic(self.path, "\n".join(["step,loss", *kept]) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = (outputs or {}).get("loss")  # divided by the accumulation factor; none for a skipped batch
        if loss is not None:
            self.total = (self.total or 0.0) + loss.item()
        if trainer.global_step != self.step:
            self.step = trainer.global_step
            if trainer.world_size > 1:  # the step's loss is the mean of the ranks' (each rank: its share)
                total = torch.tensor(float("nan") if self.total is None else self.total, dtype=torch.float64)
                self.total = trainer.strategy.reduce(total.to(pl_module.device), reduce_op="mean").item()
            if trainer.is_global_zero:
                with self.path.open("a") as f:
                    f.write(f"{self.step},{'nan' if self.total is None else repr(self.total)}\n")
            self.total = None


class StepTimer(Callback):
    """The run's clocks, kept in its checkpoints so that they cover the whole run across resumes:
    `wall_s()`, the wall time of the fit segments that produced the final model (the work between a
    segment's last checkpoint and its crash is lost and not counted), and the wall time of every optimizer
    step, from the end of the previous one (loading its micro-batches, forward and backward, the update,
    logging). `tokens_per_s()` is the steady state: it leaves out the first `warmup` steps of each process
    (allocator, caches, kernels built at first use) and every step during which the run validated or wrote
    a checkpoint."""

    def __init__(self, tokens_per_step: int, warmup: int = 5):
        self.tokens_per_step, self.warmup = tokens_per_step, warmup
        self.timed_s, self.timed_steps, self.wall_before, self.start = 0.0, 0, 0.0, time.perf_counter()
        self.step, self.last, self.done, self.excluded = None, None, 0, False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self.step, self.last, self.done, self.excluded = trainer.global_step, None, 0, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:  # inside an accumulation window
            return
        now = time.perf_counter()
        if self.last is not None and self.done >= self.warmup and not self.excluded:
            self.timed_s, self.timed_steps = self.timed_s + now - self.last, self.timed_steps + 1
        self.step, self.last, self.done, self.excluded = trainer.global_step, now, self.done + 1, False

    def on_validation_start(self, trainer, pl_module) -> None:
        self.excluded = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.excluded = True

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.start

    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step * self.timed_steps / self.timed_s if self.timed_steps else None

    def state_dict(self) -> dict:
        return {"wall_s": self.wall_s(), "timed_s": self.timed_s, "timed_steps": self.timed_steps}

    def load_state_dict(self, state: dict) -> None:
        self.wall_before, self.timed_s = state["wall_s"], state["timed_s"]
        self.timed_steps = state["timed_steps"]


class StepProgressBar(TQDMProgressBar):
    """Optimizer steps against `trainer.max_steps`, from the step a run resumed at, so the bar's total and ETA
    are the run's (Lightning's bar counts micro-batches of the endless training stream against no total)."""

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step
        bar.set_description("step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar, n = self.train_progress_bar, trainer.global_step
        if bar is not None and not bar.disable and n != bar.n:
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes metrics.csv when it starts; this one keeps the rows logged before the
    step the run resumed from (the rows after it were logged by a segment whose work was lost)."""

    def __init__(self, log_dir: str, resume_step: int):
        self.resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            rows = [r for r in reader if int(float(r["step"])) < self.resume_step]
            self.metrics_keys = list(reader.fieldnames or [])
        with atomic_file(self.metrics_file_path, "w") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)


class RunCSVLogger(CSVLogger):
    """metrics.csv in the run folder, appended to across resumes: every logged row once, in order."""

    def __init__(self, run_dir: Path, resume_step: int):
        super().__init__(run_dir, name="", version="")
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(self.log_dir, self.resume_step)
        return self._experiment
