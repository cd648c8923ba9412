"""Sweeps, registry, figures and `make reproduce` (smoke profile, tiny settings, into tmp folders)."""

import json

import pandas as pd
import pytest

from ttt_bench.config import REPO_ROOT
from ttt_bench.experiments import figures, sweeps
from ttt_bench.experiments.measure import table1, time_w_and_z

MODELS = ("transformer", "linear_attention", "ttt_linear", "ttt_mlp", "mamba")


def require_models():
    missing = [m for m in MODELS if not (REPO_ROOT / "conf" / "model" / f"{m}.yaml").is_file()]
    if missing:
        pytest.skip(f"model configs not there yet: {', '.join(missing)}")


def test_plans_reference_model_configs_and_match_flops():
    require_models()
    t1 = sweeps.plan_sweep("table1", "paper")
    assert len(t1) == 8 and "model=ttt_linear" in t1["8-mamba_backbone"]["overrides"]
    mb = sweeps.plan_sweep("minibatch", "cpu")
    assert list(mb) == ["b1", "b2", "b4", "b8", "b16", "b32", "b64", "bT"]
    sc = sweeps.plan_sweep("scaling", "cpu", data_dir="/data")
    assert "data=books" in sc["books-mamba-s-T512"]["overrides"]
    finetune = sc["books-tf_finetune-s-T512"]
    assert finetune["after"] == "books-transformer-s-T128"
    assert (
        "recipe=finetune" in finetune["overrides"]
        and "model.block.rope_theta=500000" in finetune["overrides"]
    )
    matched = {k: v for k, v in sc.items() if k.endswith("-matched")}
    assert set(matched) == {f"books-{m}-s-T512-matched" for m in ("transformer", "ttt_linear_m", "ttt_mlp_m")}
    assert len(matched) == 3 and all(abs(v["flops_ratio"] - 1) < 0.1 for v in matched.values())
    # 4096 tokens per batch: 32 sequences of 128 fill micro-batches of 8, 2 sequences of 2048 one of 2
    assert "data.micro_batch_size=8" in sc["books-mamba-s-T128"]["overrides"]
    assert "data.micro_batch_size=2" in sc["books-mamba-s-T2048"]["overrides"]


def test_sweep_skips_finished_records_failed_and_builds_registry(tmp_path, monkeypatch):
    """A run that fails (a bad override) is recorded, the others go on; a second call trains nothing."""
    tiny = [
        "data=synthetic",
        "data.corpus.train_docs=20",
        "data.corpus.validation_docs=4",
        "data.corpus.mean_doc_bytes=4000",
        "data.seq_len=64",
        "recipe.tokens_per_batch=512",
        "data.micro_batch_size=4",
        "trainer.max_steps=2",
        "data.val_tokens=1024",
        "size=xs",
        "trainer.enable_progress_bar=false",
    ]
    plan = {
        "ok": sweeps._run([*tiny, "model=transformer"], label="Transformer"),
        "bad": sweeps._run([*tiny, "model=transformer", "model.block.n_heads=3"], label="bad"),
    }
    monkeypatch.setattr(sweeps, "plan_sweep", lambda *a: plan)
    reg = sweeps.run_sweep("table1", "smoke", tmp_path)
    status = dict(zip(reg["run"], reg["status"], strict=True))
    assert status == {"ok": "finished", "bad": "failed"}
    ok = reg.set_index("run").loc["ok"]
    assert ok["train_flops"] > 0 and ok["tokens_seen"] == 1024
    assert pd.read_csv(tmp_path / "registry.csv").shape[0] == 2
    mtime = (tmp_path / "ok" / "metrics.json").stat().st_mtime
    sweeps.run_sweep("table1", "smoke", tmp_path)
    assert (tmp_path / "ok" / "metrics.json").stat().st_mtime == mtime
    assert json.loads((tmp_path / "ok" / "run.json").read_text())["command"].startswith("ttt-bench train ")


def test_table1_markdown_has_diff_columns():
    reg = pd.DataFrame(
        {
            "row": [2, 1],
            "label": ["B", "A"],
            "val_ppl": [9.0, 10.0],
            "paper_ppl": [15.23, 15.91],
            "status": ["finished", "finished"],
        }
    )
    _, md = table1(reg)
    assert "| A | 10.00 | - | 15.91 | - |" in md and "| B | 9.00 | -1.00 | 15.23 | -0.68 |" in md


def test_time_w_and_z_splits_forward_time():
    df = time_w_and_z([1, 4, "T"], batch=1, heads=2, head_dim=8, seq_len=16, repeats=1)
    assert list(df["mini_batch"]) == [1, 4, 16] and (df[["w_ms", "total_ms"]] > 0).all().all()


def test_lower_hull_and_figures(tmp_path):
    x, y = figures.lower_hull([1e10, 2e10, 4e10, 8e10], [10.0, 12.0, 8.0, 7.9])
    assert list(x) == pytest.approx([1e10, 4e10, 8e10])
    bench = pd.DataFrame(
        {
            "model": ["transformer"] * 2,
            "context": [1024, 2048],
            "phase": ["prefill"] * 2,
            "latency_ms_per_token": [0.1, 0.2],
            "tokens_per_s": [1e4, 5e3],
        }
    )
    paths = figures.latency(bench, tmp_path / "latency")
    assert all(p.stat().st_size > 0 for p in paths) and {p.suffix for p in paths} == {".png", ".pdf"}


@pytest.mark.slow
def test_reproduce_smoke(tmp_path, monkeypatch):
    """`make reproduce PROFILE=smoke` end to end into tmp folders: registries, Table 1, figures, REPORT."""
    require_models()
    from ttt_bench import reproduce

    out = tmp_path / "results"
    reproduce.main(["--profile", "smoke", "--out", str(out), "--runs", str(tmp_path / "runs")])
    for name in (
        "table1.csv",
        "table1.md",
        "minibatch.csv",
        "minibatch_timing.csv",
        "scaling.csv",
        "REPORT.md",
        "figures/minibatch.png",
        "figures/scaling.pdf",
    ):
        assert (out / name).is_file(), name
    report = (out / "REPORT.md").read_text()
    assert "## Table 1" in report and "Figure 8" in report and "wall time" in report
    assert (pd.read_csv(out / "table1.csv")["status"] == "finished").all()


def test_interrupted_sweep_reruns_only_missing_runs_and_registry_survives_concurrency(tmp_path, monkeypatch):
    """Kill a sweep mid-way (a run without metrics.json) and run it again: only that run trains. Two
    sweeps writing one registry at once leave a complete, parseable table (per-run files merged on read)."""
    import threading

    tiny = ["data=synthetic", "data.corpus.train_docs=20", "data.corpus.validation_docs=4",
            "data.corpus.mean_doc_bytes=4000", "data.seq_len=64", "recipe.tokens_per_batch=512",
            "data.micro_batch_size=4", "trainer.max_steps=2", "data.val_tokens=1024", "size=xs",
            "trainer.enable_progress_bar=false", "model=transformer"]
    plan = {"a": sweeps._run([*tiny, "seed=1"], label="a"), "b": sweeps._run([*tiny, "seed=2"], label="b")}
    monkeypatch.setattr(sweeps, "plan_sweep", lambda *a: plan)
    sweeps.run_sweep("table1", "smoke", tmp_path)
    kept = (tmp_path / "a" / "metrics.json").stat().st_mtime_ns
    (tmp_path / "b" / "metrics.json").unlink()  # as if the sweep was killed while training b
    reg = sweeps.run_sweep("table1", "smoke", tmp_path)
    assert (tmp_path / "a" / "metrics.json").stat().st_mtime_ns == kept
    assert set(reg["status"]) == {"finished"}

    errors = []

    def hammer():
        try:
            for _ in range(20):
                sweeps.write_registry(tmp_path)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and list(pd.read_csv(tmp_path / "registry.csv")["run"]) == ["a", "b"]
    assert not list(tmp_path.glob(".registry.csv.*"))  # no temporary files left behind
