"""Test-only fault injection (`fault.*` in conf/train.yaml; used by tests/test_reliability.py).

The process kills itself with SIGKILL, as a crash or a preempted job would, at a chosen optimizer step N
(1-based, the numbering of losses.csv):
- `fault.kill_during=step`: while computing step N, after its backward pass and before the update;
- `fault.kill_during=checkpoint_write`: halfway through writing the checkpoint of step N.
Nothing happens with the default `fault.kill_at_step=null`.
"""

import os
import signal

from lightning.pytorch.callbacks import Callback


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillDuringStep(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.step:
            kill_self()
