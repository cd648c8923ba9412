"""Every `ttt-bench` command in README.md runs, so the README cannot drift from the code. The commands are
read from the README's bash blocks; each runs in-process with tiny sizes substituted (a few training steps, a
few tokens); placeholders (`runs/<run>/...`, sweep folders, CSVs) become files this module makes. Commands
that need a GPU or a cluster are listed in GPU_ONLY, and those of several processes in TESTED_ELSEWHERE (both
must still be in the README); `ablate` runs with --plan (the smoke sweeps themselves run end to end in
test_experiments.py::test_reproduce_smoke)."""

import re
import shlex

import pandas as pd
import pytest
from ttt_bench.cli.main import main

from tests.conftest import DATA_DIR, REPO, TINY
from tests.test_bench import TINY as BENCH_TINY
from tests.test_figures import inner_losses, latency_bench, minibatch_registry, scaling_registry

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


def readme_commands() -> list[str]:
    """The `ttt-bench ...` lines of the README's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s+#", line)[0].strip()
            line = re.sub(r"^([A-Z_]+=\S+\s+)+", "", line)  # environment settings before the command
            if line.startswith("ttt-bench "):
                commands.append(" ".join(line.split()))
    return commands


COMMANDS = readme_commands()
# Overrides of a train or eval command that become tiny: (key, tiny value); None drops the key.
TINY_TRAIN = {"size": "xs", "data.seq_len": "64", "trainer.max_steps": "2"}
TINY_IMAGES = ["recipe.total_images=64", "recipe.batch_size=32", "data.micro_batch_size=32",
               "data.val_examples=64", "data.test_examples=64", "trainer.enable_progress_bar=false"]
TINY_TEXT_DATA = ["data.micro_batch_size=4", "recipe.tokens_per_batch=256", "data.val_tokens=512",
                  "data.num_proc=1", "trainer.enable_progress_bar=false"]


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
    args = [str(places.get(a, a)) for a in args]
    if "../shared/data" in command and not DATA_DIR.is_dir():
        pytest.skip(f"real data not found in {DATA_DIR} (set TTT_BENCH_DATA_DIR)")
    sub, rest = args[0], args[1:]
    if sub == "train":
        keys = {a.split("=")[0]: a for a in rest if "=" in a}
        data = keys.get("data", "data=synthetic").split("=")[1]
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
                            "--vocab-size", "64"]}[suite]
        return [sub, suite, *options, "--out", str(root / f"bench-{suite}.csv")]
    return args


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in GPU_ONLY | TESTED_ELSEWHERE.keys()])
def test_readme_command_runs(command, inputs, capsys):
    main(tiny(command, inputs))


def test_commands_run_elsewhere_or_only_on_gpus_are_still_in_the_readme():
    assert GPU_ONLY | TESTED_ELSEWHERE.keys() <= set(COMMANDS)


def test_readme_has_an_example_of_every_subcommand():
    from ttt_bench.cli.main import SUBCOMMANDS

    assert {c.split()[1] for c in COMMANDS} == set(SUBCOMMANDS)
