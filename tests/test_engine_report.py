"""What a step leaves (engine/report.py, tables.py): step.json, tables and floors, figures, README block."""

import json
import shutil

import pandas as pd

from ttt_bench.config import REPO_ROOT
from ttt_bench.experiments import EXPERIMENTS
from ttt_bench.experiments.engine import runner
from ttt_bench.experiments.minibatch import time_w_and_z
from ttt_bench.experiments.scaling import lower_hull_index
from ttt_bench.experiments.table1 import table1_markdown
from ttt_bench.io import write_json
from ttt_bench.machine import hardware


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


def test_a_sweep_whose_runs_all_failed_tabulates_as_not_run(tmp_path):
    """A registry with no finished run has no metric columns: its table says "not run yet" (ablate on a
    machine that cannot train them exited with a KeyError)."""
    from ttt_bench.experiments.engine.tables import by_config

    reg = pd.DataFrame({"run": ["a-s0", "a-s1"], "config": ["a", "a"], "status": ["failed", "failed"],
                        "error": ["UserError: needs a CUDA GPU"] * 2})
    row = by_config(reg).iloc[0]
    assert row["seeds"] == 0 and row["not_finished"] == 2 and pd.isna(row["ppl_mean"])


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
    assert all(p.stat().st_size > 0 for p in paths) and {p.suffix for p in paths} == {".png"}


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


def test_a_step_tabulated_without_training_says_so_instead_of_a_wall_time(tmp_path):
    """`--no-train` tabulates runs that other processes trained: its step.json must not pass the seconds of
    tabulation off as the step's wall time."""
    from ttt_bench.experiments.engine.report import Step

    Step(tmp_path, "scaling", "ttt-bench ablate scaling", trains=False).done()
    Step(tmp_path, "latency", "ttt-bench bench models").done()
    assert json.loads((tmp_path / "scaling" / "step.json").read_text())["tabulated_only"] is True
    assert json.loads((tmp_path / "latency" / "step.json").read_text())["tabulated_only"] is False


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
