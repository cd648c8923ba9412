"""Scale-out configs as Lightning resolves them, without a cluster: trainer=slurm under the environment
SLURM sets for a 2-node x 2-task job, and the submitit launcher composing from the `slurm` extra. Then
scale-out that runs (issue 22): DDP on two CPU processes against one process (losses, parameters,
validation, the ranks' samples, checkpoints, a kill of the process group and its resume), FSDP's refusal
of CPU processes, and one optimizer step of each language model at the paper's 125m size."""

import argparse
import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment

from ttt_bench.bench.step import LANGUAGE_MODELS, LLAMA_VOCAB, in_fresh_process
from ttt_bench.config import compose

REPO = Path(__file__).resolve().parents[1]

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


# ---- DDP on two CPU processes (gloo) against one process ----

# 4 optimizer steps of 16 sequences of 64 tokens (1024 tokens per step): one process accumulates 4
# micro-batches of 4, each of two DDP ranks 2 of them. A checkpoint every step, validation every 2 steps.
DDP_RUN = ["model=ttt_linear", "size=xs", "data.corpus.train_docs=24", "data.corpus.validation_docs=4",
           "data.corpus.mean_doc_bytes=4000", "data.seq_len=64", "data.micro_batch_size=4",
           "recipe.tokens_per_batch=1024", "data.num_proc=1", "data.val_tokens=512", "trainer.max_steps=4",
           "checkpoint_every_n_steps=1", "eval_every_n_steps=2", "trainer.log_every_n_steps=1",
           "trainer.enable_progress_bar=false"]
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
SEQUENCES_PER_STEP, STEPS = 16, 4
# float32 throughout. DDP's gradient is the all-reduced mean of two ranks' accumulated gradients, one process
# sums the same per-sequence gradients in another order: equal up to float32 rounding, not bitwise. Measured
# after 4 steps: losses within ~1e-7 relative, parameters within ~2e-6 absolute (AdamW's normalised update
# turns a rounding difference in a small gradient into a difference of up to lr x that relative difference).
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5


def probe(runs: Path, log: Path, *overrides: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    """`ttt-bench train` under tests/scaleout_probe.py in a session of its own (the process group its ranks
    share, which a kill takes down whole)."""
    env = {**os.environ, "SCALEOUT_PROBE_LOG": str(log), "OMP_NUM_THREADS": "1"}
    env.pop("SCALEOUT_PROBE_KILL_AT", None)
    if kill_at is not None:
        env["SCALEOUT_PROBE_KILL_AT"] = str(kill_at)
    return subprocess.run([sys.executable, "-m", "tests.scaleout_probe", "train", *DDP_RUN, *overrides,
                           f"paths.runs={runs}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, start_new_session=True)


def the_run(runs: Path) -> Path:
    (folder,) = runs.glob("*/*/checkpoints")
    return folder.parent


def probe_lines(log: Path, kind: str) -> list[list[str]]:
    return [line.split()[1:] for line in log.read_text().splitlines() if line.startswith(kind + " ")]


def final_params(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


def losses(run: Path) -> list[float]:
    return [float(r.split(",")[1]) for r in (run / "losses.csv").read_text().splitlines()[1:]]


def val_losses(run: Path) -> list[float]:
    with open(run / "metrics.csv") as f:
        return [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]


@pytest.fixture(scope="module")
def one_and_two_processes(tmp_path_factory):
    """The same run in one process (in this one, its sampler observed) and in two DDP processes."""
    from ttt_bench.cli.main import main

    from ttt_bench.data.datamodule import EpochShuffleSampler

    root = tmp_path_factory.mktemp("ddp")
    single_samples = []
    iterate = EpochShuffleSampler.__iter__

    def observed(self):
        for index in iterate(self):
            single_samples.append(index)
            yield index

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EpochShuffleSampler, "__iter__", observed)
        main(["train", *DDP_RUN, f"paths.runs={root / 'one'}"])
    done = probe(root / "two", root / "two.log", *DDP)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"one": the_run(root / "one"), "two": the_run(root / "two"), "log": root / "two.log",
            "single_samples": single_samples, "root": root}


def test_ddp_on_two_cpu_processes_trains_what_one_process_trains(one_and_two_processes):
    """trainer=ddp trainer.accelerator=cpu trainer.devices=2 against trainer=cpu, same seed and global batch:
    the same per-step losses and final parameters (float32 tolerance, see LOSS_RTOL), the same validation
    losses during training and in metrics.json, the same tokens counted."""
    one, two = one_and_two_processes["one"], one_and_two_processes["two"]
    assert len(losses(one)) == STEPS
    assert losses(two) == pytest.approx(losses(one), rel=LOSS_RTOL)
    a, b = final_params(one), final_params(two)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= PARAM_ATOL, worst
    assert len(val_losses(two)) == 2 and val_losses(two) == pytest.approx(val_losses(one), rel=LOSS_RTOL)
    m1, m2 = (json.loads((r / "metrics.json").read_text()) for r in (one, two))
    assert m2["tokens_seen"] == m1["tokens_seen"] == STEPS * SEQUENCES_PER_STEP * 64
    assert m2["steps"] == m1["steps"] == STEPS
    assert m2["val_loss"] == pytest.approx(m1["val_loss"], rel=LOSS_RTOL)
    assert (two / "token_index.csv").is_file() and (two / "train_ddp_process_1.log").is_file()


def test_ddp_ranks_see_disjoint_halves_of_the_single_process_batch(one_and_two_processes):
    """Each optimizer step, the two ranks' samples are disjoint and together are the samples one process
    trains on in that step (EpochShuffleSampler: rank r takes every 2nd sample of the one global stream)."""
    samples = probe_lines(one_and_two_processes["log"], "sample")
    by_rank = {r: [int(i) for rank, i in samples if int(rank) == r] for r in (0, 1)}
    single, half = one_and_two_processes["single_samples"], SEQUENCES_PER_STEP // 2
    for step in range(STEPS):
        r0, r1 = (set(by_rank[r][step * half:(step + 1) * half]) for r in (0, 1))
        assert len(r0) == len(r1) == half and not r0 & r1
        assert r0 | r1 == set(single[step * SEQUENCES_PER_STEP:(step + 1) * SEQUENCES_PER_STEP])


def test_ddp_checkpoints_are_written_once_by_rank_zero(one_and_two_processes):
    saves = probe_lines(one_and_two_processes["log"], "save")
    assert {rank for rank, _, _ in saves} == {"0"}
    expected = [(name, str(s)) for s in range(1, STEPS + 1) for name in (f"step-{s}.ckpt", "last.ckpt")]
    assert sorted((name, step) for _, name, step in saves) == sorted(expected)  # each file once per step
    names = sorted(p.name for p in (one_and_two_processes["two"] / "checkpoints").iterdir())
    assert names == sorted(["last.ckpt", *(f"step-{s}.ckpt" for s in range(1, STEPS + 1))])


def test_ddp_group_killed_mid_run_resumes_to_the_same_final_state(one_and_two_processes):
    """SIGKILL of every rank before the update of step 3, then the same command again: it resumes from
    step-2.ckpt and ends where the uninterrupted DDP run ended: losses.csv and parameters identical."""
    root = one_and_two_processes["root"]
    killed = probe(root / "chain", root / "chain.log", *DDP, kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = the_run(root / "chain")
    assert sorted(p.name for p in (run / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step-1.ckpt",
                                                                          "step-2.ckpt"]
    resumed = probe(root / "chain", root / "chain.log", *DDP)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step 2 of 4 (checkpoint {run / 'checkpoints' / 'last.ckpt'})" in \
        (run / "main.log").read_text()
    reference = one_and_two_processes["two"]
    assert (run / "losses.csv").read_text() == (reference / "losses.csv").read_text()
    a, b = final_params(run), final_params(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)



def test_fsdp_on_cpu_processes_is_refused_in_one_line_saying_why(tmp_path, capsys):
    """Lightning 2.6's FSDPStrategy is CUDA-only (ttt_bench/training/distributed.py has the reasons): the
    trainer config refuses CPU processes with the CLI's one-line error and leaves no run folder."""
    from ttt_bench.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["train", *DDP_RUN, "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
              f"paths.runs={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("ttt-bench: error: trainer=fsdp runs on CUDA GPUs only")
    assert "'FSDP needs a non-CPU accelerator device'" in err and "trainer=ddp trainer.accelerator=cpu" in err
    assert not list(tmp_path.rglob("identity.json"))

# ---- paper sizes on CPU ----

# One optimizer step at size=125m (64 tokens, micro-batch 1, the Llama vocabulary) takes 4-9 s of compute
# plus ~5 s of process start on 2 busy cores (README, `ttt-bench bench step`): transformer and ttt_linear
# run in the default suite, the other models are marked slow.
PAPER_SIZE_MODELS = [m if m in ("transformer", "ttt_linear") else pytest.param(m, marks=pytest.mark.slow)
                     for m in LANGUAGE_MODELS]


def test_peak_memory_is_the_fresh_process_own_not_its_parent():
    """getrusage's ru_maxrss survives exec: a child of a large process (pytest late in `make test`) reported
    its parent's peak, so the 125m step grew by 0 MB in CI. The high-water mark read must be the child's."""
    ballast = bytearray(768 * 2**20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page: resident, not just reserved
    child = subprocess.run([sys.executable, "-c", "from ttt_bench.bench.step import _max_rss_mb; "
                            "print(_max_rss_mb())"], capture_output=True, text=True, check=True)
    assert float(child.stdout) < 512, child.stdout
    del ballast


@pytest.mark.parametrize("model", PAPER_SIZE_MODELS)
def test_one_optimizer_step_at_125m_runs_on_cpu_with_its_peak_memory(model, record_property):
    """size=125m (Table 3: 12 blocks of width 768; Mamba 24) at a 64-token context: one AdamW step of the
    training recipe in a fresh process, finite, updating the weights; its peak resident memory grows by at
    least the parameters (4 bytes each) and stays under 4 GB. The high-water mark is recorded, not bounded
    tighter."""
    args = argparse.Namespace(size="125m", seq_len=64, micro_batch=1, vocab_size=LLAMA_VOCAB, threads=1,
                              set=[])
    row = in_fresh_process(model, args)
    assert row["note"] is None, row
    assert 100e6 < row["params"] < 130e6, row["params"]  # 125M class, with a 32000-token embedding
    grown = row["peak_rss_mb"] - row["base_rss_mb"]
    assert 4 * row["params"] / 2**20 <= grown and row["peak_rss_mb"] < 4096, row
    for key in ("params", "step_s", "peak_rss_mb"):
        record_property(key, row[key])
