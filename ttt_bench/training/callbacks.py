"""The Lightning callbacks and logger of `ttt-bench train`. Everything a run records survives a kill and a
resume: checkpoints at the final step, per-step losses, the CSV log, the wall clock and step timings (kept
in the checkpoints), a progress bar that counts optimizer steps."""

import csv
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from ..errors import Interrupted, UserError
from ..io import atomic_file, read_table, write_atomic


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint every `every_n_train_steps` steps and at the final step, after the final validation,
    so last.ckpt is the model that metrics.json describes (Lightning saves on multiples of the interval only).
    It does not save again the step a run resumed from: Lightning would rewrite step-N.ckpt and last.ckpt
    after the first micro-batch, mid-accumulation, and a resume from those would misplace the accumulation
    windows. A run resumed from a step-N.ckpt at its final step (killed between that file and last.ckpt)
    copies it to last.ckpt. The loggers are flushed before every checkpoint, so a resume from it finds every
    row logged before it on disk."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:  # the final step: saved by on_train_end, after the
            return                                        # final validation has logged its rows
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save_now(trainer)  # the final step
        super().on_train_end(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        """(Lightning skips the train hooks of a run resumed at its final step; this one always runs.)"""
        last = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        resumed = trainer.ckpt_path and Path(trainer.ckpt_path).resolve() != last.resolve()
        if resumed and not getattr(self, "_saved_here", False) and trainer.is_global_zero:
            with open(trainer.ckpt_path, "rb") as src, atomic_file(last) as dst:
                shutil.copyfileobj(src, dst)

    def save_now(self, trainer) -> None:
        """step-N.ckpt and last.ckpt at the current step (unless saved already): StopOnSignal's checkpoint."""
        if trainer.global_step != self._last_global_step_saved:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        for logger in trainer.loggers:
            logger.save()
        super()._save_checkpoint(trainer, filepath)
        self._saved_here = True


class StopOnSignal(Callback):
    """Ctrl-C (SIGINT) or SIGTERM during training: finish the optimizer step in progress and its logging, then
    save its checkpoint (atomically, step-N.ckpt and last.ckpt, through the run's StepCheckpoint) and raise
    Interrupted, so the same command resumes from it bitwise. A second signal stops at once (Python's
    default handling)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum, self.previous, self.stop = None, {}, False

    def _received(self, signum, frame) -> None:
        self.signum = signum
        for sig, handler in self.previous.items():  # the next one is not caught
            signal.signal(sig, handler)

    def on_train_start(self, trainer, pl_module) -> None:
        self.step_seen = trainer.global_step
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._received) for sig in self.SIGNALS}

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
        boundary, self.step_seen = trainer.global_step != self.step_seen, trainer.global_step
        if not boundary:  # mid-accumulation: a checkpoint there would not resume exactly
            return
        self.stop = self.signum is not None
        if trainer.world_size > 1:  # all ranks stop at the same step (a signal reaches each at its own time)
            self.stop = trainer.strategy.reduce_boolean_decision(self.stop, all=False)

    def on_train_batch_start(self, trainer, pl_module, *args, **kwargs) -> None:
        if self.stop:  # the step's rows are logged by now (Lightning logs after on_train_batch_end)
            trainer.checkpoint_callback.save_now(trainer)
            raise Interrupted(trainer.global_step, trainer.max_steps)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


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
            rows = []
            if self.path.is_file():  # checked first: a damaged row is a one-line error, not a traceback
                read_table(self.path, required=("step", "loss"), numeric=("step", "loss"),
                           fix="restore it, or move it away to start the log again")
                rows = self.path.read_text().splitlines()[1:]
            kept = [r for r in rows if r.strip() and int(float(r.split(",")[0])) <= self.step]
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

    def on_train_start(self, trainer, *args) -> None:
        super().on_train_start(trainer, *args)
        # A resumed run is mid-epoch (the stream is endless), and Lightning then skips on_train_epoch_start:
        # without this its bar read "93/?", no total and no ETA.
        self.count_steps(trainer)

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)  # a new bar (Lightning's total: none)
        self.count_steps(trainer)

    def count_steps(self, trainer) -> None:
        """The bar counts optimizer steps: from the run's current step (the ETA's rate counts this segment's
        steps only) to max_steps."""
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
            if "step" not in (reader.fieldnames or []):
                raise UserError(f"{self.metrics_file_path} has no 'step' column (was its header edited?); "
                                "restore the header, or move the file away to start the log again")
            try:
                rows = [r for r in reader if int(float(r["step"])) < self.resume_step]
            except (TypeError, ValueError):
                raise UserError(f"{self.metrics_file_path} has a row whose step is not a number; fix or "
                                "remove that row") from None
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
