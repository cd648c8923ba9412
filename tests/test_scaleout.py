"""Scale-out configs as Lightning resolves them, without a cluster: trainer=slurm under the environment
SLURM sets for a 2-node x 2-task job, and the submitit launcher composing from the `slurm` extra."""

import importlib.util

import pytest
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment

from ttt_bench.config import compose

# What `sbatch --nodes=2 --ntasks-per-node=2` sets for the task with global rank 3 (second task of node02).
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "ttt-bench",  # not "bash": Lightning treats an interactive job as no SLURM job
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NODELIST": "node[01-02]",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
}


@pytest.fixture
def restore_rank_zero(monkeypatch):
    """A Trainer of rank 3 makes Lightning's process-wide rank 3: every later rank-zero-only call in this
    test process (loggers writing metrics.csv, checkpoints) would be skipped. Put rank 0 back afterwards."""
    import lightning.pytorch.utilities.rank_zero as pl_rank_zero
    import lightning_utilities.core.rank_zero as utils_rank_zero

    for module in (pl_rank_zero, utils_rank_zero):
        monkeypatch.setattr(module.rank_zero_only, "rank", module.rank_zero_only.rank)


def test_trainer_slurm_resolves_world_size_ranks_and_master_address(monkeypatch, restore_rank_zero):
    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    for k in ("MASTER_ADDR", "MASTER_PORT"):  # recorded, so what Lightning sets here is undone afterwards
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    # on CPU processes (gloo) with fp32: the same resolution a GPU node gets
    cfg = compose("train", ["trainer=slurm", "trainer.accelerator=cpu", "trainer.precision=32-true"])
    assert (cfg.trainer.num_nodes, cfg.trainer.devices) == (2, 2)  # from SLURM_NNODES, SLURM_NTASKS_PER_NODE
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    env = trainer.strategy.cluster_environment
    assert isinstance(env, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (4, 3, 1, 1)
    assert env.main_address == "node01" and 10000 <= env.main_port <= 19999  # the port: from the job id


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="needs the slurm extra: pip install -e '.[slurm]'")
def test_submitit_slurm_launcher_composes():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module("ttt_bench.conf", version_base="1.3"):
        cfg = hydra_compose("train", ["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
