"""The extension point (docs/architecture.md, "Add an experiment"): an experiment defined here, a sweep
config and one module's worth of code, registered in EXPERIMENTS, gets its plan, registry, verdict, table,
figure and REPORT section from the engine, without touching any other file."""

import json

import numpy as np
import pandas as pd
import pytest

from ttt_bench import reproduce
from ttt_bench.experiments import EXPERIMENTS
from ttt_bench.experiments.engine import plotting as P
from ttt_bench.experiments.engine.experiment import Experiment, Section, read_csv
from ttt_bench.experiments.engine.plan import configuration, data_overrides
from ttt_bench.experiments.engine.registry import select
from ttt_bench.experiments.engine.report import StepContext
from ttt_bench.experiments.engine.runner import Trained
from ttt_bench.experiments.engine.tables import summary_table
from ttt_bench.experiments.engine.verdicts import STATUSES, Claim, compare
from ttt_bench.io import write_atomic

# step 1: the sweep (conf/sweep/toy.yaml in a real experiment)
TOY_SWEEP = {
    "name": "toy",
    "data": "pile",
    "profiles": {"smoke": {"seeds": 2, "overrides": [
        "size=xs", "data.seq_len=64", "recipe.total_tokens=1024", "recipe.tokens_per_batch=512",
        "data.micro_batch_size=4", "data.val_tokens=1024", "data.corpus.train_docs=20",
        "data.corpus.validation_docs=4", "data.corpus.mean_doc_bytes=4000"]}},
    "methods": {"transformer": {"label": "Transformer", "overrides": ["model=transformer"]},
                "mamba": {"label": "Mamba", "overrides": ["model=mamba"]}},
    "paper_ppl": {"transformer": 11.0, "mamba": 10.9},
}


# step 2: the module
def toy_figure(reg: pd.DataFrame):
    agg = P.aggregate(P.plotted_runs(reg))
    fig, ax = P.plt.subplots(figsize=(4, 3), layout="constrained")
    for i, r in enumerate(agg.itertuples()):
        P.errorbar(ax, [i], [r.val_ppl], [r.ppl_std], r.label)
    ax.set(ylabel=f"Perplexity ({P.seeds_note(agg['n_seeds'])})", title="toy")
    P.legend_below(fig, P.handles_of(ax))
    return fig


class Toy(Experiment):
    name = "toy"
    definition = TOY_SWEEP
    section = Section("Toy: Mamba vs the Transformer", "A made-up claim for the test.", ["toy.md", "toy.png"],
                      ["Toy"])

    def configurations(self, profile, data_dir):
        base = data_overrides(self.sweep["data"], data_dir) + self.sweep["profiles"][profile]["overrides"]
        return [configuration(key, base + m["overrides"], m["label"], method=key,
                              paper_ppl=self.sweep["paper_ppl"][key])
                for key, m in self.sweep["methods"].items()]

    def tabulate(self, folder):
        reg = read_csv(folder, "registry.csv")
        write_atomic(folder / "toy.md", summary_table(reg, ["label"], read_csv(folder, "floors.csv")))
        P.save(toy_figure(reg), folder / "toy")

    @property
    def claims(self):
        paper = self.sweep["paper_ppl"]

        def judge(r):
            reg = r.csv("toy")
            return compare(select(reg, method="mamba"), select(reg, method="transformer"),
                           ("Mamba", "Transformer"), "<", r.floors,
                           f"; paper {paper['mamba']} vs {paper['transformer']}")

        return [Claim("toy.mamba", "Toy", "Mamba has lower perplexity than the Transformer.", judge)]


@pytest.mark.slow
def test_a_toy_experiment_gets_plan_registry_verdict_table_figure_and_report(tmp_path, monkeypatch):
    # step 3: the registry line
    toy = Toy()
    monkeypatch.setitem(EXPERIMENTS, "toy", toy)

    plan = toy.plan("smoke")
    assert list(plan) == ["transformer-s0", "mamba-s0", "transformer-s1", "mamba-s1"]
    assert plan["mamba-s1"].corpus == "synthetic" and "seed=1" in plan["mamba-s1"].overrides

    reproduce.main(["--profile", "smoke", "--steps", "toy", "--out", str(tmp_path / "results"),
                    "--runs", str(tmp_path / "runs")])
    out = tmp_path / "results" / "smoke-synthetic"
    reg = pd.read_csv(out / "toy" / "registry.csv")
    assert (reg["status"] == "finished").all() and len(reg) == 4
    assert np.isfinite(reg["val_ppl"]).all() and set(reg["method"]) == {"transformer", "mamba"}
    assert (out / "toy" / "floors.csv").is_file() and (out / "toy" / "toy.png").stat().st_size > 0
    assert "| Mamba |" in (out / "toy" / "toy.md").read_text()
    step = json.loads((out / "toy" / "step.json").read_text())
    assert step["command"] == "ttt-bench ablate toy --profile smoke"
    claims = pd.read_csv(out / "claims.csv").set_index("id")
    assert claims.loc["toy.mamba", "verdict"] in STATUSES[:-1]  # judged (two steps: under-trained, likely)
    assert "paper 10.9 vs 11.0" in claims.loc["toy.mamba", "evidence"]
    report = (out / "REPORT.md").read_text()
    assert "## Toy: Mamba vs the Transformer" in report and "![toy.png](toy/toy.png)" in report
    assert "Mamba has lower perplexity than the Transformer." in report

    # --report-only redraws the table and figure from the step folder alone, the same bytes
    before = {f: (out / "toy" / f).read_bytes() for f in ("toy.md", "toy.png")}
    (out / "toy" / "toy.md").unlink()
    reproduce.main(["--profile", "smoke", "--steps", "toy", "--out", str(tmp_path / "results"),
                    "--report-only"])
    assert {f: (out / "toy" / f).read_bytes() for f in before} == before


def test_a_step_in_parts_writes_its_folder_after_each_part(tmp_path, monkeypatch):
    """A step longer than a session (a profile's `parts`) is committable part by part: part k trains the
    first k/parts of the runs in plan order, and the step folder is written after each part."""
    toy = Toy()
    toy.definition = {**TOY_SWEEP, "profiles": {"smoke": {**TOY_SWEEP["profiles"]["smoke"], "parts": 2}}}
    stage, = toy.stages("smoke", None)
    assert list(stage.first(1, 2).runs) == ["transformer-s0", "mamba-s0"]  # every configuration's seed 0
    assert stage.first(2, 2).runs == stage.runs
    assert list(stage.first(1, 3).runs) == ["transformer-s0", "mamba-s0"]  # ceil(4 / 3) runs

    def train(profile, out, *args, part, **kwargs):  # stands in for training: the part's runs, finished
        runs = stage.first(*part).runs
        return Trained(pd.DataFrame({"run": list(runs), "status": "finished", "val_ppl": 9.0}))

    written = []
    monkeypatch.setattr(toy, "train", train)
    monkeypatch.setattr(toy, "tabulate", lambda folder: written.append(
        (len(pd.read_csv(folder / "registry.csv")), json.loads((folder / "step.json").read_text())["part"]
         if (folder / "step.json").is_file() else None)))
    ctx = StepContext("smoke", None, tmp_path, tmp_path / "runs", True, None, [])
    toy.run_step(ctx)
    assert written == [(2, None), (4, "1 of 2")]  # tabulated after each part, step.json written after
    assert json.loads((tmp_path / "toy" / "step.json").read_text())["part"] == "2 of 2"
