"""Sweeps, registry, figures and `make reproduce` (smoke profile, tiny settings, into tmp folders)."""

import copy
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from ttt_bench.config import REPO_ROOT, compose
from ttt_bench.errors import UserError
from ttt_bench.experiments import EXPERIMENTS, sweeps
from ttt_bench.experiments.engine import runner
from ttt_bench.experiments.engine.plan import configuration
from ttt_bench.experiments.engine.progress import Progress
from ttt_bench.experiments.engine.registry import run_finished, write_registry
from ttt_bench.experiments.engine.runner import Stage, train_stage
from ttt_bench.experiments.minibatch import time_w_and_z
from ttt_bench.experiments.recall import best_lrs
from ttt_bench.experiments.scaling import lower_hull_index
from ttt_bench.experiments.table1 import table1_markdown
from ttt_bench.io import write_json
from ttt_bench.machine import hardware

MODELS = ("transformer", "linear_attention", "ttt_linear", "ttt_mlp", "mamba")
TINY = [  # a run of two steps on a small synthetic corpus
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


def require_models():
    missing = [m for m in MODELS if not (REPO_ROOT / "conf" / "model" / f"{m}.yaml").is_file()]
    if missing:
        pytest.skip(f"model configs not there yet: {', '.join(missing)}")


def test_plans_reference_model_configs_seeds_and_match_flops():
    require_models()
    t1 = EXPERIMENTS["table1"].plan("paper")
    etas = EXPERIMENTS["table1"].sweep["profiles"]["paper"]["etas"]
    assert len(t1) == 13 + len(etas) and "model=ttt_linear" in t1["11-mamba_backbone-s0"].overrides
    mb = EXPERIMENTS["minibatch"].plan("cpu")
    seeds = EXPERIMENTS["minibatch"].seeds("cpu")
    assert (seeds >= 3 and len(mb) == 5 * seeds and mb["bT-s2"].config == "bT"
            and "seed=2" in mb["bT-s2"].overrides)
    sc = EXPERIMENTS["scaling"].plan("cpu", data_dir="/data")
    assert ("data=books" in sc["books-mamba-s-T1024-s0"].overrides
            and sc["books-mamba-s-T1024-s0"].corpus == "books-mini")
    finetune = sc["books-tf_finetune-s-T1024-s1"]
    assert finetune.after == "books-transformer-s-T128-s1"
    assert "recipe=finetune" in finetune.overrides and "model.block.rope_theta=500000" in finetune.overrides
    # cpu trains the matched runs as the grid points at 1k (matched_in_grid) and, at 128, only the
    # Transformer TF finetune starts from (other_seeds: 0)
    matched = {v.config: v for v in sc.values() if v.info.get("matched")}
    assert set(matched) == {f"books-{m}-s-T1024" for m in ("tf_finetune", "ttt_linear_m", "ttt_mlp_m")}
    assert all(abs(v.info["flops_ratio"] - 1) < 0.1 for v in matched.values())
    assert {v.config for v in sc.values() if v.seq_len == 128} == {"books-transformer-s-T128"}
    assert len(sc) == 6 * 3
    # beside the grid (paper): TF finetune matched in FLOPs is a pretraining at the base context (fewer
    # blocks), then the finetune
    paper = {v.config: v for v in EXPERIMENTS["scaling"].plan("paper").values() if v.info.get("matched")}
    methods = ("tf_finetune", "ttt_linear_m", "ttt_mlp_m")
    assert set(paper) == {f"books-{m}-1.3b-T32768-matched" for m in methods}
    pretrain = paper["books-tf_finetune-1.3b-T32768-matched"].after
    assert pretrain.startswith("books-transformer-1.3b-T2048-matched")
    # 2048 tokens per batch: 16 sequences of 128 fill a micro-batch of 16, 2 sequences of 1024 one of 2
    assert "data.micro_batch_size=16" in sc["books-transformer-s-T128-s0"].overrides
    assert "data.micro_batch_size=2" in sc["books-mamba-s-T1024-s0"].overrides
    # three seeds for the key comparisons (largest size, longest Books context), `other_seeds` elsewhere
    assert "books-mamba-s-T1024-s2" in sc and "books-mamba-xs-T1024-s1" not in sc


def test_sweep_skips_finished_records_failed_and_builds_registry(tmp_path, monkeypatch):
    """A run that fails (a bad override) is recorded, the others go on; a second call trains nothing."""
    plan = {
        "ok": configuration("ok", [*TINY, "model=transformer"], "Transformer"),
        "bad": configuration("bad", [*TINY, "model=transformer", "model.block.n_heads=3"], "bad"),
    }
    reg = train_stage("table1", "smoke", Stage("t", plan), tmp_path).registry
    status = dict(zip(reg["run"], reg["status"], strict=True))
    assert status == {"ok": "finished", "bad": "failed"}
    ok = reg.set_index("run").loc["ok"]
    assert ok["train_flops"] > 0 and ok["tokens_seen"] == 1024
    assert pd.read_csv(tmp_path / "registry.csv").shape[0] == 2
    mtime = (tmp_path / "ok" / "metrics.json").stat().st_mtime
    train_stage("table1", "smoke", Stage("t", plan), tmp_path)
    assert (tmp_path / "ok" / "metrics.json").stat().st_mtime == mtime
    assert json.loads((tmp_path / "ok" / "run.json").read_text())["command"].startswith("ttt-bench train ")


def test_table1_markdown_has_means_diffs_floors_and_undertrained_marks():
    reg = pd.DataFrame(
        {
            "run": ["b-s0", "b-s1", "a-s0", "a-s1", "tf-s0"],
            "config": ["2-b", "2-b", "1-a", "1-a", "tf"],
            "seed": [0, 1, 0, 1, 0],
            "row": [2, 2, 1, 1, None],
            "label": ["B", "B", "A", "A", "Transformer++"],
            "val_ppl": [9.0, 9.2, 15.0, 15.0, 8.0],
            "paper_ppl": [15.23, 15.23, 15.91, 15.91, None],
            "status": ["finished"] * 5,
        }
    )
    floors = pd.DataFrame({"floor": ["unigram", "3-gram (Witten-Bell)"], "val_ppl": [27.0, 14.0]})
    _, md = table1_markdown(reg, floors)
    assert "| A | 15.00 +- 0.00 (under-trained) | - | 2 | 15.91 | - |" in md
    assert "| B | 9.10 +- 0.14 | -5.90 | 2 | 15.23 | -0.68 |" in md
    assert "*Transformer++ (reference)* | 8.00 |" in md and "| *3-gram (Witten-Bell) floor* | 14.00 |" in md
    se = reg.assign(val_loss_se=[0.01, 0.03, 0.0, 0.0, 0.02])  # the evaluation's error over documents
    _, md = table1_markdown(se, floors)
    assert "| B | 9.10 +- 0.14 | -5.90 | 0.18 | 2 | 15.23 | -0.68 |" in md  # mean of 9.0 x 0.01, 9.2 x 0.03



def test_a_sweep_table_judges_each_row_against_the_floor_of_its_own_text_and_context():
    """The scaling table holds Pile and Books rows at several contexts: each row is marked under-trained
    against the 3-gram floor of the text and context it was validated on, and each floor row says which."""
    from ttt_bench.experiments.engine.tables import summary_table

    reg = pd.DataFrame({"run": ["p", "b"], "config": ["p", "b"], "role": ["pile", "books"],
                        "seq_len": [256, 1024], "label": ["TTT", "TTT"], "val_ppl": [12.0, 12.0],
                        "status": ["finished"] * 2})
    floors = pd.DataFrame({"role": ["pile", "books"], "seq_len": [256, 1024],
                           "floor": ["3-gram (Witten-Bell)"] * 2, "val_ppl": [14.0, 11.0]})
    md = summary_table(reg, ["role", "seq_len", "label"], floors)
    assert "| pile | 256 | TTT | 12.00 | 1 |" in md
    assert "| books | 1024 | TTT | 12.00 (under-trained) | 1 |" in md
    assert "| books | 1024 | *3-gram (Witten-Bell) floor* | 11.00 |  |" in md

def test_time_w_and_z_splits_forward_time():
    df = time_w_and_z([1, 4, "T", 32], batch=1, heads=2, head_dim=8, seq_len=16, repeats=1)
    assert list(df["mini_batch"]) == [1, 4, 16] and (df[["w_ms", "total_ms"]] > 0).all().all()  # 32 > T
    long = time_w_and_z(["T"], batch=1, heads=2, head_dim=8, seq_len=128, repeats=1)  # the batch-GD path
    assert list(long["mini_batch"]) == [128] and (long[["w_ms", "total_ms"]] > 0).all().all()


def test_lower_hull_and_figures(tmp_path):
    from ttt_bench.experiments import latency
    from ttt_bench.experiments.engine.plotting import save

    assert lower_hull_index([1e10, 2e10, 4e10, 8e10], [10.0, 12.0, 8.0, 7.9]) == [0, 2, 3]
    assert lower_hull_index([1e10, 5e10, 8e10], [20.0, 6.4, 7.7]) == [0, 1]  # more FLOPs, worse: dominated
    bench = pd.DataFrame(
        {
            "model": ["transformer"] * 2,
            "context": [1024, 2048],
            "phase": ["prefill"] * 2,
            "latency_ms_per_token": [0.1, 0.2],
            "tokens_per_s": [1e4, 5e3],
        }
    )
    paths = save(latency.latency_figure(bench), tmp_path / "latency")
    assert all(p.stat().st_size > 0 for p in paths) and {p.suffix for p in paths} == {".png", ".pdf"}


@pytest.mark.slow
def test_reproduce_smoke(tmp_path, monkeypatch):
    """`make reproduce PROFILE=smoke` end to end in tmp folders: each step's folder, REPORT with verdicts."""
    require_models()
    from ttt_bench import reproduce

    claims_count = sum(len(e.claims) for e in EXPERIMENTS.values())
    root = tmp_path / "results"
    reproduce.main(["--profile", "smoke", "--out", str(root), "--runs", str(tmp_path / "runs")])
    out = root / "smoke-synthetic"
    for name in (
        "table1/registry.csv",
        "table1/table1.md",
        "table1/floors.csv",
        "table1/step.json",
        "minibatch/timing.csv",
        "minibatch/inner_loss.csv",
        "minibatch/minibatch.png",
        "scaling/scaling.pdf",
        "scaling/token_index.csv",
        "recall/recall.md",
        "recall/recall.png",
        "longrange/fact_recall.csv",
        "longrange/fact_recall.md",
        "longrange/fact_recall.png",
        "REPORT.md",
        "claims.csv",
    ):
        assert (out / name).is_file(), name
    report = (out / "REPORT.md").read_text()
    assert (
        "## Table 1" in report and "Figure 8" in report and "Wall time" in report and "bigram floor" in report
    )
    assert "Recall (MQAR)" in report and "| Transformer | 32 |" in (out / "recall" / "recall.md").read_text()
    assert (pd.read_csv(out / "table1" / "registry.csv")["status"] == "finished").all()
    claims = pd.read_csv(out / "claims.csv")
    seeded = claims[claims["id"].str.startswith(("table1", "scaling"))]
    assert len(claims) == claims_count and "holds" not in set(seeded["verdict"])  # one seed: no interval

    # a new machine: the run folders are gone, the committed results are not. The pipeline restores the
    # runs from the registries, trains nothing, and keeps every per-run measurement it can no longer take,
    # the timing measured with them and the step's record of the session that trained them
    per_run = ["minibatch/inner_loss.csv", "scaling/token_index.csv", "longrange/fact_recall.csv",
               "mttt_patches/inner_losses_per_run.csv", "minibatch/timing.csv", "table1/step.json"]
    before = {name: (out / name).read_text() for name in per_run}
    shutil.rmtree(tmp_path / "runs")
    reproduce.main(["--profile", "smoke", "--out", str(root), "--runs", str(tmp_path / "runs")])
    assert {name: (out / name).read_text() for name in per_run} == before
    assert pd.read_csv(out / "claims.csv")["verdict"].tolist() == claims["verdict"].tolist()


def test_interrupted_sweep_reruns_only_missing_runs_and_registry_survives_concurrency(tmp_path, monkeypatch):
    """Kill a sweep mid-way (a run without metrics.json) and run it again: only that run trains. Two
    sweeps writing one registry at once leave a complete, parseable table (per-run files merged on read)."""
    import threading

    tiny = [*TINY, "model=transformer"]
    plan = {"a": configuration("a", [*tiny, "seed=1"], "a"), "b": configuration("b", [*tiny, "seed=2"], "b")}
    train_stage("table1", "smoke", Stage("t", plan), tmp_path)
    kept = (tmp_path / "a" / "metrics.json").stat().st_mtime_ns
    (tmp_path / "b" / "metrics.json").unlink()  # as if the sweep was killed while training b
    reg = train_stage("table1", "smoke", Stage("t", plan), tmp_path).registry
    assert (tmp_path / "a" / "metrics.json").stat().st_mtime_ns == kept
    assert set(reg["status"]) == {"finished"}

    errors = []

    def hammer():
        try:
            for _ in range(20):
                write_registry(tmp_path)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and list(pd.read_csv(tmp_path / "registry.csv")["run"]) == ["a", "b"]
    assert not list(tmp_path.glob(".registry.csv.*"))  # no temporary files left behind


@pytest.mark.slow  # composes all 421 runs of the paper profile: about 100 s on 2 busy cores
def test_paper_profile_is_the_papers_setting_and_its_plan_is_costed_from_the_composed_configs(monkeypatch,
                                                                                              tmp_path):
    """PROFILE=paper: its plan (what `make reproduce PROFILE=paper` prints without a GPU) holds exactly the
    runs the pipeline trains on a GPU, every step's sweeps, each composed; the Llama tokenizer, bf16-mixed on
    the GPU trainer, the paper recipe with 0.5M tokens per batch for the language-model sweeps; every planned
    run's cost is the FLOPs of the config it composes, over the tokens (or images) its steps train on."""
    require_models()
    from omegaconf import OmegaConf

    from ttt_bench import reproduce
    from ttt_bench.experiments.engine.cost import LLAMA_VOCAB
    from ttt_bench.flops import flops_per_token
    from ttt_bench.reproduce import paper_plan

    plan = paper_plan("/data")
    # what main() trains with a GPU: the runs it plans its progress over, every step's runner a no-op
    trained = []
    monkeypatch.setattr(reproduce.torch.cuda, "is_available", lambda: True)
    root = (tmp_path / "runs").resolve()
    monkeypatch.setattr(Progress, "plan", lambda self, runs, out, committed=None, *a: trained.extend(
        (str(out.relative_to(root)), name, run.overrides) for name, run in runs.items()))
    for e in EXPERIMENTS.values():
        monkeypatch.setattr(e, "run_step", lambda ctx: None)
    monkeypatch.setattr(reproduce, "write_report", lambda *a: tmp_path / "REPORT.md")
    reproduce.main(["--profile", "paper", "--data-dir", "/data", "--out", str(tmp_path),
                    "--runs", str(tmp_path / "runs")])
    assert sorted(trained) == sorted(zip(plan["folder"], plan["run"], plan["overrides"], strict=True))
    assert set(plan["sweep"]) == set(sweeps()) and len(plan) == len(trained)

    assert set(plan["precision"]) == {"bf16-mixed"}
    lm = plan[plan["sweep"].isin(["table1", "minibatch", "scaling"])]
    assert set(lm["tokenizer"]) == {"meta-llama/Llama-2-7b-hf"} and set(lm["tokens_per_batch"]) == {524288}
    for row in lm.sample(6, random_state=0).itertuples():
        cfg = compose("train", row.overrides)
        assert (
            cfg.recipe.name in ("paper", "finetune")
            and cfg.data.tokenizer.kind == "hf"
            and cfg.trainer.accelerator == "gpu"
        )
        model = OmegaConf.to_container(cfg.model, resolve=True)
        trained_tokens = cfg.trainer.max_steps * cfg.recipe.tokens_per_batch  # whole steps, as trained
        assert trained_tokens == pytest.approx(cfg.recipe.total_tokens, rel=1e-3)
        cost = flops_per_token(model, cfg.data.seq_len, LLAMA_VOCAB)["train"] * trained_tokens
        assert row.train_flops == pytest.approx(cost) and row.seq_len == cfg.data.seq_len
    recall = plan[plan["sweep"] == "recall"].iloc[0]  # MQAR: its own token range, not Llama's
    cfg = compose("train", recall.overrides)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    trained_tokens = cfg.trainer.max_steps * cfg.recipe.tokens_per_batch
    cost = flops_per_token(model, cfg.data.seq_len, cfg.data.vocab_size)["train"] * trained_tokens
    assert recall.train_flops == pytest.approx(cost)
    images = plan[plan["sweep"].str.startswith("mttt")]
    assert (images["train_flops"] > 0).all() and images["images"].notna().all()
    assert images["tokens"].isna().all()


def test_reproduce_writes_the_readme_it_is_given_as_its_last_step(tmp_path, caplog):
    """Issue 51: the README's results block is reproduce's last step, on the README its --readme names (the
    library does not know where the repository is), and only when --out's cpu folder is the one beside it."""
    import logging

    from ttt_bench import reproduce
    from ttt_bench.experiments.engine.report import README_BLOCK

    readme, elsewhere = tmp_path / "README.md", tmp_path / "other" / "README.md"
    elsewhere.parent.mkdir()
    for page in (readme, elsewhere):
        page.write_text(f"intro\n{README_BLOCK[0]}\nstale\n{README_BLOCK[1]}\n")
    step = tmp_path / "results" / "cpu" / "table1"  # a committed step folder: its own files redraw it
    step.mkdir(parents=True)
    for name in ("step.json", "registry.csv", "floors.csv", "table1.md"):
        shutil.copy(REPO_ROOT / "results" / "cpu" / "table1" / name, step / name)
    args = ["--profile", "cpu", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "results"),
            "--steps", "table1", "--report-only"]
    with caplog.at_level(logging.INFO):
        reproduce.main([*args, "--readme", str(elsewhere)])
    assert "stale" in elsewhere.read_text() and "left as it is" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        reproduce.main([*args, "--readme", str(readme)])
    assert caplog.records[-1].getMessage().startswith("last step: README.md's results block")
    assert "stale" not in readme.read_text() and "- `table1`: `ttt-bench ablate table1" in readme.read_text()


def test_readme_results_block_is_made_from_the_verdicts(tmp_path):
    """The README's results are written from claims.csv and the step files, between its markers."""
    from ttt_bench.experiments.engine.report import README_BLOCK, update_readme
    from ttt_bench.reproduce import README_HEADLINE

    CLAIMS = [c for e in EXPERIMENTS.values() for c in e.claims]

    out = tmp_path / "results" / "cpu"
    (out / "table1").mkdir(parents=True)
    (out / "table1" / "table1.md").write_text("| Configuration | Ppl. |\n|---|---|\n| A | 9.00 |\n")
    (out / "table1" / "step.json").write_text(
        json.dumps(
            {
                "command": "ttt-bench ablate table1",
                "wall_time_s": 600,
                "hardware": "2 cores",
                "finished": "now",
            }
        )
    )
    pd.DataFrame(
        [
            {
                "figure": c.figure,
                "claim": c.claim,
                "verdict": "holds" if i == 0 else "not measured",
                "evidence": "x 1 vs 2",
            }
            for i, c in enumerate(CLAIMS)
        ]
    ).to_csv(out / "claims.csv", index=False)
    (out / "mttt_pixels").mkdir()  # a step the profile leaves out, run by itself (its sweep yaml)
    (out / "mttt_pixels" / "step.json").write_text((out / "table1" / "step.json").read_text())
    (out / "RUN.md").write_text("how the run went\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BLOCK[0]}\nstale\n{README_BLOCK[1]}\nrest\n")
    update_readme(readme, out, list(EXPERIMENTS.values()), "make reproduce PROFILE=cpu", "cpu",
                  README_HEADLINE)
    text = readme.read_text()
    assert "stale" not in text and text.startswith("intro") and text.endswith("rest\n")
    assert "| A | 9.00 |" in text and "`minibatch`: not run yet" in text
    assert "| claim | verdict |" not in text  # each claim's evidence is in REPORT.md, linked
    assert f"{len(CLAIMS)} claims: 1 holds, {len(CLAIMS) - 1} not measured." in text  # computed, not typed
    assert "[results/cpu/REPORT.md](results/cpu/REPORT.md))" in text
    assert "`longrange`: not in this profile (REPORT.md says why)" in text  # conf/sweep/longrange.yaml
    assert "finished now; not a default step of this profile (REPORT.md says why)" in text
    assert "[results/cpu/RUN.md](results/cpu/RUN.md)" in text


def test_a_committed_registry_counts_its_finished_runs_on_a_fresh_machine(tmp_path, monkeypatch):
    """A later session (no run folders) restores the finished runs of the committed registry, trains the
    rest, and does not restore a run whose overrides changed."""
    tiny = [*TINY, "model=transformer"]
    plan = {"a": configuration("a", [*tiny, "seed=1"], "a"), "b": configuration("b", [*tiny, "seed=2"], "b")}
    first = train_stage("table1", "smoke", Stage("t", copy.deepcopy(plan)), tmp_path / "session1").registry
    committed = tmp_path / "registry.csv"
    first.assign(status=["finished", "failed"]).to_csv(committed, index=False)
    plan["b"].overrides = [*tiny, "seed=3"]  # b was planned anew: it must train
    reg = train_stage("table1", "smoke", Stage("t", plan, committed), tmp_path / "session2").registry
    a = json.loads((tmp_path / "session2" / "a" / "metrics.json").read_text())
    assert a["restored_from"] == str(committed) and a["val_ppl"] == pytest.approx(first.loc[0, "val_ppl"])
    assert not (tmp_path / "session2" / "a" / "checkpoints").exists()  # not trained again
    assert (tmp_path / "session2" / "b" / "checkpoints").is_dir() and set(reg["status"]) == {"finished"}


def test_recall_plan_calibrates_learning_rates_then_runs_the_grid_with_seeds_and_state_sizes():
    """A profile with several lrs (paper) plans its calibration grid first; one with one lr (cpu) plans the
    whole grid at that lr."""
    recall = EXPERIMENTS["recall"]
    p = recall.sweep["profiles"]["paper"]
    methods = p.get("methods", list(recall.sweep["methods"]))
    calibration = recall.plan("paper")
    assert len(calibration) == len(methods) * len(p["lrs"])  # one seed, the calibration point only
    assert {r.seed for r in calibration.values()} == {0}
    assert ({(r.info["width"], r.info["pairs"]) for r in calibration.values()}
            == {tuple(p["calibration"].values())})
    fake = pd.DataFrame([{**r.columns(), "status": "finished", "val_loss": 1.0,
                          "val_accuracy": 0.5 + (r.info["lr"] == p["lrs"][-1]) * 0.1}
                         for r in calibration.values()])
    lrs = best_lrs(fake)
    assert lrs == {m: p["lrs"][-1] for m in methods}
    grid = recall.plan("paper", lrs=lrs | {"mamba": p["lrs"][0]})
    assert len(grid) == len(methods) * len(p["widths"]) * len(p["pairs"]) * p["seeds"]
    mamba = [r for r in grid.values() if r.info["method"] == "mamba"]
    assert all(f"size.lr={p['lrs'][0]:g}" in r.overrides for r in mamba)

    p = recall.sweep["profiles"]["cpu"]
    assert len(p["lrs"]) == 1 and not recall.calibrates("cpu")
    grid = recall.plan("cpu")
    assert len(grid) == len(p["methods"]) * len(p["widths"]) * len(p["pairs"]) * p["seeds"]
    assert all(f"size.lr={p['lrs'][0]:g}" in r.overrides for r in grid.values())
    width = p["widths"][0]
    tf = next(r for r in grid.values() if r.info["method"] == "transformer" and r.info["width"] == width)
    assert tf.info["state_floats"] == 2 * 2 * p["seq_len"] * width  # two layers of a K and V cache
    b = {r.info["method"]: r.info["b"] for r in grid.values()}  # T/b >= 8 for TTT; b = 16 its own row
    assert b["ttt_linear"] == 8 == p["seq_len"] // 8 and b["ttt_linear_b16"] == 16
    assert b["transformer"] is None


def test_a_run_in_use_by_another_process_is_skipped_and_left_alone(tmp_path):
    """A run folder that another process's `ttt-bench train` holds is skipped by the sweep's job, with nothing
    recorded in it (that process finishes it and records it)."""
    from ttt_bench.training.run_folder import locked

    run_dir = tmp_path / "ok"
    run = configuration("ok", [*TINY, "model=transformer"], "Transformer")
    runner.write_run(run_dir, "ok", run, compose("train", run.overrides), None, tmp_path / "progress.json")
    with locked(run_dir):
        runner.run_one(run_dir)
    assert not (run_dir / "metrics.json").exists() and not run_finished(run_dir)


def test_the_pipeline_progress_line_is_shared_by_every_process_through_its_file(tmp_path, caplog):
    """Joblib's workers and a second `make reproduce` report one progress line: the plan lives in a file and
    the run folders say what has finished (a run finished before the plan counts as done, not as speed)."""
    runs = {n: configuration(n, [*TINY, "model=transformer"], "Transformer") for n in ("a", "b", "c")}
    (tmp_path / "a").mkdir()
    write_json(tmp_path / "a" / "metrics.json", {"status": "finished"})  # from an earlier session
    Progress(tmp_path / "progress.json").plan(runs, tmp_path)
    write_json(tmp_path / "b" / "metrics.json", {"status": "finished"})  # another worker's, just now
    with caplog.at_level("INFO", logger=runner.log.name):
        Progress.load(tmp_path / "progress.json").begin(tmp_path / "c")
    assert "run 3/3 (c)" in caplog.text and "ETA 0.0 min (by run count)" in caplog.text


def test_a_run_waits_while_another_process_trains_the_run_it_starts_from(tmp_path, monkeypatch):
    """TF finetune starts from another run: while a second process of the sweep trains that run, the
    finetune is left for later (not recorded as failed); a parent that failed fails it."""
    from ttt_bench.training.run_folder import locked

    tiny = [*TINY, "model=transformer"]
    plan = {"a": configuration("a", tiny, "a"), "b": configuration("b", [*tiny, "recipe=finetune"], "b")}
    plan["b"].after = "a"
    with locked(tmp_path / "a"):  # the other process
        train_stage("table1", "smoke", Stage("t", copy.deepcopy(plan)), tmp_path)
    assert not (tmp_path / "b" / "metrics.json").exists()
    plan["a"].overrides = [*tiny, "model=no_such_model"]
    train_stage("table1", "smoke", Stage("t", copy.deepcopy(plan)), tmp_path)
    assert "did not finish" in json.loads((tmp_path / "b" / "metrics.json").read_text())["error"]


def test_a_step_tabulated_without_training_says_so_instead_of_a_wall_time(tmp_path):
    """`--no-train` tabulates runs that other processes trained: its step.json must not pass the seconds of
    tabulation off as the step's wall time."""
    from ttt_bench.experiments.engine.report import Step

    Step(tmp_path, "scaling", "ttt-bench ablate scaling", trains=False).done()
    Step(tmp_path, "latency", "ttt-bench bench models").done()
    assert json.loads((tmp_path / "scaling" / "step.json").read_text())["tabulated_only"] is True
    assert json.loads((tmp_path / "latency" / "step.json").read_text())["tabulated_only"] is False


def test_a_sweep_folder_never_mixes_settings(tmp_path):
    """A finished run planned again with other settings (another corpus, model or seed) is refused, not
    relabelled or deleted (tests/test_sweep_folder.py); a run whose settings differ only in paths (another
    machine's data folder, the same content) is kept."""
    tiny = [*TINY, "model=transformer"]
    first = {"a": configuration("a", [*tiny, "seed=1", "paths.data_dir=/here"], "a")}
    train_stage("table1", "smoke", Stage("t", first), tmp_path)
    kept = (tmp_path / "a" / "metrics.json").stat().st_mtime_ns
    moved = {"a": configuration("a", [*tiny, "seed=1", "paths.data_dir=/elsewhere"], "a")}
    train_stage("table1", "smoke", Stage("t", moved), tmp_path)
    assert (tmp_path / "a" / "metrics.json").stat().st_mtime_ns == kept
    other = {"a": configuration("a", [*tiny, "seed=2", "paths.data_dir=/here"], "a")}
    with pytest.raises(UserError, match="seed: 1 -> 2"):
        train_stage("table1", "smoke", Stage("t", other), tmp_path)
    assert (tmp_path / "a" / "metrics.json").stat().st_mtime_ns == kept


def test_plans_price_gpu_runs_in_a100_hours_and_say_when_data_is_synthetic(capsys):
    """`ablate --plan` (issue 35, point 7): the paper profile's GPU runs in A100-hours at the stated MFU and
    the total FLOPs; a plan without --data-dir says its runs read the synthetic corpus."""
    from ttt_bench.cli.main import main

    main(["ablate", "scaling", "--profile", "paper", "--plan"])
    out = capsys.readouterr().out
    assert out.startswith("# data: the embedded synthetic corpus (no --data-dir)")
    assert "A100-hours]" in out and "# GPU runs: ~" in out and "40% MFU" in out
    assert "training FLOPs in all" in out
    assert "CPU runs" not in out
    main(["ablate", "minibatch", "--profile", "smoke", "--plan"])
    assert "# CPU runs: ~" in capsys.readouterr().out


def test_gpu_plans_say_which_runs_a_lent_gpu_trained_and_how_long_they_took(tmp_path, capsys, monkeypatch):
    """The gpu profile's plan adds the measured minutes of runs a committed results/gpu registry holds (small
    models at long context are bound by their scans: the A100-hours from FLOPs are a lower bound). The
    results folder is the current directory's results/ (the library does not know where the repository is)."""
    from ttt_bench.cli.main import main

    run = EXPERIMENTS["scaling"].plan("gpu")["books-ttt_linear_m-s-T34816-s0"]
    (tmp_path / "results" / "gpu" / "scaling").mkdir(parents=True)
    pd.DataFrame([{"run": run.name, "status": "finished", "model": "ttt_linear", "train_flops": 1e14,
                   "wall_time_s": 90.0, "overrides": " ".join(run.overrides)}]).to_csv(
        tmp_path / "results" / "gpu" / "scaling" / "registry.csv", index=False)
    monkeypatch.chdir(tmp_path)
    main(["ablate", "scaling", "--profile", "gpu", "--plan"])
    out = capsys.readouterr().out
    assert "A100-hours; 1.5 min measured on a lent GPU]" in out
    assert "# 1 of the 15 GPU runs trained before (results/gpu/*/registry.csv, RUN.md): 2 run-minutes" in out


def test_cpu_plans_are_priced_from_the_committed_registries_measured_times(tmp_path, capsys, shared_data,
                                                                          monkeypatch):
    """Issue 35, point 7: a planned run that a committed registry holds (the same overrides) is priced at its
    measured time; another at its model's measured FLOP/s (its runs' FLOPs over their seconds); a model no
    registry holds at CPU_TRAIN_FLOPS. The plan's total divides the run-minutes by the launcher's jobs. Where
    the data lives (`paths.*`) is no part of a run's identity: the committed runs hold this machine's path,
    and a clone elsewhere (CI) must still find them."""
    from ttt_bench.cli.main import main

    from ttt_bench.experiments.engine.cost import CPU_TRAIN_FLOPS, Throughput

    (tmp_path / "a").mkdir()
    pd.DataFrame({"run": ["r1", "r2", "r3"], "status": ["finished", "finished", "failed"],
                  "model": ["ttt_linear", "ttt_linear", "mamba"],
                  "overrides": ["x=1 paths.data_dir=/a seed=0", "x=2", "y"],
                  "train_flops": [6e12, 2e12, 1e12], "wall_time_s": [300.0, 100.0, 1.0]}
                 ).to_csv(tmp_path / "a" / "registry.csv", index=False)
    t = Throughput.committed(tmp_path)
    assert t.minutes(["x=1", "paths.data_dir=/b", "seed=0"], "ttt_linear", 1.0) == (5.0, "measured")
    rate = 8e12 / 400  # ttt_linear: both finished runs, FLOPs over seconds
    priced = t.minutes(["x=3"], "ttt_linear", 2e13)
    assert priced == (pytest.approx(2e13 / rate / 60), "ttt_linear at 20 GFLOP/s")
    minutes, source = t.minutes(["y"], "mamba", 9e11)  # its only run failed: no rate measured
    assert minutes == pytest.approx(9e11 / CPU_TRAIN_FLOPS / 60) and source.startswith("at ")

    (tmp_path / "elsewhere").symlink_to(shared_data.resolve())  # the data where another machine has it
    monkeypatch.chdir(REPO_ROOT)  # the plan reads the current directory's results/
    main(["ablate", "minibatch", "--profile", "cpu", "--data-dir", str(tmp_path / "elsewhere"), "--plan",
          "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"])
    out = capsys.readouterr().out
    committed = pd.read_csv(Path(__file__).parents[1] / "results" / "cpu" / "minibatch" / "registry.csv")
    assert out.count(", measured]") == len(committed)  # the committed step's own runs, at their times
    total = re.search(r"# CPU runs: ~(\d+) run-minutes .*, so ~(\d+) min with 2 jobs", out)
    assert total and abs(int(total[1]) - committed["wall_time_s"].sum() / 60) <= 1
    assert abs(int(total[2]) - int(total[1]) / 2) <= 1


def test_the_eta_prices_what_is_left_at_this_sessions_speed_plus_each_runs_fixed_cost(tmp_path, caplog):
    """Issue 35, point 6: the runs finished in this session give the speed (their FLOPs over their training
    seconds) and the fixed cost a run (the worker time not spent training, per run started); a run another
    process is training counts with the share of its steps it has logged; a run restored from a committed
    registry counts as done but took none of the time (it said "ETA 0 min" after table1's restored runs).
    Training seconds alone made the quick profile's ETA 30-45% short at the halfway point."""
    import time

    from ttt_bench.training.run_folder import locked

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    flops = {str(a): 1e12, str(b): 3e12, str(c): 1e12}
    progress = Progress(tmp_path / "progress.json", flops=flops, start=time.time() - 60, jobs=2)
    progress.begin(c)
    write_json(c / "metrics.json", {"status": "finished", "wall_time_s": 50.0})  # 2e10 FLOP/s
    progress.begin(a)
    with locked(a):
        write_json(a / "identity.json", {"config": {"trainer": {"max_steps": 10}}})
        (a / "losses.csv").write_text("step,loss\n" + "".join(f"{i},1.0\n" for i in range(1, 6)))
        with caplog.at_level("INFO", logger=runner.log.name):
            progress.begin(b)
    # 2 workers x 60 s = 120 s: 50 trained c, 25 half of a, so 45 s of fixed cost over 2 runs started; left:
    # half of a (25 s) and b (150 s + 22.5 s fixed) = 197.5 s, over 2 workers 98.75 s
    assert "run 3/3 (b): elapsed 1.0 min, ETA 1.6 min" in caplog.text
    (restored := tmp_path / "restored").mkdir()
    write_json(restored / "metrics.json", {"status": "finished", "restored_from": "results/x/registry.csv"})
    caplog.clear()
    flops[str(restored)] = 9e12
    with locked(a), caplog.at_level("INFO", logger=runner.log.name):
        Progress(tmp_path / "progress.json", flops=flops, start=time.time() - 60, jobs=2).begin(b)
    assert "run 4/4 (b): elapsed 1.0 min, ETA 1.6 min" in caplog.text


def test_the_eta_prices_a_step_that_trains_nothing_apart_from_the_runs(tmp_path, caplog):
    """Issue 50, point 4: a benchmark step (latency) runs alone between sweeps. Before it runs, the ETA adds
    its planned seconds; after it, its measured seconds are not folded into the runs' fixed cost (they had
    made every later run look dearer: "5.6 min" with 3.0 left). The runs as in the test above: 98.75 s."""
    import time

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    flops = {str(a): 1e12, str(b): 3e12, str(c): 1e12}
    write_json(c / "metrics.json", {"status": "finished", "wall_time_s": 50.0})
    write_json(a / "metrics.json", {"status": "finished", "wall_time_s": 50.0})

    def eta(elapsed: float, **steps) -> str:
        progress = Progress(tmp_path / "progress.json", flops=flops, start=time.time() - elapsed, jobs=2,
                            started=[str(c), str(a)], **steps)
        return progress.eta({str(a), str(c)})

    # 2 workers x 60 s: 100 s trained, 20 s fixed over 2 runs; left: b, 150 s + 10 s, over 2 workers 80 s
    assert eta(60) == "ETA 1.3 min"
    assert eta(60, steps={"latency": 120.0}) == "ETA 3.3 min"  # + the benchmark still ahead
    assert eta(180, steps={"latency": 120.0}, steps_done={"latency": 120.0}) == "ETA 1.3 min"
    progress = Progress(tmp_path / "progress.json", flops=flops)
    progress.plan_step("latency", 120.0)
    progress.step_done("latency", 95.0)
    assert Progress.load(tmp_path / "progress.json").steps_done == {"latency": 95.0}  # the jobs read the file


def test_the_eta_prices_steps_by_a_reference_session_scaled_by_this_machines_speed(tmp_path):
    """Issue 50, point 4: a reference session of the same steps (results/speed/eta/quick-synthetic, with
    priors.json) prices each step ahead at its wall time and the step under way at the larger of its time
    left and its runs' seconds left, scaled by this session's finished runs over their reference seconds.
    Another JOBS, or a run or step the reference lacks, falls back to the FLOP model."""
    import time

    from ttt_bench.experiments.engine.progress import Priors

    ref = tmp_path / "ref"
    for step, wall in (("s1", 100.0), ("s2", 30.0)):
        write_json(ref / step / "step.json", {"wall_time_s": wall})
    run = configuration("a", [*TINY, "model=transformer"], "Transformer")
    pd.DataFrame([{"run": "a", "status": "finished", "train_flops": 1e12, "wall_time_s": 20.0,
                   "model": "transformer", "overrides": " ".join(run.overrides)}]
                 ).to_csv(ref / "s1" / "registry.csv", index=False)
    assert Priors.load(ref) is None  # no priors.json: not a reference session
    write_json(ref / "priors.json", {"jobs": 2})
    priors = Priors.load(ref)
    assert priors.walls == {"s1": 100.0, "s2": 30.0} and priors.runs.measured(run.overrides) == 20.0

    c = str(tmp_path / "out" / "c")
    write_json(Path(c) / "metrics.json", {"status": "finished", "wall_time_s": 50.0})
    progress = Progress(tmp_path / "progress.json", jobs=2)
    configs = {"a": compose("train", run.overrides)}
    other_run = configuration("b", [*TINY, "model=transformer", "seed=1"], "Transformer")  # not in the ref
    configs["b"] = compose("train", other_run.overrides)
    progress.plan({"a": run, "b": other_run}, tmp_path / "out", step="s1", priors=priors, configs=configs)
    b = str(tmp_path / "out" / "b")
    assert progress.work[b] == pytest.approx(progress.flops[b] / 5e10)  # its FLOPs at the reference's rate
    del progress.flops[b]
    for step in ("s1", "s2"):
        progress.plan_step(step, priors=priors)
    progress.flops[c], progress.work[c], progress.step_of[c] = 1e12, 25.0, "s1"  # took 2x its reference
    progress.began["s1"] = time.time() - 10
    # s1: max(100 x 2 - 10, 20 x 2 / 2 workers) = 190 s; s2 ahead: 30 x 2 = 60 s
    assert progress.eta({c}) == "ETA 4.2 min"
    progress.steps_done["s1"] = 200.0
    assert progress.eta({c}) == "ETA 1.0 min"  # a run of an ended step (failed there) is not work ahead

    other = Progress(tmp_path / "other.json", jobs=1)  # the reference trained 2 at once: no priors
    other.plan({"a": run}, tmp_path / "out", step="s1", priors=priors, configs=configs)
    other.plan_step("s1", priors=priors)
    other.flops[c] = 1e12
    assert other.walls == {"s1": None} and "min" in other.eta({c})


def test_the_plan_counts_runs_a_committed_registry_will_restore_as_no_work(tmp_path):
    """A pipeline plans every step up front, before each step restores its committed runs: a run the
    committed registry holds finished with the same identity is no work of this session (the ETA of a
    pipeline whose later steps added seeds had counted the earlier seeds' restorable runs: 255 min at run 3
    of a 90-minute job); a run with other overrides, or one the registry holds failed, is work."""
    runs = {n: configuration(n, [*TINY, "model=transformer", f"seed={i}"], "Transformer")
            for i, n in enumerate(("a", "b", "c"))}
    registry = tmp_path / "registry.csv"
    pd.DataFrame({"run": ["a", "b", "c"], "status": ["finished", "failed", "finished"],
                  "overrides": [" ".join(runs["a"].overrides), " ".join(runs["b"].overrides), "seed=9"]}
                 ).to_csv(registry, index=False)
    progress = Progress(tmp_path / "progress.json")
    progress.plan(runs, tmp_path / "out", registry)
    assert progress.finished_before == {str(tmp_path / "out" / "a")}
    flops = {Path(d).name: f for d, f in progress.flops.items()}
    assert flops["a"] == 0 and flops["b"] > 0
    assert runner.restore(tmp_path / "out", runs, registry) == 1  # the same runs the plan skipped


def test_two_workers_that_start_together_take_consecutive_numbers(tmp_path, caplog):
    """With JOBS=2 two workers begin at once: each takes its number under a lock on the progress file, so
    they say run 1/N and run 2/N, never the same k twice; a run begun again keeps its number (issue 35,
    point 6: one line per event whatever JOBS is)."""
    runs = {n: configuration(n, [*TINY, "model=transformer"], "Transformer") for n in ("a", "b", "c")}
    Progress(tmp_path / "progress.json").plan(runs, tmp_path)
    with caplog.at_level("INFO", logger=runner.log.name):
        first, second = Progress.load(tmp_path / "progress.json"), Progress.load(tmp_path / "progress.json")
        first.begin(tmp_path / "a")
        second.begin(tmp_path / "b")
        first.begin(tmp_path / "a")
    lines = [r.getMessage().split(":")[0] for r in caplog.records]
    assert lines == ["run 1/3 (a)", "run 2/3 (b)", "run 1/3 (a)"]


def test_a_step_the_profile_leaves_out_runs_only_when_named(tmp_path, monkeypatch, caplog):
    """conf/sweep/*.yaml `left_out`: the profile's default steps skip the step (its claims "not tested",
    with the reason); naming it in --steps runs it, with a warning that it is not a step of the profile."""
    from ttt_bench import reproduce

    ran = []
    for e in EXPERIMENTS.values():
        monkeypatch.setattr(e, "run_step", lambda ctx, name=e.name: ran.append(name))
    monkeypatch.setattr(Progress, "plan", lambda self, runs, out, committed=None, *a: None)
    monkeypatch.setattr(reproduce, "write_report", lambda *a: tmp_path / "REPORT.md")
    left_out = [n for n, e in EXPERIMENTS.items() if e.left_out("cpu")]
    assert {"longrange", "mttt_pixels"} <= set(left_out)
    args = ["--profile", "cpu", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")]
    reproduce.main(args)
    assert ran and not set(ran) & set(left_out)
    ran.clear()
    with caplog.at_level("WARNING"):
        reproduce.main([*args, "--steps", "longrange"])
    assert ran == ["longrange"] and "longrange is not a step of the cpu profile" in caplog.text


def test_a_step_says_when_it_starts_with_its_own_estimate_and_when_it_ends(tmp_path, caplog):
    """Issue 35, point 6: no silent phase (the latency benchmark and the long-range analysis were 3-4 min
    without a line): a step logs its start, with the time it took when its folder was last written, and
    its end."""
    from ttt_bench.experiments.engine.report import Step

    with caplog.at_level("INFO", logger=runner.log.name):
        Step(tmp_path, "latency", "ttt-bench bench models").done()
        Step(tmp_path, "latency", "ttt-bench bench models")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "step latency: started" and lines[1].startswith("step latency: done in ")
    assert lines[2].startswith("step latency: started (it took 0.0 min when ") and "last written" in lines[2]


def test_the_gpu_profile_runs_the_long_context_grid_and_leaves_out_sweeps_without_one(tmp_path, monkeypatch,
                                                                                       capsys):
    """PROFILE=gpu (one lent GPU, minutes): scaling at 34,816 bytes (8.5k stand-in tokens) with TTT-Linear (M)
    matched in FLOPs to Mamba and TF finetune at the Transformer's own size; a sweep without a gpu profile is
    left out (named in --steps: a one-line error); without CUDA a training step is refused."""
    from ttt_bench import reproduce

    plan = EXPERIMENTS["scaling"].plan("gpu", "/data")
    assert {r.config for r in plan.values()} == {
        "books-transformer-s-T1024", "books-transformer-s-T34816", "books-ttt_linear_m-s-T34816",
        "books-mamba-s-T34816", "books-tf_finetune-s-T34816"}
    assert len(plan) == 5 * 3 and all("trainer=gpu" in r.overrides for r in plan.values())
    ttt, ft = plan["books-ttt_linear_m-s-T34816-s0"], plan["books-tf_finetune-s-T34816-s0"]
    assert ttt.info["matched"] == "width" and abs(ttt.info["flops_ratio"] - 1) < 0.1
    assert "matched" not in ft.info and ft.after == "books-transformer-s-T1024-s0"
    assert "data.micro_batch_size=2" in ttt.overrides  # two 34,816-byte sequences a step
    assert EXPERIMENTS["scaling"].left_out("gpu") is None
    assert "defines no gpu profile" in EXPERIMENTS["minibatch"].left_out("gpu")
    args = ["--profile", "gpu", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as e:
        reproduce.main([*args, "--steps", "minibatch"])
    assert e.value.code == 2 and "minibatch: conf/sweep/ defines no gpu profile" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        reproduce.main([*args, "--steps", "scaling"])
    assert e.value.code == 2
    assert "the gpu profile trains on a CUDA GPU and none is visible here" in capsys.readouterr().err


def test_the_gpu_profile_trains_the_mttt_tables_past_the_linear_classifier_budget():
    """The MTTT tables in the gpu profile: every row of each table, 5 paired seeds, 5 epochs of Fashion-MNIST
    at 128 images a step on the GPU in fp32; the pixel table on all 784 pixels of the image."""
    for step, rows, tokens in (("mttt_patches", 6, 16), ("mttt_ablation", 4, 16), ("mttt_pixels", 6, 784)):
        experiment = EXPERIMENTS[step]
        assert experiment.left_out("gpu") is None and experiment.untested("gpu") == {}
        plan = experiment.plan("gpu", "/data")
        assert len(plan) == rows * 5 and {r.seed for r in plan.values()} == set(range(5))
        cfg = compose("train", next(iter(plan.values())).overrides)
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "32-true"
        assert cfg.recipe.total_images == 300000 and cfg.recipe.batch_size == 128
        assert (cfg.data.image_size // cfg.data.patch_size) ** 2 == tokens


def test_step_json_names_the_machines_its_runs_trained_on(tmp_path):
    """A step tabulated on another machine (--no-train after a GPU lease) keeps where its runs trained: the
    `hardware` of their metrics, beside the tabulating machine's."""
    from ttt_bench.experiments.engine.report import Step

    step = Step(tmp_path, "scaling", "ttt-bench ablate scaling --profile gpu")
    registry = pd.DataFrame({"status": ["finished"] * 3, "wall_time_s": [1.0, 2.0, 3.0],
                             "hardware": ["x86_64 CPU, 16 cores, NVIDIA H200"] * 2 + [None]})
    step.done(registry)
    meta = json.loads((tmp_path / "scaling" / "step.json").read_text())
    assert meta["trained_on"] == ["x86_64 CPU, 16 cores, NVIDIA H200"] and meta["trained_s"] == 6.0
    assert meta["hardware"] == hardware()


def test_a_claim_whose_method_the_profile_leaves_out_is_not_tested():
    """The gpu profile trains no TTT-MLP: its long-context claim is "not tested" with the reason, while the
    claims of steps the profile leaves out are not tested because of that."""
    scaling, minibatch = EXPERIMENTS["scaling"], EXPERIMENTS["minibatch"]
    assert set(scaling.untested("gpu")) == {"scaling.ttt_mlp"} and scaling.untested("cpu") == {}
    assert "books_methods leave TTT-MLP (M) out" in scaling.untested("gpu")["scaling.ttt_mlp"]
    assert set(minibatch.untested("gpu")) == {c.id for c in minibatch.claims}
    latency = EXPERIMENTS["latency"]  # no benchmark in the gpu profile: the GPU campaign measures latency
    assert latency.untested("cpu") == {} and "make gpu-campaign" in latency.untested("gpu")["latency.prefill"]


def test_a_sweep_whose_runs_all_failed_tabulates_as_not_run(tmp_path):
    """A registry with no finished run has no metric columns: its table says "not run yet" (ablate on a
    machine that cannot train them exited with a KeyError)."""
    from ttt_bench.experiments.engine.tables import by_config

    reg = pd.DataFrame({"run": ["a-s0", "a-s1"], "config": ["a", "a"], "status": ["failed", "failed"],
                        "error": ["UserError: needs a CUDA GPU"] * 2})
    row = by_config(reg).iloc[0]
    assert row["seeds"] == 0 and row["not_finished"] == 2 and pd.isna(row["ppl_mean"])


@pytest.mark.parametrize("raised, code, line", [
    (UserError("registry x.csv, line 3 (run a): val_ppl is 'n/a', not a number"), 2, "error: registry x.csv"),
    (KeyboardInterrupt("interrupted at step 4 of 8; the same command resumes"), 130,
     "interrupted (interrupted at step 4 of 8; the same command resumes)")])
def test_reproduce_ends_in_one_line_not_a_traceback(tmp_path, monkeypatch, capsys, raised, code, line):
    """`python -m ttt_bench.reproduce`: its own UserError (a damaged registry under --report-only) and Ctrl-C
    during a step (a run's "interrupted at step N of M") end in one line, exit 2 and 130 (issue 46)."""
    from ttt_bench import reproduce

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(reproduce, "write_report", fail)
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--profile", "smoke", "--out", str(tmp_path), "--report-only", "--steps", "table1"])
    err = capsys.readouterr().err
    assert e.value.code == code and line in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_resumed_step_that_trained_nothing_keeps_its_step_json(tmp_path):
    """A pipeline resumed after part 2 re-tabulates parts 1 and 2 in seconds: their step.json keeps the wall
    time of the session that trained them (it had become 4.1 s); a part with new runs writes its own."""
    from ttt_bench.experiments.engine.report import Step

    reg = pd.DataFrame({"run": ["a", "b"], "status": "finished", "wall_time_s": [100.0, 200.0]})
    Step(tmp_path, "table1", "ttt-bench ablate table1").done(reg, part="2 of 3")
    meta = tmp_path / "table1" / "step.json"
    write_json(meta, {**json.loads(meta.read_text()), "wall_time_s": 5165.2})  # the training session's
    kept = meta.read_text()
    Step(tmp_path, "table1", "ttt-bench ablate table1").done(reg, part="2 of 3")
    assert meta.read_text() == kept
    more = pd.concat([reg, pd.DataFrame({"run": ["c"], "status": "finished", "wall_time_s": [50.0]})])
    Step(tmp_path, "table1", "ttt-bench ablate table1").done(more, part="3 of 3")
    assert json.loads(meta.read_text())["part"] == "3 of 3"
