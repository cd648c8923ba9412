"""End-to-end: `ttt-bench train` on the synthetic corpus (and pile-mini when present), eval, generate."""

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import TINY, TINY_BATCH
from tests.helpers import find_run, run_cli
from ttt_bench.training.module import warmup_cosine


def train_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_warmup_cosine_schedule():
    lr = [warmup_cosine(s, 100, 0.1, 1e-3, 1e-5) * 1e-3 for s in range(101)]
    assert lr[0] == pytest.approx(1e-4) and lr[9] == pytest.approx(1e-3)
    assert lr[100] == pytest.approx(1e-5) and all(a >= b for a, b in zip(lr[10:], lr[11:]))


@pytest.mark.slow
def test_train_eval_generate_on_synthetic(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TTT_BENCH_RUNS", str(tmp_path))
    run_cli(
        "train",
        "model=transformer",
        "size=xs",
        *TINY,
        "trainer.max_steps=40",
        "eval_every_n_steps=20",
        "trainer.log_every_n_steps=1",
        "size.lr=3e-3",
    )
    run = find_run(str(tmp_path), "transformer-xs-synthetic")
    metrics = json.loads((run / "metrics.json").read_text())
    losses = train_losses(run)
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # loss falls
    assert metrics["status"] == "finished" and metrics["tokens_seen"] == 40 * 512
    assert metrics["val_ppl"] < 30 and metrics["val_bpb"] == pytest.approx(
        metrics["val_loss"] / 0.6931, rel=1e-3
    )
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert len((run / "token_index.csv").read_text().splitlines()) == 64 + 1

    capsys.readouterr()
    run_cli(
        "generate", str(run / "checkpoints" / "last.ckpt"), "--prompt", "Ra koki", "--max-new-tokens", "20"
    )
    assert capsys.readouterr().out.startswith("Ra koki")

    run_cli("eval", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "max_tokens=4096")
    evaluated = json.loads(next((run / "eval").rglob("metrics.json")).read_text())  # beside the run
    assert evaluated["val_tokens"] == 4096 and evaluated["val_loss"] == pytest.approx(
        metrics["val_loss"], abs=0.2
    )


@pytest.mark.slow
def test_train_on_pile_mini(shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("TTT_BENCH_RUNS", str(tmp_path))
    run_cli(
        "train",
        "model=transformer",
        "size=xs",
        "data=pile",
        f"paths.data_dir={shared_data}",
        "data.corpus.max_documents=60",
        *TINY_BATCH,
        "trainer.max_steps=30",
        "eval_every_n_steps=30",
        "trainer.log_every_n_steps=1",
    )
    losses = train_losses(find_run(str(tmp_path), "transformer-xs-pile"))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
