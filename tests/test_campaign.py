"""`make gpu-campaign` cannot rot (issue 33, point 4): its dry mode runs every stage end to end on the CPU
(tiny sizes, the Triton interpreter, --device cpu) and writes the files and the summary the GPU run will;
a second run skips the finished stages; without a GPU and without --dry it says so in one line (exit 2).
About 50 s on 2 CPU cores."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("triton", reason="the check stage runs the Triton kernels in the interpreter")

from ttt_bench import campaign  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def run_campaign(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ttt_bench.campaign", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_dry_campaign_writes_every_stage_and_resumes(tmp_path):
    out, work = tmp_path / "gpu", tmp_path / "work"
    first = run_campaign("--stage", "all", "--dry", "--out", str(out), "--work", str(work))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for stage, files in campaign.OUTPUTS.items():
        assert (out / f"{stage}.done").exists(), stage
        for name in files:
            assert (out / name).stat().st_size > 0, name
        section = (out / "sections" / f"{stage}.md").read_text()
        assert section.startswith(f"## {stage}") and "| command | wall (s) |" in section
    summary = (out / "SUMMARY.md").read_text()
    for stage in campaign.STAGES:
        assert f"## {stage} (dry run, CPU)" in summary
    assert "- GPU: no GPU" in summary and "torch " in summary and "Triton " in summary

    check = pd.read_csv(out / "check.csv")
    assert set(check["head_size"]) == set(campaign.HEAD_SIZES)
    assert {"dual/ieee", "dual/tf32", "decode"} <= set(check["kernel"])
    assert (check["status"].isin(["pass", "unsupported"])).all(), check.to_string()
    assert "passed" in (out / "pytest.txt").read_text()
    for name in campaign.BENCH_OUT.values():
        assert not pd.read_csv(out / name).empty, name
    models = pd.read_csv(out / "bench_models_125m.csv")
    assert set(models["model"]) == set(campaign.MODELS) and set(models["phase"]) == {"prefill", "decode"}
    train = pd.read_csv(out / "train.csv")
    assert list(train["model"]) == list(campaign.MODELS)
    assert train["ok"].all() and train["all_finite"].all(), train.to_string()
    assert (train["peak_mem_mb"] > 0).all() and (train["steady_tokens_per_s"] > 0).all()
    assert not any(out.rglob("*.ckpt"))  # run folders and checkpoints stay in --work

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*.csv")}
    second = run_campaign("--stage", "all", "--dry", "--out", str(out), "--work", str(work))
    assert second.returncode == 0, second.stderr[-3000:]
    for stage in campaign.STAGES:
        assert f"[campaign] {stage}: finished before" in second.stdout
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("*.csv")}
    assert (out / "SUMMARY.md").read_text() == summary


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    done = run_campaign("--stage", "check", "--out", str(tmp_path / "gpu"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs one" in lines[0] and "--dry" in lines[0], done.stderr
    assert not (tmp_path / "gpu").exists()
