"""Every `ttt-bench` command in README.md, docs/usage.md and docs/scaleout.md runs, so none can drift from the
code. The commands are read from the pages' bash blocks; each runs in-process with tiny sizes substituted (a
few training steps, a few tokens); placeholders (`runs/<run>/...`, the quickstart's run folders, sweep
folders, CSVs) become files this module makes. Commands that need a GPU or a cluster are listed in GPU_ONLY,
and those of several processes in TESTED_ELSEWHERE (both must still be in the README); `ablate` runs with
--plan (the smoke sweeps themselves run end to end in test_engine_runner.py::test_reproduce_smoke). The
README's links resolve, its combined verdict counts are results/REPORT.md's, and it stays a short page."""

import re
import shlex

import pandas as pd
import pytest
from ttt_bench.cli.main import main

from tests.conftest import BENCH_TINY, DATA_DIR, REPO, TINY, TINY_BATCH, TINY_IMAGE_BUDGET
from tests.helpers import commands_in, inner_losses, latency_bench, minibatch_registry, scaling_registry

# Commands of several processes, run by the test named (an in-process call cannot start the other ranks).
TESTED_ELSEWHERE = {
    "ttt-bench train model=ttt_linear size=xs trainer=ddp trainer.accelerator=cpu trainer.devices=2":
        "tests/test_scaleout.py, two gloo processes",
}
GPU_ONLY = {
    "ttt-bench train model=ttt_linear size=1.3b recipe=paper data=books data.seq_len=8192 trainer=gpu",
    "ttt-bench train model=ttt_linear size=760m recipe=paper trainer=ddp",
    "ttt-bench train model=transformer size=1.3b recipe=paper trainer=fsdp",
    "ttt-bench ablate scaling hydra/launcher=submitit_slurm",
}


# The pages whose bash blocks are run: the README, and the pages its examples moved to.
PAGES = ("README.md", "docs/usage.md", "docs/scaleout.md")


def readme_commands(page: str = "README.md") -> list[str]:
    """The `ttt-bench ...` lines of a page's bash blocks, continuation lines joined, comments dropped."""
    return commands_in((REPO / page).read_text())


README_COMMANDS = readme_commands()
COMMANDS = list(dict.fromkeys(c for page in PAGES for c in readme_commands(page)))  # each command once
# Overrides of a train or eval command that become tiny: (key, tiny value); None drops the key.
TINY_TRAIN = {"size": "xs", "data.seq_len": "64", "trainer.max_steps": "2"}
# An image command: the tiny image run's budget at two steps; a text command on real data: the tiny run's
# batch geometry (its synthetic corpus is for data=synthetic) at 256 tokens a step.
TINY_IMAGES = [*TINY_IMAGE_BUDGET, "recipe.total_images=64", "data.val_examples=64", "data.test_examples=64"]
TINY_TEXT_DATA = [*TINY_BATCH, "recipe.tokens_per_batch=256", "data.val_tokens=512"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A trained checkpoint and the files the plot examples read, at the README's placeholder paths."""
    root = tmp_path_factory.mktemp("readme")
    main(["train", "model=transformer", "size=xs", *TINY, "trainer.max_steps=2",
          f"paths.runs={root / 'runs'}"])
    (ckpt,) = (root / "runs").glob("*/*/checkpoints/last.ckpt")
    scaling = root / "scaling"
    scaling_registry(scaling).to_csv(scaling / "registry.csv", index=False)
    minibatch = root / "minibatch"
    minibatch.mkdir()
    reg, timing = minibatch_registry()
    reg.to_csv(minibatch / "registry.csv", index=False)
    timing.to_csv(minibatch / "timing.csv", index=False)
    recall = root / "recall"
    recall.mkdir()
    rows = [{"run": f"tf-{w}-{n}", "status": "finished", "label": "Transformer", "width": w, "pairs": n,
             "seq_len": 32, "state_floats": 64 * w, "val_accuracy": 1 / n} for w in (32, 64) for n in (2, 4)]
    pd.DataFrame(rows).to_csv(recall / "registry.csv", index=False)
    inner_losses().to_csv(root / "inner_losses.csv", index=False)
    latency_bench().to_csv(root / "models.csv", index=False)
    return {"root": root, "ckpt": str(ckpt), "scaling": scaling, "minibatch": minibatch, "recall": recall}


def data_of(keys: dict[str, str]) -> str:
    """The data config a train command uses: its data=, else its experiment's (conf/experiment/), else the
    default synthetic corpus."""
    if "data" in keys:
        return keys["data"].split("=")[1]
    if "experiment" in keys:
        name = keys["experiment"].split("=")[1]
        config = (REPO / "conf" / "experiment" / f"{name}.yaml").read_text()
        found = re.search(r"override /data:\s*(\S+)", config)
        if found:
            return found.group(1)
    return "synthetic"


# A run folder by its run name, runs/<model>-<size>-<data>-T<context> (the quickstart's): the runs made here.
RUN_NAME = re.compile(r"runs/[a-z0-9_]+-[a-z0-9.]+-[a-z0-9_]+-T\d+/?")


def tiny(command: str, inputs: dict) -> list[str]:
    """The command's arguments with tiny sizes and the placeholders replaced."""
    root = inputs["root"]
    args = shlex.split(command)[1:]
    places = {"runs/sweeps/scaling-smoke": inputs["scaling"], "runs/sweeps/recall-smoke": inputs["recall"],
              "runs/sweeps/minibatch-smoke": inputs["minibatch"],
              "runs/<run>/inner_losses.csv": root / "inner_losses.csv",
              "runs/bench/models.csv": root / "models.csv", "figures/": root / "figs",
              "runs/": root / "runs",
              "../shared/data": DATA_DIR}
    args = [str(root / "runs") if RUN_NAME.fullmatch(a) else str(places.get(a, a)) for a in args]
    if "../shared/data" in command and not DATA_DIR.is_dir():
        pytest.skip(f"real data not found in {DATA_DIR} (set TTT_BENCH_DATA_DIR)")
    sub, rest = args[0], args[1:]
    if sub == "train":
        keys = {a.split("=")[0]: a for a in rest if "=" in a}
        data = data_of(keys)
        if data not in ("synthetic", "synthetic_images") and not DATA_DIR.is_dir():
            pytest.skip(f"data={data} needs the real data in {DATA_DIR} (set TTT_BENCH_DATA_DIR)")
        if keys.get("task") == "task=image":
            return [sub, *[a for k, a in keys.items() if k != "recipe.total_images"], *TINY_IMAGES,
                    f"paths.data_dir={DATA_DIR}", f"paths.runs={root / 'runs'}"]
        rest = [f"{k}={TINY_TRAIN[k]}" if k in TINY_TRAIN else a for k, a in keys.items()]
        rest += [f"{k}={v}" for k, v in TINY_TRAIN.items() if k not in keys]
        rest += TINY if data == "synthetic" else [*TINY_TEXT_DATA, f"paths.data_dir={DATA_DIR}"]
        return [sub, *rest, f"paths.runs={root / 'runs'}"]
    if sub == "eval":
        if "data=books" in rest and not DATA_DIR.is_dir():
            pytest.skip(f"data=books needs the real corpora in {DATA_DIR}")
        rest = [f"ckpt_path={inputs['ckpt']}" if a.startswith("ckpt_path=") else a for a in rest]
        rest = [a for a in rest if not a.startswith(("seq_len=", "max_tokens="))]
        return [sub, *rest, "seq_len=64", "max_tokens=512", f"paths.data_dir={DATA_DIR}",
                f"paths.runs={root / 'runs'}"]
    if sub == "generate":
        rest = [inputs["ckpt"] if a.endswith(".ckpt") else a for a in rest]
        return [sub, *rest, "--max-new-tokens", "5"]
    if sub == "ablate":
        return [sub, *rest, "--plan"]
    if sub == "bench":
        suite = rest[0]
        options = {"models": ["--models", "transformer,ttt_linear", *BENCH_TINY],
                   "forms": ["--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--tokens", "64",
                             "--repeats", "1"],
                   "scan": ["--batch", "1", "--seqlen", "32", "--ref-seqlen", "16", "--d-model", "8",
                            "--repeats", "1"],
                   "step": ["--models", "transformer", "--size", "xs", "--seq-len", "16",
                            "--vocab-size", "64"],
                   "profile": [*rest[1:], "--warmup", "0"]}[suite]
        return [sub, suite, *options, "--out", str(root / f"bench-{suite}.csv")]
    return args


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in GPU_ONLY | TESTED_ELSEWHERE.keys()])
def test_readme_command_runs(command, inputs, capsys):
    main(tiny(command, inputs))


def test_commands_run_elsewhere_or_only_on_gpus_are_still_in_the_readme():
    assert GPU_ONLY | TESTED_ELSEWHERE.keys() <= set(COMMANDS)


def test_readme_has_an_example_of_every_subcommand():
    from ttt_bench.cli.main import SUBCOMMANDS

    assert {c.split()[1] for c in README_COMMANDS} == set(SUBCOMMANDS)


def test_readme_quickstart_trains_on_the_real_corpus_and_uses_its_runs():
    """The quickstart: the two commands, activating the environment, TTT-Linear and a Transformer trained with
    experiment=cpu_pile, `plot curves` of the two, `generate` from one, `runs`; the run folders it names are
    those its train commands make (conf/train.yaml: runs/<run_name>/<the overrides as a folder name>)."""
    from ttt_bench.config import _slug

    text = (REPO / "README.md").read_text()
    start = text.index("## Quickstart")
    quick = text[start:text.index("\n## ", start + 1)]
    for needed in (". .venv/bin/activate", "make reproduce", "make test"):
        assert needed in quick, f"the quickstart lacks {needed}"
    commands = commands_in(quick)
    assert {c.split()[1] for c in commands} >= {"train", "plot", "generate", "runs"}
    experiment = (REPO / "conf" / "experiment" / "cpu_pile.yaml").read_text()
    size = re.search(r"override /size:\s*(\S+)", experiment)[1]
    context = re.search(r"seq_len:\s*(\d+)", experiment)[1]
    data = data_of({"experiment": "experiment=cpu_pile"})
    runs = {}  # model -> (runs/<run_name>, its run folder)
    for train in (c for c in commands if c.startswith("ttt-bench train ")):
        overrides = dict(o.split("=", 1) for o in train.split()[2:])
        assert overrides.get("experiment") == "cpu_pile", train
        name = f"runs/{overrides['model']}-{size}-{data}-T{context}"
        dirname = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))  # hydra's override_dirname
        runs[overrides["model"]] = (name, f"{name}/{_slug(dirname)}")
    assert {"ttt_linear", "transformer"} <= runs.keys()
    plotted = next(c for c in commands if c.startswith("ttt-bench plot curves")).split()
    assert all(name in plotted for name, _ in runs.values()), f"plot curves should name {runs}"
    generated = next(c for c in commands if c.startswith("ttt-bench generate")).split()[2]
    assert generated in {f"{folder}/checkpoints/last.ckpt" for _, folder in runs.values()}, generated


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINKED_PAGES = ["README.md", *(p.relative_to(REPO).as_posix() for p in sorted(REPO.glob("docs/*.md")))]


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_links_resolve(page):
    """Every relative link of the README and of the docs pages (where its detail moved) names a file that
    exists, and an anchor a heading of that file."""
    path = REPO / page
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file) if file else path
        assert linked.exists(), f"{page} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            anchors = {github_anchor(h) for h in headings}
            assert anchor in anchors, f"{page} links to {target}: no such heading"


def test_readme_counts_are_the_combined_reports():
    """The README's verdict counts are those of results/REPORT.md (the combined report), word for word."""
    report = REPO / "results" / "REPORT.md"
    if not report.is_file():
        pytest.skip("no results/REPORT.md (python -m ttt_bench.experiments.engine.combined --combine "
                    "results)")
    counts = re.search(r"\*\*(\d+ claims: [^*]+)\*\*", report.read_text())
    assert counts, "results/REPORT.md has no bold count line"
    assert f"**{counts.group(1)}**" in (REPO / "README.md").read_text(), (
        f"README's counts differ from results/REPORT.md's: copy **{counts.group(1)}** into its Results")


def test_readme_stays_a_short_page():
    """A newcomer's map: the hand-written part (outside the generated results block) stays short; detail goes
    to docs/."""
    from ttt_bench.experiments.engine.report import README_BLOCK

    text = (REPO / "README.md").read_text()
    start, end = text.index(README_BLOCK[0]), text.index(README_BLOCK[1])
    written = text[:start] + text[end:]
    assert len(written.splitlines()) <= 190, "README.md's own part is over 190 lines: move detail to docs/"
