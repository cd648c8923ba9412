"""Sweep plans (engine/plan.py): each sweep's runs per profile, seeds, matched FLOPs, steps left out."""


import pandas as pd
import pytest
import torch

from tests.helpers import require_models
from ttt_bench.config import compose
from ttt_bench.experiments import EXPERIMENTS
from ttt_bench.experiments.engine.progress import Progress
from ttt_bench.experiments.recall import best_lrs


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


def test_a_claim_whose_method_the_profile_leaves_out_is_not_tested():
    """The gpu profile trains no TTT-MLP: its long-context claim is "not tested" with the reason, while the
    claims of steps the profile leaves out are not tested because of that."""
    scaling, minibatch = EXPERIMENTS["scaling"], EXPERIMENTS["minibatch"]
    assert set(scaling.untested("gpu")) == {"scaling.ttt_mlp"} and scaling.untested("cpu") == {}
    assert "books_methods leave TTT-MLP (M) out" in scaling.untested("gpu")["scaling.ttt_mlp"]
    assert set(minibatch.untested("gpu")) == {c.id for c in minibatch.claims}
    latency = EXPERIMENTS["latency"]  # no benchmark in the gpu profile: the GPU campaign measures latency
    assert latency.untested("cpu") == {} and "make gpu-campaign" in latency.untested("gpu")["latency.prefill"]
