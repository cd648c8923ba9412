"""Faults survived: SIGKILL at several points of training then resume, corrupt checkpoints, atomic writes,
non-finite losses, and token-cache integrity. CPU only, tiny configs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from omegaconf import OmegaConf
from ttt_bench.cli.main import main

from tests.conftest import TINY
from ttt_bench.config import compose
from ttt_bench.data import LMDataModule, SyntheticCorpus
from ttt_bench.data.token_cache import cache_key, load_tokens
from ttt_bench.errors import UserError
from ttt_bench.io import write_json
from ttt_bench.training.module import LitLM
from ttt_bench.training.run_folder import locked

# 8 steps of 8 sequences of 64 tokens (2 micro-batches of 4 accumulated), a checkpoint every step.
RUN = [*TINY, "size=xs", "data.corpus.train_docs=20", "data.val_tokens=512", "trainer.max_steps=8",
       "checkpoint_every_n_steps=1", "eval_every_n_steps=1000", "trainer.deterministic=true"]


def train_in_process(*overrides: str) -> None:
    main(["train", *RUN, *overrides])


def train_killed(step: int, where: str, *overrides: str) -> None:
    """A training process that SIGKILLs itself at optimizer step `step`, during the step or during the
    write of its checkpoint (tests/faults.py)."""
    proc = subprocess.run([sys.executable, "-m", "tests.faults", str(step), where, "train", *RUN, *overrides],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == -9, proc.stderr[-3000:]


def run_dir(runs: Path) -> Path:
    (folder,) = runs.glob("*/*/checkpoints")
    return folder.parent


def final_state(folder: Path) -> dict:
    ckpt = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = ("global_step", "state_dict", "optimizer_states", "lr_schedulers", "tokens_seen", "rng_states")
    return {k: ckpt[k] for k in keys}


def assert_identical(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    """Killed during step 3, during the checkpoint write of step 5, during step 7 (then last.ckpt truncated):
    each resume with the same command reaches the parameters, optimizer and LR state, and per-step losses of
    an uninterrupted run, bitwise. A resume from an explicit ckpt_path= does too."""
    ref, chain, explicit = tmp_path / "ref", tmp_path / "chain", tmp_path / "explicit"
    evals = ["eval_every_n_steps=2", "trainer.log_every_n_steps=2"]  # step 3's kill resumes from a validation
    train_in_process(f"paths.runs={ref}", *evals)
    reference = run_dir(ref)

    train_killed(3, "step", f"paths.runs={chain}", *evals)
    folder = run_dir(chain)
    names = sorted(p.name for p in (folder / "checkpoints").glob("*.ckpt"))
    assert names == ["last.ckpt", "step-1.ckpt", "step-2.ckpt"]
    train_killed(5, "checkpoint_write", f"paths.runs={chain}", *evals)
    assert not (folder / "checkpoints" / "step-5.ckpt").exists()  # the half-written file never got its name
    assert len(list((folder / "checkpoints").glob(".step-5.ckpt.*.tmp"))) == 1
    train_killed(7, "step", f"paths.runs={chain}", *evals)
    last = folder / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 3])  # as a crashed non-atomic write would
    train_in_process(f"paths.runs={chain}", *evals)

    log = (folder / "main.log").read_text()
    assert "last.ckpt is unreadable" in log
    assert f"resuming from step 6 of 8 (checkpoint {folder / 'checkpoints' / 'step-6.ckpt'})" in log
    assert (folder / "losses.csv").read_text() == (reference / "losses.csv").read_text()
    assert len((reference / "losses.csv").read_text().splitlines()) == 1 + 8
    assert (folder / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()  # every row once
    assert_identical(final_state(folder), final_state(reference))
    assert json.loads((folder / "metrics.json").read_text())["val_loss"] == \
        json.loads((reference / "metrics.json").read_text())["val_loss"]

    train_in_process(f"paths.runs={explicit}", *evals, f"ckpt_path={folder / 'checkpoints' / 'step-4.ckpt'}")
    assert_identical(final_state(run_dir(explicit)), final_state(reference))
    rows = (run_dir(explicit) / "losses.csv").read_text().splitlines()
    assert rows[1:] == (reference / "losses.csv").read_text().splitlines()[5:]


def test_the_final_model_is_saved_when_max_steps_is_not_a_multiple_of_the_interval(tmp_path):
    """8 steps, a checkpoint every 3: step-3, step-6 and step-8 are written, and last.ckpt is step 8, the
    model metrics.json describes. Re-running from step-3.ckpt rewrites last.ckpt (no last-v1.ckpt)."""
    train_in_process(f"paths.runs={tmp_path}", "checkpoint_every_n_steps=3")
    folder = run_dir(tmp_path)
    names = sorted(p.name for p in (folder / "checkpoints").glob("*.ckpt"))
    assert names == ["last.ckpt", "step-3.ckpt", "step-6.ckpt", "step-8.ckpt"]
    last = final_state(folder)
    assert last["global_step"] == 8 == json.loads((folder / "metrics.json").read_text())["steps"]
    step8 = torch.load(folder / "checkpoints" / "step-8.ckpt", map_location="cpu", weights_only=False)
    assert_identical(last["state_dict"], step8["state_dict"])

    train_in_process(f"paths.runs={tmp_path}", "checkpoint_every_n_steps=3",
                     f"ckpt_path={folder / 'checkpoints' / 'step-3.ckpt'}")
    assert not list((folder / "checkpoints").glob("last-v*.ckpt"))
    assert_identical(final_state(folder)["state_dict"], step8["state_dict"])


@pytest.mark.parametrize("where", ["checkpoint_write", "last_write", "final_eval"])
def test_a_kill_at_the_end_of_training_still_leaves_the_final_model(tmp_path, where):
    """SIGKILL during the final checkpoint's write, during the write of last.ckpt after step-8.ckpt was
    written, or during the validation after training: the same command finishes with last.ckpt at the final
    step, bitwise the uninterrupted run's, and metrics.csv and losses.csv with every row of it. The CSV log is
    flushed at every checkpoint (logged every step here), so a resume never loses a logged row."""
    ref, chain = tmp_path / "ref", tmp_path / "chain"
    every = ["checkpoint_every_n_steps=2", "trainer.log_every_n_steps=1"]
    train_in_process(f"paths.runs={ref}", *every)
    train_killed(8, where, f"paths.runs={chain}", *every)
    folder = run_dir(chain)
    assert not (folder / "metrics.json").exists()
    train_in_process(f"paths.runs={chain}", *every)
    reference = run_dir(ref)
    assert_identical(final_state(folder), final_state(reference))
    for name in ("metrics.csv", "losses.csv"):
        assert (folder / name).read_text() == (reference / name).read_text(), name
    assert json.loads((folder / "metrics.json").read_text())["steps"] == 8


def test_ctrl_c_saves_the_step_and_the_same_command_resumes(tmp_path):
    """SIGINT during step 3, long before the first checkpoint (every 100 steps): the step finishes,
    step-3.ckpt and last.ckpt are written, the process says so in one line and exits 130; the same command
    resumes from step 3 and ends bitwise where an uninterrupted run ends, with the same losses and CSV log."""
    ref, chain = tmp_path / "ref", tmp_path / "chain"
    every = ["checkpoint_every_n_steps=100", "trainer.log_every_n_steps=1"]
    train_in_process(f"paths.runs={ref}", *every)
    proc = subprocess.run([sys.executable, "-m", "tests.faults", "3", "sigint", "train", *RUN,
                           f"paths.runs={chain}", *every],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        "ttt-bench: interrupted at step 3 of 8; the same command resumes"
    folder = run_dir(chain)
    assert sorted(p.name for p in (folder / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step-3.ckpt"]
    train_in_process(f"paths.runs={chain}", *every)
    assert "resuming from step 3 of 8" in (folder / "main.log").read_text()
    reference = run_dir(ref)
    assert_identical(final_state(folder), final_state(reference))
    for name in ("metrics.csv", "losses.csv"):
        assert (folder / name).read_text() == (reference / name).read_text(), name


def write_pile(folder: Path, word: str) -> None:
    """A tiny corpus in the Pile's format (zstd JSON lines) at <folder>/pile-mini/."""
    docs = b"".join(json.dumps({"text": f"{word} " * 500 + str(i)}).encode() + b"\n" for i in range(12))
    for split in ("train", "validation"):
        path = folder / "pile-mini" / f"{split}.jsonl.zst"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(zstandard.ZstdCompressor().compress(docs))


def test_a_run_folder_is_locked_and_tied_to_its_data(tmp_path, capsys):
    """A second process on a busy run folder gets a one-line error and leaves the folder alone; the same
    command on other data (another paths.data_dir) refuses the folder of the run trained on the first."""
    write_pile(tmp_path / "a", "alpha")
    write_pile(tmp_path / "b", "beta")
    command = ["train", "data=pile", "size=xs", "data.seq_len=64", "data.micro_batch_size=4",
               "recipe.tokens_per_batch=256", "data.val_tokens=512", "data.num_proc=1", "trainer.max_steps=2",
               "trainer.enable_progress_bar=false", f"paths.runs={tmp_path / 'runs'}"]
    main([*command, f"paths.data_dir={tmp_path / 'a'}"])
    folder = run_dir(tmp_path / "runs")
    metrics = (folder / "metrics.json").read_text()
    assert "alpha" not in metrics and str(tmp_path / "a") in (folder / "identity.json").read_text()

    with locked(folder), pytest.raises(SystemExit) as exit_:
        main([*command, f"paths.data_dir={tmp_path / 'a'}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "is in use by process" in err
    assert (folder / "metrics.json").read_text() == metrics
    assert (folder / "checkpoints" / "last.ckpt").exists()

    with pytest.raises(SystemExit) as exit_:
        main([*command, f"paths.data_dir={tmp_path / 'b'}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "holds another run" in err
    assert "data.corpus.train_files was " + str(tmp_path / "a") in err
    assert (folder / "metrics.json").read_text() == metrics


def test_a_probe_of_a_run_folder_never_makes_its_trainer_skip_it(tmp_path):
    """The default `make reproduce` at 605c787 left mttt_patches/linear_attention_identity-s0 pending: one
    joblib thread's ETA probed the run folders (`in_use`) the instant its sibling thread locked one, and the
    sibling skipped its run as "being trained by another process". A probe holds the lock for an instant and
    records nothing; a trainer waits out such an instant (run_folder.GRACE_S), refused only by a holder."""
    import fcntl
    import threading
    import time

    from ttt_bench.training.run_folder import RunFolderInUse, in_use

    folder = tmp_path / "run"
    assert not in_use(folder) and not folder.exists()  # a probe creates nothing
    with locked(folder):
        assert in_use(folder)  # another open file of the same process is another holder (flock)
        assert (folder / ".lock").read_text() == f"process {os.getpid()}\n"  # the probe did not overwrite it
    assert not in_use(folder)

    def probe_for(seconds: float) -> None:
        with open(folder / ".lock") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            held.set()
            time.sleep(seconds)

    held = threading.Event()
    thread = threading.Thread(target=probe_for, args=(0.2,))
    thread.start()
    held.wait()
    with locked(folder):  # waits out the probe's instant
        pass
    thread.join()
    held.clear()
    thread = threading.Thread(target=probe_for, args=(1.5,))  # a holder: longer than the grace
    thread.start()
    held.wait()
    with pytest.raises(RunFolderInUse), locked(folder):
        pass
    thread.join()


@pytest.fixture
def nan_loss_at_step_2(monkeypatch):
    """The training loss of optimizer step 2 (both micro-batches) becomes NaN."""
    loss_and_accuracy = LitLM.loss_and_accuracy

    def patched(self, batch, reduction="mean"):
        value, *rest = loss_and_accuracy(self, batch, reduction)
        return (value * float("nan") if self.training and self.global_step == 1 else value, *rest)

    monkeypatch.setattr(LitLM, "loss_and_accuracy", patched)


def test_nonfinite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys,
                                                                               nan_loss_at_step_2):
    with pytest.raises(SystemExit) as e:
        train_in_process(f"paths.runs={tmp_path}", "trainer.max_steps=4")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "non-finite training loss (nan) at step 2" in err
    assert "nonfinite=skip" in err
    checkpoints = run_dir(tmp_path) / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["last.ckpt", "step-1.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 1


def test_nonfinite_skip_policy_skips_updates_and_counts_them(tmp_path, nan_loss_at_step_2):
    train_in_process(f"paths.runs={tmp_path}", "trainer.max_steps=4", "nonfinite=skip")
    folder = run_dir(tmp_path)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["skipped_steps"] == 2  # both micro-batches of step 2
    assert np.isfinite(metrics["val_loss"])
    losses = (folder / "losses.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in losses[1:]] == ["1", "2", "3", "4"] and losses[2] == "2,nan"


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nonfinite_gradient(policy):
    cfg = compose("train", RUN)
    module = LitLM(model_cfg=OmegaConf.to_container(cfg.model, resolve=True),
                   recipe=OmegaConf.to_container(cfg.recipe, resolve=True), vocab_size=257,
                   tokenizer={"kind": "byte"}, nonfinite=policy)
    optimizer = module.configure_optimizers()["optimizer"]
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    module.model.embed.weight.grad[0, 0] = float("inf")
    if policy == "stop":
        with pytest.raises(UserError, match="non-finite gradient at step 1"):
            module.on_before_optimizer_step(optimizer)
    else:
        module.on_before_optimizer_step(optimizer)
        assert module.skipped_steps == 1 and all(p.grad is None for p in module.parameters())


def test_atomic_write_leaves_the_previous_file_on_error(tmp_path):
    path = tmp_path / "metrics.json"
    write_json(path, {"a": 1})

    class Unserializable:
        def __repr__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_json(path, {"a": Unserializable()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]  # no temporary file left behind


def test_token_cache_detects_partial_truncated_and_foreign_caches(tmp_path):
    corpus = SyntheticCorpus(train_docs=3, validation_docs=2, mean_doc_bytes=2000)
    dm = LMDataModule(corpus, {"kind": "byte"}, seq_len=32, micro_batch_size=2, cache_dir=str(tmp_path))
    dm.prepare_data()
    good = np.array(dm.tokens["train"])
    key = cache_key(corpus, dm.build_tokenizer())
    folder = tmp_path / "tokens" / key
    assert load_tokens(tmp_path, key, "train") is not None

    with open(folder / "train.bin", "r+b") as f:  # truncated array
        f.truncate(len(good))
    assert load_tokens(tmp_path, key, "train") is None
    (folder / "train.json").unlink()  # killed during preparation: the metadata is written last
    assert load_tokens(tmp_path, key, "train") is None
    rebuilt = LMDataModule(corpus, {"kind": "byte"}, seq_len=32, micro_batch_size=2, cache_dir=str(tmp_path))
    rebuilt.prepare_data()
    assert np.array_equal(np.array(rebuilt.tokens["train"]), good)

    # another corpus gets another key; its metadata copied into this key's folder is not accepted
    other = SyntheticCorpus(train_docs=4, validation_docs=2, mean_doc_bytes=2000)
    other_key = cache_key(other, dm.build_tokenizer())
    assert other_key != key
    other_folder = tmp_path / "tokens" / other_key
    other_folder.mkdir()
    for name in ("train.bin", "train.json"):
        (other_folder / name).write_bytes((folder / name).read_bytes())
    assert load_tokens(tmp_path, other_key, "train") is None
    (folder / "train.json").write_text("{not json")  # corrupt metadata
    assert load_tokens(tmp_path, key, "train") is None


@pytest.mark.parametrize("root_first", [True, False], ids=["root-first", "lightning-first"])
def test_each_lightning_message_is_logged_once_in_the_runs_format(root_first):
    """The reproduce pipeline configures logging before importing Lightning, Hydra's job logging after: either
    way each Lightning line prints once, through the root logger's handler (its format, its log file)."""
    import subprocess
    import sys

    configure = "import logging, sys; logging.basicConfig(stream=sys.stdout, format='ROOT %(message)s')"
    imports = "import lightning; from ttt_bench.training.train import one_line_per_lightning_message"
    order = [configure, imports] if root_first else [imports, configure]
    script = "; ".join([*order, "one_line_per_lightning_message()", "lightning.seed_everything(3)"])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "Seed set to 3" in line]
    assert lines == ["ROOT Seed set to 3"], out.stdout + out.stderr


def test_ctrl_c_stops_a_sweep_instead_of_recording_a_failed_run(tmp_path):
    """SIGINT during the first run of `ablate minibatch --profile smoke`: that run saves its step and the
    sweep stops with exit 130 (no later run starts, nothing is recorded as failed); the same command then
    finishes every run."""
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "tests.faults", "2", "sigint", "ablate", "minibatch",
                           "--profile", "smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == 130, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line == "ttt-bench: interrupted at step 2 of 8; the same command resumes"
    assert "Error executing job" not in proc.stdout + proc.stderr  # Hydra's report (issue 50, point 4)
    started = [p.parent.parent.name for p in out.glob("*/checkpoints/last.ckpt")]
    assert len(started) == 1 and not list(out.glob("*/metrics.json"))
    main(["ablate", "minibatch", "--profile", "smoke", "--out", str(out)])
    statuses = [json.loads(p.read_text()).get("status", "finished") for p in out.glob("*/metrics.json")]
    assert len(statuses) == 3 and "failed" not in statuses
    assert "resuming from step 2 of 8" in (out / started[0] / "hydra" / "runner.log").read_text()


def test_a_new_run_says_why_it_did_not_resume(tmp_path):
    """The same command with another max_steps (the schedule depends on it) starts a new run folder, and its
    log names the nearest earlier run and the option that differs."""
    runs = tmp_path / "runs"
    train_in_process(f"paths.runs={runs}", "trainer.max_steps=2")
    (first,) = runs.glob("*/*/identity.json")
    assert "a new run" not in (first.parent / "main.log").read_text()
    train_in_process(f"paths.runs={runs}", "trainer.max_steps=3")
    (second,) = [p.parent for p in runs.glob("*/*/identity.json") if p != first]
    log = (second / "main.log").read_text()
    assert f"a new run, not a resume: the nearest earlier run of this model ({first.parent.name})" in log
    assert "trainer.max_steps was 2, is 3" in log
