"""What a plan costs (engine/cost.py): FLOPs of the composed configs, A100-hours, measured CPU minutes."""

import re
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers import require_models
from ttt_bench.config import REPO_ROOT, compose
from ttt_bench.experiments import EXPERIMENTS, sweeps
from ttt_bench.experiments.engine.progress import Progress


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
