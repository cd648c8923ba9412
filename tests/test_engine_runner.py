"""The sweep runner (engine/runner.py) and `make reproduce`: tiny runs trained, skipped, restored, refused."""

import copy
import json
import shutil

import pandas as pd
import pytest

from tests.conftest import SWEEP_RUN as TINY
from tests.helpers import require_models
from ttt_bench.config import compose
from ttt_bench.errors import UserError
from ttt_bench.experiments import EXPERIMENTS
from ttt_bench.experiments.engine import runner
from ttt_bench.experiments.engine.plan import configuration
from ttt_bench.experiments.engine.registry import run_finished, write_registry
from ttt_bench.experiments.engine.runner import Stage, train_stage


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
        "scaling/scaling.png",
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
