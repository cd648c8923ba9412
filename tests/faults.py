"""Fault injection for the reliability tests, from the test side: `python -m tests.faults STEP WHERE
train ...` runs `ttt-bench train ...` in a process that SIGKILLs itself, as a crash or a preempted job would,
at optimizer step STEP (1-based, the numbering of losses.csv):
- WHERE=step: while computing step STEP, after its backward pass and before the update;
- WHERE=checkpoint_write: halfway through writing the checkpoint of step STEP (through the same atomic write
  as production, so the test sees what a real crash there leaves);
- WHERE=last_write: halfway through writing last.ckpt at step STEP, after step-STEP.ckpt was written;
- WHERE=final_eval: during the validation after training (STEP unused);
- WHERE=sigint: sends itself SIGINT (Ctrl-C) during step STEP, before the update (it does not die: training
  stops after the step, with its checkpoint).
And `python -m tests.faults 0 WHERE sweep OUT` trains the two-run sweep of tests/test_sweep_folder.py
(tests/helpers.py's two_runs) into OUT in a process that SIGKILLs itself:
- WHERE=between_runs: after the first run finished, before the second starts;
- WHERE=tabulation: while the sweep writes its curves (after both runs, before the registry);
- WHERE=registry_write: halfway through writing registry.csv (through the production atomic write).
(WHERE=step kills a sweep mid-run.)
"""

import contextlib
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from ttt_bench.cli.main import main

from ttt_bench.training import checkpoint, train


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class SignalDuringStep(Callback):
    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def signal_during_step(step: int, signum: int = signal.SIGKILL) -> None:
    init = pl.Trainer.__init__

    def patched(self, *args, callbacks=None, **kwargs):
        init(self, *args, callbacks=[*(callbacks or []), SignalDuringStep(step, signum)], **kwargs)

    pl.Trainer.__init__ = patched


def kill_during_checkpoint_write(step: int, last: bool = False) -> None:
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
        at_step = ckpt.get("global_step") == step and (not last or Path(path).name == "last.ckpt")
        armed[:] = [True] if at_step else []
        save(self, ckpt, path, storage_options)

    checkpoint.atomic_file, checkpoint.AtomicCheckpointIO.save_checkpoint = half_written, patched_save


def kill_during_final_eval(step: int) -> None:
    def killed(*args, **kwargs):
        kill_self()

    train.evaluate = killed


def kill_between_runs(step: int) -> None:
    from ttt_bench.experiments.engine import runner

    run_one = runner.run_one

    def then_die(run_dir):
        run_one(run_dir)
        kill_self()

    runner.run_one = then_die


def kill_during_tabulation(step: int) -> None:
    from ttt_bench.experiments.engine import runner

    runner.run_curves = lambda *a, **k: kill_self()


def kill_during_registry_write(step: int) -> None:
    from ttt_bench import io
    from ttt_bench.experiments.engine import registry

    def half_then_die(path, data, *args, **kwargs):
        if Path(path).name != "registry.csv":
            return io.write_atomic(path, data, *args, **kwargs)
        with io.atomic_file(path, "w") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            kill_self()

    registry.write_atomic = half_then_die


def sweep(out: str) -> None:
    from tests.helpers import two_runs
    from ttt_bench.experiments.engine.runner import Stage, train_stage

    train_stage("table1", "smoke", Stage("t", two_runs()), Path(out))


if __name__ == "__main__":
    step, where, *argv = sys.argv[1:]
    {"step": signal_during_step, "sigint": lambda s: signal_during_step(s, signal.SIGINT),
     "checkpoint_write": kill_during_checkpoint_write,
     "last_write": lambda s: kill_during_checkpoint_write(s, last=True),
     "final_eval": kill_during_final_eval, "between_runs": kill_between_runs,
     "tabulation": kill_during_tabulation, "registry_write": kill_during_registry_write}[where](int(step))
    sweep(argv[1]) if argv[0] == "sweep" else main(argv)
