"""Observation for the multi-process tests (tests/test_scaleout.py):
`python -m tests.scaleout_probe train ...` runs `ttt-bench train ...` and appends to the file
$SCALEOUT_PROBE_LOG, from every rank, one line per event:
- `sample RANK INDEX`: a training sample index the rank's sampler handed to its loader, in order;
- `save RANK NAME STEP`: a checkpoint file the rank wrote.
With $SCALEOUT_PROBE_KILL_AT=STEP, rank 0 SIGKILLs its whole process group (every rank: Lightning starts the
other ranks in the launcher's group) before the update of optimizer step STEP (1-based, as losses.csv), as a
preempted job would be killed. Lightning starts the other ranks with this same command line, so they are
observed too."""

import os
import signal
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from ttt_bench.cli.main import main

from ttt_bench.data.datamodule import EpochShuffleSampler
from ttt_bench.training import checkpoint


def record(line: str) -> None:
    with open(os.environ["SCALEOUT_PROBE_LOG"], "a") as f:  # one short append per line: no interleaving
        f.write(line + "\n")


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


iterate = EpochShuffleSampler.__iter__


def observed_iter(self):
    for index in iterate(self):
        record(f"sample {self.rank} {index}")
        yield index


save = checkpoint.AtomicCheckpointIO.save_checkpoint


def observed_save(self, ckpt: dict, path, storage_options=None) -> None:
    record(f"save {rank()} {os.path.basename(path)} {ckpt.get('global_step')}")
    save(self, ckpt, path, storage_options)


class KillGroup(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.is_global_zero and trainer.global_step + 1 == self.step:
            os.killpg(os.getpgid(0), signal.SIGKILL)


def kill_group_at(step: int) -> None:
    init = pl.Trainer.__init__

    def patched(self, *args, callbacks=None, **kwargs):
        init(self, *args, callbacks=[*(callbacks or []), KillGroup(step)], **kwargs)

    pl.Trainer.__init__ = patched


if __name__ == "__main__":
    EpochShuffleSampler.__iter__ = observed_iter
    checkpoint.AtomicCheckpointIO.save_checkpoint = observed_save
    if os.environ.get("SCALEOUT_PROBE_KILL_AT"):
        kill_group_at(int(os.environ["SCALEOUT_PROBE_KILL_AT"]))
    main(sys.argv[1:])
