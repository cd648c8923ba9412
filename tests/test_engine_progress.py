"""The pipeline's progress line and ETA (engine/progress.py), shared by every process through its file."""

from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import SWEEP_RUN as TINY
from ttt_bench.config import compose
from ttt_bench.experiments.engine import runner
from ttt_bench.experiments.engine.plan import configuration
from ttt_bench.experiments.engine.progress import Progress
from ttt_bench.io import write_json


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
    assert "run 3/3 (c)" in caplog.text and "ETA 0 s (by run count)" in caplog.text


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


def test_the_eta_prices_steps_by_a_reference_session_scaled_by_this_machines_speed(tmp_path, monkeypatch):
    """Issue 50, point 4: a reference session of the same steps (results/speed/eta/quick-synthetic, with
    priors.json) prices each step ahead at its wall time and the step under way at the larger of its time
    left and its runs' seconds left, scaled by this session's finished runs over their reference seconds.
    Another JOBS, or a run or step the reference lacks, falls back to the FLOP model."""
    import time

    from ttt_bench.experiments.engine import progress as progress_module
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
    # weighted toward the reference's speed: (50 + 120) / (25 + 120) = 1.17; s1: max(100 x 1.17 - 10,
    # 20 x 1.17 / 2 workers) = 107 s; s2 ahead: 30 x 1.17 = 35 s
    assert progress.eta({c}) == "ETA 2.4 min"
    monkeypatch.setattr(progress_module, "PRIOR_WEIGHT_S", 0.0)
    # unweighted, 2x: s1: max(100 x 2 - 10, 20 x 2 / 2 workers) = 190 s; s2 ahead: 30 x 2 = 60 s
    assert progress.eta({c}) == "ETA 4.2 min"
    progress.steps_done["s1"] = 200.0
    assert progress.eta({c}) == "ETA 1.0 min"  # a run of an ended step (failed there) is not work ahead

    other = Progress(tmp_path / "other.json", jobs=1)  # the reference trained 2 at once: no priors
    other.plan({"a": run}, tmp_path / "out", step="s1", priors=priors, configs=configs)
    other.plan_step("s1", priors=priors)
    other.flops[c] = 1e12
    assert other.walls == {"s1": None} and other.eta({c}).startswith("ETA ")  # the FLOP model
