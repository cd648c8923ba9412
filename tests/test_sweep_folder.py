"""A sweep never deletes a finished run (issue 46): a plan that meets runs made with other settings refuses
before training anything, or moves them aside when asked; a folder belongs to one sweep and one process."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import SWEEP_RUN
from tests.helpers import two_runs
from ttt_bench.config import compose
from ttt_bench.errors import UserError
from ttt_bench.experiments.engine import runner
from ttt_bench.experiments.engine.plan import configuration
from ttt_bench.experiments.engine.runner import Stage, train_stage
from ttt_bench.experiments.engine.sweep_folder import claimed, data_fingerprint

TF = [*SWEEP_RUN, "model=transformer"]


def stamps(folder: Path) -> dict[str, int]:
    """Every file of a folder with its modification time: what 'kept as it was' compares."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))
            if p.is_file() and "hydra" not in p.parts and p.name not in (".sweep.lock", "progress.json")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-run sweep folder (trained once, copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("finished")
    assert set(train_stage("table1", "smoke", Stage("t", two_runs()), out).registry["status"]) == {"finished"}
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "sweep"))


def test_a_trial_override_on_a_finished_folder_is_refused_and_deletes_nothing(finished, tmp_path):
    """(a) The README's trial form (trainer.max_steps=2) on a finished folder: refused in one line naming the
    runs and the key, nothing trained or written; --replace moves the old runs aside and trains them again."""
    out = copy_of(finished, tmp_path)
    before = stamps(out)
    with pytest.raises(UserError) as e:
        train_stage("table1", "smoke", Stage("t", two_runs("trainer.max_steps=1")), out)
    assert "a, b" in str(e.value) and "trainer.max_steps: 2 -> 1" in str(e.value)
    assert "--replace" in str(e.value)
    assert stamps(out) == before
    again = Stage("t", two_runs("trainer.max_steps=1"))
    reg = train_stage("table1", "smoke", again, out, replace=True).registry
    assert set(reg["status"]) == {"finished"}
    aside, = (out / "replaced").iterdir()
    assert {p.name for p in aside.iterdir()} == {"a", "b"}
    assert json.loads((aside / "a" / "metrics.json").read_text())["status"] == "finished"  # kept whole
    assert "trainer.max_steps=1" in json.loads((out / "a" / "run.json").read_text())["overrides"]


def test_another_corpus_under_the_same_names_is_refused(finished, tmp_path, monkeypatch):
    """(b) The same sweep without the --data-dir it ran with (another `data=`), or with a data folder whose
    content differs under the same overrides, is another run: refused, nothing deleted."""
    out = copy_of(finished, tmp_path)
    before = stamps(out)
    with pytest.raises(UserError, match="data.corpus.train_docs"):
        train_stage("table1", "smoke", Stage("t", two_runs("data.corpus.train_docs=30")), out)
    record = out / "a" / "run.json"
    run = json.loads(record.read_text())
    record.write_text(json.dumps({**run, "data_fingerprint": "another-corpus"}))
    monkeypatch.setattr(runner, "data_fingerprint", lambda cfg: "this-corpus")  # real files: the next test
    with pytest.raises(UserError, match="the data's content"):
        train_stage("table1", "smoke", Stage("t", two_runs()), out)
    assert stamps(out).keys() == before.keys()


def test_data_fingerprints_follow_the_content_not_the_path(tmp_path):
    """Two data folders with the same layout and other bytes have other fingerprints; a copy has the same."""
    import shutil

    import zstandard

    def corpus(folder: Path, text: str) -> Path:
        (folder / "pile-mini").mkdir(parents=True)
        for split in ("train", "validation"):
            line = json.dumps({"text": text, "meta": {"pile_set_name": "x"}}) + "\n"
            (folder / "pile-mini" / f"{split}.jsonl.zst").write_bytes(zstandard.compress(line.encode()))
        return folder

    def fingerprint(folder: Path) -> str:
        return data_fingerprint(compose("train", ["data=pile", f"paths.data_dir={folder}"]))

    one, other = corpus(tmp_path / "one", "hello"), corpus(tmp_path / "other", "world")
    copy = Path(shutil.copytree(one, tmp_path / "copy"))
    assert fingerprint(one) == fingerprint(copy) != fingerprint(other)


def test_a_folder_of_another_sweep_or_of_results_is_refused(finished, tmp_path):
    """(c) `ablate longrange --out <a table1 folder>` is refused (same run names, another sweep), and so is a
    results step folder (a registry without a plan): both untouched."""
    out = copy_of(finished, tmp_path)
    before = stamps(out)
    with pytest.raises(UserError, match="sweep folder of 'table1', not of 'longrange'"):
        train_stage("longrange", "smoke", Stage("t", two_runs()), out)
    assert stamps(out) == before
    results = tmp_path / "results"
    results.mkdir()
    (results / "registry.csv").write_text("run,status\na,finished\n")
    with pytest.raises(UserError, match="not a sweep folder"):
        train_stage("table1", "smoke", Stage("t", two_runs()), results)
    assert (results / "registry.csv").read_text() == "run,status\na,finished\n"


def test_a_second_sweep_on_a_folder_in_use_is_refused_and_rewrites_nothing(finished, tmp_path):
    """(d) A second `ablate` with other overrides while the first runs in the same folder: refused before it
    writes anything (the first's plan.json and run.json files stay as the first wrote them)."""
    out = copy_of(finished, tmp_path)
    plan_json = (out / "plan.json").read_text()
    holding, release = threading.Event(), threading.Event()

    def first():
        with claimed(out, "table1"):
            holding.set()
            release.wait(30)

    t = threading.Thread(target=first)
    t.start()
    holding.wait(30)
    try:  # flock locks are per open file: a second open in this process is refused as another process's
        with pytest.raises(UserError, match=f"in use by process {os.getpid()}"):
            train_stage("table1", "smoke", Stage("t", two_runs("trainer.max_steps=1")), out)
    finally:
        release.set()
        t.join()
    assert (out / "plan.json").read_text() == plan_json


def test_a_failed_run_with_other_settings_is_moved_aside_without_asking(tmp_path):
    """A failed run that left no checkpoint holds no work: planned again with other settings it is moved aside
    (its error stays readable there) and trained; nothing is refused."""
    bad = {"a": configuration("a", [*TF, "seed=0", "model.block.n_heads=3"], "bad")}
    assert set(train_stage("table1", "smoke", Stage("t", bad), tmp_path).registry["status"]) == {"failed"}
    fixed = {"a": configuration("a", [*TF, "seed=0", "model.block.n_heads=2"], "ok")}
    assert (tmp_path / "a" / "run.json").is_file()  # it failed in training: a record of the run is there
    reg = train_stage("table1", "smoke", Stage("t", fixed), tmp_path).registry
    assert set(reg["status"]) == {"finished"}
    aside, = (tmp_path / "replaced").iterdir()
    assert json.loads((aside / "a" / "metrics.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("where", ["step", "between_runs", "tabulation", "registry_write"])
def test_a_sweep_killed_at_any_moment_resumes_to_the_same_registry(finished, tmp_path, where):
    """SIGKILL mid-run, between runs, during tabulation and halfway through the registry's write: the same
    sweep again trains only what is missing and ends with the registry of an uninterrupted sweep."""
    out = tmp_path / "killed"
    step = "2" if where == "step" else "0"
    proc = subprocess.run([sys.executable, "-m", "tests.faults", step, where, "sweep", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == -9, proc.stderr[-3000:]
    if where == "registry_write":
        assert not (out / "registry.csv").exists()  # the half-written file never took the registry's name
    train_stage("table1", "smoke", Stage("t", two_runs()), out)
    cols = ["run", "status", "val_ppl", "tokens_seen", "steps"]
    assert pd.read_csv(out / "registry.csv")[cols].equals(pd.read_csv(finished / "registry.csv")[cols])


def test_a_sweep_composes_each_runs_config_once_and_its_jobs_compose_none(tmp_path, monkeypatch):
    """Issue 51, point 2: the planner composes each run's config once (the plan's price, the data fingerprint,
    the floors and the job share it) and writes it beside the run's run.json; the job trains that file's
    config and composes nothing: not through ttt_bench or hydra.compose, and Hydra's multirun composes no
    training config for its jobs either (its own config is the launcher's, not `train`)."""
    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import OmegaConf

    from ttt_bench.experiments.engine import plan

    plan._compose.cache_clear()  # the fixture and earlier tests composed these runs in this process
    where = ["planner"]
    composed, loaded, trained = [], [], {}
    hydra_compose, load = hydra.compose, ConfigLoaderImpl.load_configuration
    # ttt_bench.config.compose imports hydra.compose when it is called: this counts it and any job's call
    monkeypatch.setattr(hydra, "compose", lambda config_name=None, overrides=(), **k: composed.append(
        (where[0], config_name, tuple(overrides))) or hydra_compose(config_name, overrides, **k))

    def counted(self, config_name, overrides, *a, **k):  # every composition Hydra makes, its launcher's too
        loaded.append((where[0], config_name))
        return load(self, config_name, overrides, *a, **k)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    run_one, train = runner.run_one, runner.train

    def job(run_dir):
        where[0] = "job"
        try:
            run_one(run_dir)
        finally:
            where[0] = "planner"

    def kept(cfg, run_dir):
        trained[run_dir.name] = cfg
        train(cfg, run_dir)

    monkeypatch.setattr(runner, "run_one", job)
    monkeypatch.setattr(runner, "train", kept)
    runs = two_runs()
    assert set(train_stage("table1", "smoke", Stage("t", runs), tmp_path).registry["status"]) == {"finished"}
    assert sorted(composed) == sorted(("planner", "train", tuple(r.overrides)) for r in runs.values())
    assert [c for c in loaded if c[1] == "train"] == [("planner", "train")] * len(runs)
    assert [c for c in loaded if c[0] == "job"] == []  # nothing composes inside a job
    for name, run in runs.items():  # the job trained what the planner composed, from the file beside run.json
        written = OmegaConf.load(tmp_path / name / "config.yaml")
        assert OmegaConf.to_container(trained[name]) == OmegaConf.to_container(written)
        assert OmegaConf.to_container(written) == OmegaConf.to_container(compose("train", run.overrides))
        assert json.loads((tmp_path / name / "run.json").read_text())["overrides"] == run.overrides


def test_a_job_in_another_process_trains_the_config_the_planner_wrote(tmp_path, monkeypatch):
    """Joblib's workers (processes of their own) train each run from the config.yaml the planner wrote, not
    from a composition of run.json's overrides: a config written with one step trains one step, while run.json
    still records the plan's two."""
    write_run = runner.write_run

    def one_step(run_dir, name, run, cfg, *rest):
        cfg.trainer.max_steps = 1
        write_run(run_dir, name, run, cfg, *rest)

    monkeypatch.setattr(runner, "write_run", one_step)
    launcher = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    reg = train_stage("table1", "smoke", Stage("t", two_runs()), tmp_path, launcher).registry
    assert set(reg["status"]) == {"finished"}
    for name in ("a", "b"):
        assert json.loads((tmp_path / name / "metrics.json").read_text())["steps"] == 1
        assert "trainer.max_steps=2" in json.loads((tmp_path / name / "run.json").read_text())["overrides"]
