"""`ttt-bench runs` lists run folders with their status and numbers, and `ttt-bench plot curves` (and
token-index, inner-loss) draw from run folders (issue 35, point 1)."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from ttt_bench.cli.main import main

from tests.conftest import TINY
from ttt_bench.training.runs import list_runs, loss_curves


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished transformer run, a TTT-Linear run killed at step 3 (checkpoints every 2 steps) and a
    failed run (its metrics.json as a sweep records a failure)."""
    root = tmp_path_factory.mktemp("runs")
    common = [*TINY, "trainer.max_steps=6", "eval_every_n_steps=2", f"paths.runs={root}"]
    main(["train", "model=transformer", "size=xs", *common])
    proc = subprocess.run([sys.executable, "-m", "tests.faults", "3", "step", "train", "model=ttt_linear",
                           "size=xs", *common, "checkpoint_every_n_steps=2"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == -9, proc.stderr[-2000:]
    failed = root / "sweep" / "broken-s0"
    failed.mkdir(parents=True)
    (failed / "metrics.json").write_text(json.dumps({"status": "failed", "error": "ValueError: bad width"}))
    return root


def test_list_runs_gives_each_runs_status_and_numbers(runs):
    table = list_runs(runs).set_index("model")
    assert table.loc["transformer", "status"] == "finished"
    assert table.loc["transformer", "steps"] == 6 and table.loc["transformer", "val"] > 1
    assert table.loc["ttt_linear", "status"] == "stopped at step 2 of 6 (resumes from step 2)"
    assert table.loc["?", "status"] == "failed: ValueError: bad width"
    assert set(table["context"].dropna()) == {64}


def test_runs_command_prints_a_table_and_csv(runs, capsys):
    main(["runs", str(runs)])
    out = capsys.readouterr().out
    assert "finished" in out and "stopped at step 2 of 6" in out and "failed: ValueError" in out
    main(["runs", str(runs), "--csv"])
    assert capsys.readouterr().out.splitlines()[0].startswith("run,model,size,data,context,status")


def test_runs_of_a_missing_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["runs", str(tmp_path / "nope")])
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_loss_curves_have_training_and_validation_by_step_and_tokens(runs):
    (finished,) = [p.parent for p in runs.rglob("metrics.json") if "transformer" in str(p)]
    curves = loss_curves(finished)
    train, val = curves[curves["split"] == "train"], curves[curves["split"] == "validation"]
    assert list(train["step"]) == [1, 2, 3, 4, 5, 6] and list(val["step"]) == [2, 4, 6]
    assert (curves["tokens"] == curves["step"] * 512).all()


@pytest.mark.parametrize("figure", ["curves", "token-index", "inner-loss"])
def test_plot_draws_from_run_folders(runs, tmp_path, figure, capsys):
    if figure == "inner-loss":  # a finished TTT run's folder
        main(["train", "model=ttt_linear", "size=xs", *TINY, "trainer.max_steps=2", f"paths.runs={tmp_path}"])
        inputs = [str(next(p.parent for p in tmp_path.rglob("inner_losses.csv")))]
    else:
        inputs = [str(runs)]
    main(["plot", figure, *inputs, "--out", str(tmp_path)])
    assert (tmp_path / f"{figure.replace('-', '_')}.png").stat().st_size > 0


def test_logger_tensorboard_writes_event_files_beside_the_csv_log(tmp_path):
    """logger=tensorboard (conf/logger/): events under <run>/tensorboard/, and the run's own CSV log as
    always; the logger is not part of the run's identity (the same run folder as logger=csv)."""
    main(["train", "model=transformer", "size=xs", *TINY, "trainer.max_steps=2", "logger=tensorboard",
          f"paths.runs={tmp_path}"])
    (run,) = [p.parent for p in tmp_path.rglob("identity.json")]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "losses.csv").is_file()
    main(["train", "model=transformer", "size=xs", *TINY, "trainer.max_steps=2", f"paths.runs={tmp_path}"])
    assert [p.parent for p in tmp_path.rglob("identity.json")] == [run]  # finished: the same folder


@pytest.mark.parametrize("logger,package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_logger_without_its_package_is_one_line_before_anything_is_written(tmp_path, capsys, logger,
                                                                             package):
    import importlib.util

    if importlib.util.find_spec(package):
        pytest.skip(f"{package} is installed here")
    with pytest.raises(SystemExit) as e:
        main(["train", "model=transformer", "size=xs", *TINY, f"logger={logger}", f"paths.runs={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert f"logger={logger} needs the {package} package" in err and f".[{logger}]" in err
    assert not list(tmp_path.iterdir())


def test_eval_writes_beside_the_run_and_reuses_the_same_eval(tmp_path, capsys):
    """`ttt-bench eval` of a run's checkpoint writes <run>/eval/<data>-T<context>-<tokens>-step<N>-<sha256 of
    the checkpoint, 12 hex>/metrics.json; the same eval again reuses it, force=true evaluates again (issue 35,
    point 4; issue 46, point 6)."""
    main(["train", "model=transformer", "size=xs", *TINY, "trainer.max_steps=2", f"paths.runs={tmp_path}"])
    (ckpt,) = tmp_path.rglob("last.ckpt")
    run = ckpt.parent.parent
    args = ["eval", f"ckpt_path={ckpt}", "max_tokens=512", f"paths.runs={tmp_path / 'elsewhere'}"]
    main(args)
    (out,) = (run / "eval").glob("trained-data-Ttrained-512-step2-*/metrics.json")
    first = json.loads(out.read_text())
    assert first["val_tokens"] == 512 and not (tmp_path / "elsewhere").exists()
    capsys.readouterr()
    main(args)
    assert "this eval ran before on the same checkpoint" in "".join(capsys.readouterr())
    main([*args, "force=true"])
    assert "this eval ran before" not in "".join(capsys.readouterr())
    assert json.loads(out.read_text())["val_loss"] == first["val_loss"]


def write_run(folder: Path, config: dict, metrics: dict | None) -> None:
    """A run folder as `ttt-bench train` leaves it, reduced to what `ttt-bench runs` reads."""
    folder.mkdir(parents=True)
    (folder / "identity.json").write_text(json.dumps({"config": config}))
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))


def config(task: str, data: str, target: str) -> dict:
    return {"task": {"name": task}, "model": {"name": "m"}, "size": {"name": "xs"},
            "trainer": {"max_steps": 6},
            "data": {"name": data, "_target_": f"ttt_bench.data.{target}", "seq_len": 64}}


@pytest.fixture
def three_tasks(tmp_path):
    """A finished run of each task (JSON floats where metrics.json could hold them) and an MQAR run stopped
    before its metrics.json."""
    lm, recall = config("lm", "synthetic", "LMDataModule"), config("lm", "mqar", "MQARDataModule")
    image = config("image", "synthetic_images", "ImageDataModule")
    write_run(tmp_path / "lm", lm, {"data": "synthetic", "steps": 6.0, "tokens_seen": 253952.0,
                                    "seq_len": 64, "val_loss": 2.0, "val_ppl": 7.389, "val_bpb": 2.885})
    write_run(tmp_path / "recall", recall, {"data": "mqar", "steps": 6, "tokens_seen": 98304, "seq_len": 64,
                                            "val_loss": 0.9, "val_ppl": 2.46, "val_accuracy": 0.8125})
    write_run(tmp_path / "image", image, {"task": "image", "steps": 6, "images_seen": 1536, "num_tokens": 16,
                                          "val_loss": 1.2, "val_accuracy": 0.625, "images_per_s": 512.0})
    write_run(tmp_path / "recall-stopped", recall, None)
    return tmp_path


def test_each_task_shows_its_own_validation_metric(three_tasks):
    """Issue 50, point 5: a language model's perplexity, recall's and an image classifier's accuracy (never
    the perplexity of an MQAR run); counts are integers, images count as the image run's tokens."""
    table = list_runs(three_tasks).set_index("run")
    assert table.loc["lm", ["val", "val_metric"]].tolist() == [7.389, "val_ppl"]
    assert table.loc["recall", ["val", "val_metric"]].tolist() == [0.8125, "val_acc"]
    assert table.loc["image", ["val", "val_metric"]].tolist() == [0.625, "val_acc"]
    stopped = table.loc["recall-stopped"]
    assert stopped["val_metric"] == "val_acc" and pd.isna(stopped["val"])
    assert table.loc["image", "tokens"] == 1536 and table.loc["image", "tokens_per_s"] == 512.0
    assert table.loc["lm", "tokens"] == 253952 and table.loc["lm", "steps"] == 6
    assert all(str(table[c].dtype) == "Int64" for c in ("context", "steps", "tokens"))


def test_runs_prints_counts_as_integers(three_tasks, capsys):
    """253952, not 253952.0 (a column with a blank is a float column to pandas), in the table and the CSV."""
    main(["runs", str(three_tasks)])
    table = capsys.readouterr().out
    lm_row = next(line for line in table.splitlines() if line.rstrip().endswith(" lm"))
    assert " 253952 " in lm_row and " 6 " in lm_row and " 64 " in lm_row and ".0 " not in lm_row
    assert "<NA>" not in table and "nan" not in table
    main(["runs", str(three_tasks), "--csv"])
    rows = {row.split(",")[0]: row for row in capsys.readouterr().out.splitlines()[1:]}
    assert ",64,finished,6,253952,7.389,val_ppl," in rows["lm"]
    assert ",0.8125,val_acc," in rows["recall"]
