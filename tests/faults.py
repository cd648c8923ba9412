"""Fault injection for the reliability tests, from the test side: `python -m tests.faults STEP WHERE
train ...` runs `ttt-bench train ...` in a process that SIGKILLs itself, as a crash or a preempted job would,
at optimizer step STEP (1-based, the numbering of losses.csv):
- WHERE=step: while computing step STEP, after its backward pass and before the update;
- WHERE=checkpoint_write: halfway through writing the checkpoint of step STEP (through the same atomic write
  as production, so the test sees what a real crash there leaves).
"""

import contextlib
import os
import signal
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from ttt_bench.cli.main import main

from ttt_bench.training import checkpoint


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillDuringStep(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.step:
            kill_self()


def kill_during_step(step: int) -> None:
    init = pl.Trainer.__init__

    def patched(self, *args, callbacks=None, **kwargs):
        init(self, *args, callbacks=[*(callbacks or []), KillDuringStep(step)], **kwargs)

    pl.Trainer.__init__ = patched


def kill_during_checkpoint_write(step: int) -> None:
    atomic_file, save = checkpoint.atomic_file, checkpoint.AtomicCheckpointIO.save_checkpoint
    armed = []

    @contextlib.contextmanager
    def half_written(path, *args):
        with atomic_file(path, *args) as f:
            yield f
            if armed:
                f.flush()
                f.truncate(f.tell() // 2)
                kill_self()

    def patched_save(self, ckpt: dict, path, storage_options=None) -> None:
        armed[:] = [True] if ckpt.get("global_step") == step else []
        save(self, ckpt, path, storage_options)

    checkpoint.atomic_file, checkpoint.AtomicCheckpointIO.save_checkpoint = half_written, patched_save


if __name__ == "__main__":
    step, where, *argv = sys.argv[1:]
    {"step": kill_during_step, "checkpoint_write": kill_during_checkpoint_write}[where](int(step))
    main(argv)
