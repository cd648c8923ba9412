"""The paper-scale path on a SLURM cluster (docs/cluster.md), checked without a cluster (issue 50, point 2).

The page's SLURM commands cannot run here; this module is their stand-in. It runs the same kind of sweep
(`ttt-bench ablate ... trainer=slurm` through a submitit launcher) with `hydra/launcher=submitit_local` on
CPU processes at a tiny size, and checks that every run finished and that the registry was written. It also
checks that every `hydra.launcher.*` setting the page names is a field of the plugin's SLURM config and
composes. It plans the page's `ablate` commands on a tiny folder of Pile-format shards with a local
tokenizer.json, and runs the page's tokenization script on it.

It also checks the warning for a token budget that loops its corpus (ttt_bench/data/epochs.py): `ablate
--plan` and `ttt-bench train` give it for a budget far above a small corpus, and not for one below it.

Without hydra-submitit-launcher (the `slurm` and `dev` extras), the launcher tests skip and say so.
docs/cluster.md is deliberately not among tests/test_readme.py's pages: its commands need a cluster, the
Pile and the Llama tokenizer, and this module runs them in their tiny form instead.
"""

import importlib.util
import json
import re
import shlex

import pandas as pd
import pytest
import zstandard
from ttt_bench.cli.main import main

from tests.conftest import REPO, TINY, TINY_CORPUS
from tests.helpers import commands_in

PAGE = REPO / "docs" / "cluster.md"
needs_submitit = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="needs hydra-submitit-launcher (the slurm or dev extra): pip install -e '.[slurm]'")
PAPER_BUDGET = 4769 * 524288  # 125m: ceil(2.5B / 0.5M tokens) steps of 0.5M tokens


def page_commands(subcommand: str) -> list[str]:
    """The page's `ttt-bench SUBCOMMAND ...` commands (bash blocks, continuation lines joined)."""
    return [c for c in commands_in(PAGE.read_text()) if c.split()[1] == subcommand]


def is_launcher(arg: str) -> bool:
    return arg.lstrip("+~").startswith(("hydra.", "hydra/"))


@pytest.fixture
def shard_folder(tmp_path, tokenizer_dir):
    """The page's /data/ on a small scale: pile/train/00-01.jsonl.zst (20 documents, 35 kB of JSON lines),
    pile/val.jsonl.zst, and llama-2-tokenizer/ with a tiny BPE's tokenizer.json. Returns the folder that
    stands for /data/."""
    from ttt_bench.data.synthetic import SyntheticLanguage, generate_document

    lang, root = SyntheticLanguage(seed=0, vocab=2048), tmp_path / "data"
    (root / "pile" / "train").mkdir(parents=True)

    def shard(path, split, first, n):
        lines = [json.dumps({"text": generate_document(lang, 0, split, i, 2000),
                             "meta": {"pile_set_name": "Pile-CC"}}) for i in range(first, first + n)]
        path.write_bytes(zstandard.ZstdCompressor().compress("\n".join(lines).encode() + b"\n"))

    shard(root / "pile" / "train" / "00.jsonl.zst", "train", 0, 10)
    shard(root / "pile" / "train" / "01.jsonl.zst", "train", 10, 10)
    shard(root / "pile" / "val.jsonl.zst", "validation", 0, 4)
    tokenizer_dir.rename(root / "llama-2-tokenizer")
    return root


def on(folder, command: str) -> list[str]:
    """A page command's arguments with /data/ standing for `folder`."""
    return [a.replace("/data/", f"{folder}/") for a in shlex.split(command)[1:]]


# ---- the page's settings and commands ----


@needs_submitit
def test_every_launcher_setting_the_page_names_is_the_slurm_plugins_and_composes():
    """Each `hydra.launcher.X` of the page, in its commands or its prose, is a field of the SLURM launcher's
    config; the launch command's launcher overrides compose, one task per GPU."""
    from dataclasses import fields

    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    named = set(re.findall(r"hydra\.launcher\.(\w+)", PAGE.read_text()))
    assert named - {f.name for f in fields(SlurmQueueConf)} == set()
    assert {"partition", "gpus_per_node", "tasks_per_node", "timeout_min", "max_num_timeout"} <= named
    (launch,) = [c for c in page_commands("ablate") if "hydra/launcher=submitit_slurm" in c]
    launcher = [a for a in shlex.split(launch)[1:] if is_launcher(a)]
    with initialize_config_module("ttt_bench.conf", version_base="1.3"):
        cfg = hydra_compose("train", launcher, return_hydra_config=True)
    settings = cfg.hydra.launcher
    assert settings._target_.endswith("SlurmLauncher") and settings.max_num_timeout > 0
    assert settings.gpus_per_node == settings.tasks_per_node  # trainer=slurm: one rank per SLURM task
    assert "trainer=slurm" in launch and "--profile paper" in launch
    # the settings the prose gives with a value (`hydra.launcher.setup='["module load cuda"]'`, ...) compose,
    # and the plugin's defaults are the page's: USR2 120 s before the limit, no requeue at a time limit
    prose = [shlex.split(s)[0] for s in re.findall(r"`(hydra\.launcher\.\w+=[^`]+)`", PAGE.read_text())
             if not s.endswith("=...")]
    assert any(s.startswith("hydra.launcher.setup=") for s in prose), prose
    with initialize_config_module("ttt_bench.conf", version_base="1.3"):
        cfg = hydra_compose("train", ["hydra/launcher=submitit_slurm", *prose], return_hydra_config=True)
        default = hydra_compose("train", ["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher.setup == ["module load cuda"]
    assert (default.hydra.launcher.signal_delay_s, default.hydra.launcher.max_num_timeout) == (120, 0)


def test_the_pages_plans_name_the_paper_runs_and_warn_on_a_small_shard_folder(shard_folder, capsys):
    """The page's `ablate` commands (the plan and the launch, planned) parse and compose on a tiny shard
    folder: the 17 runs of Table 1's paper profile at 2.5B tokens each, on data=pile pointed at the shards
    with the local tokenizer. A 35 kB corpus is no Pile: every run gets the loop warning."""
    commands = page_commands("ablate")
    assert len(commands) == 2 and all("--profile paper" in c for c in commands)
    for command in commands:
        main([*on(shard_folder, command), *(["--plan"] if "--plan" not in command else [])])
        out = capsys.readouterr().out
        runs = [line for line in out.splitlines() if not line.startswith("#") and "[2.5e+09 tokens" in line]
        assert len(runs) == 17, out
        assert all(f"data.corpus.train_files={shard_folder}/pile/train/*.jsonl.zst" in r for r in runs)
        assert all(f"data.tokenizer.path={shard_folder}/llama-2-tokenizer" in r for r in runs)
        warnings = [line for line in out.splitlines() if line.startswith("# WARNING: run ")]
        assert len(warnings) == 17, out
        assert warnings[0].startswith(f"# WARNING: run 1-linear_attention-s0 trains {PAPER_BUDGET:,} tokens, "
                                      "at least ")
        assert "epochs of its train split (at most " in warnings[0]
        assert f"{shard_folder}/pile/train/00.jsonl.zst and 1 more files" in warnings[0]
        assert "docs/cluster.md" in warnings[0]


def test_the_pages_tokenization_script_caches_the_shards_the_budget_reaches(shard_folder, no_hub, capsys):
    """The page's python block (prepare_pile.py), on the tiny shards with the local tokenizer and the hub
    closed: both shards are tokenized (their 35 kB are far under the budget) and it says so."""
    (script,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    script = script.replace("/data/", f"{shard_folder}/").replace("data.num_proc=32", "data.num_proc=1")
    exec(compile(script, "prepare_pile.py", "exec"), {})
    out = capsys.readouterr().out
    said = rf"^[\d,]+ train tokens in 2 shard caches for a budget of {PAPER_BUDGET:,}$"
    assert re.search(said, out, re.M), out


# ---- the warning for a budget that loops its corpus ----


def test_the_plan_warns_for_a_budget_far_above_a_small_corpus_and_not_below_it(shard_folder, capsys):
    """The same shards (35 kB of JSON lines: at most 35k tokens) under minibatch's smoke budget of 4,096
    tokens: no warning; under 200 times that (819,200 tokens, --scale 200): a warning for each of its 3
    runs."""
    data = [f"data.corpus.train_files={shard_folder}/pile/train/*.jsonl.zst",
            f"data.corpus.validation_files={shard_folder}/pile/val.jsonl.zst"]
    plan = ["ablate", "minibatch", "--profile", "smoke", "--data-dir", str(shard_folder / "pile"), "--plan",
            *data]
    main(plan)
    out = capsys.readouterr().out
    assert "[4.1e+03 tokens" in out and "WARNING" not in out, out
    main([*plan, "--scale", "200"])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("# WARNING: run ")]
    assert [w.split()[3] for w in warnings] == ["b1-s0", "b16-s0", "bT-s0"], out
    assert "trains 819,200 tokens, at least " in warnings[0]


def test_the_paper_budget_on_pile_mini_is_at_least_70_epochs(shared_data):
    """What issue 50 found: the paper plan with --data-dir ../shared/data loops pile-mini ~70 times. The bound
    the plan gives is within 3% of the exact count training reports (34,261,482 byte tokens)."""
    from ttt_bench.config import compose
    from ttt_bench.data.epochs import planned_loop_warning

    cfg = compose("train", ["data=pile", f"paths.data_dir={shared_data}", "experiment=pile_2k", "size=125m"])
    warning = planned_loop_warning("x", cfg.data, PAPER_BUDGET)
    epochs = int(re.search(r"at least ([\d,]+) epochs", warning)[1])
    assert 70 <= epochs <= 73 and "pile-mini/train.jsonl.zst" in warning, warning
    assert planned_loop_warning("x", cfg.data, 3_000_000) is None  # the cpu profile's Table 1 budget


def train_output(capsys, tmp_path, *overrides) -> str:
    main(["train", "model=transformer", "size=xs", *TINY, *overrides, f"paths.runs={tmp_path / 'runs'}"])
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_train_warns_when_its_budget_loops_its_corpus_and_not_otherwise(capsys, tmp_path):
    """`ttt-bench train`, from the exact count of the tokenized train split: 2 documents (2,361 tokens) under
    24 steps of 512 tokens (12,288: 5.2 epochs) warn, naming the run folder; conftest's tiny corpus (24
    documents, ~77k tokens) under 2 steps (1,024 tokens) does not."""
    out = train_output(capsys, tmp_path, "data.corpus.train_docs=2", "data.corpus.mean_doc_bytes=1000",
                       "trainer.max_steps=24")
    (line,) = [line for line in out.splitlines() if "epochs of its train split" in line]
    (run,) = (tmp_path / "runs").glob("*/*/checkpoints")
    assert f"run {run.parent} trains 12,288 tokens, " in line and "WARNING" in line, line
    assert "at least" not in line and "the embedded synthetic corpus" in line and "docs/cluster.md" in line
    epochs = float(re.search(r"tokens, ([\d.]+) epochs", line)[1])
    assert epochs > 4
    out = train_output(capsys, tmp_path / "below", "trainer.max_steps=2")
    assert "epochs of its train split" not in out


# ---- a sweep through a submitit launcher ----


@needs_submitit
@pytest.mark.slow
def test_a_sweep_through_submitit_local_trains_every_run_into_the_registry(tmp_path, capsys):
    """`ttt-bench ablate` as on the cluster: one submitit job per run (`submitit_local`: a process each, the
    SLURM launcher's code path but for sbatch), with `trainer=slurm` (Lightning's DDP, one rank here where
    no SLURM environment sets more). Every run finishes and the registry lists them all; the same command
    again trains nothing (what a re-run after preemption does to finished runs)."""
    out = tmp_path / "sweep"
    command = ["ablate", "minibatch", "--profile", "smoke", "--out", str(out),
               "hydra/launcher=submitit_local", "trainer=slurm", "trainer.accelerator=cpu", *TINY_CORPUS,
               "data.num_proc=1"]  # the tiny synthetic corpus of the other end-to-end tests, for every run
    main(command)
    printed = capsys.readouterr().out
    registry = pd.read_csv(out / "registry.csv")
    assert sorted(registry["run"]) == ["b1-s0", "b16-s0", "bT-s0"]
    assert set(registry["status"]) == {"finished"}, registry[["run", "status"]]
    for run in registry["run"]:
        metrics = json.loads((out / run / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["steps"] == 8  # 4,096 tokens of 512
        assert "trainer=slurm" in json.loads((out / run / "run.json").read_text())["overrides"]
    assert len(list((out / ".submitit").iterdir())) >= 3  # a submitit job folder per run
    assert f"registry {out / 'registry.csv'}" in printed
    jobs = sorted((out / ".submitit").iterdir())
    stamps = {run: (out / run / "metrics.json").stat().st_mtime_ns for run in registry["run"]}
    main(command)  # again: every run is finished, so no job is submitted and no run folder changes
    assert sorted((out / ".submitit").iterdir()) == jobs
    assert {run: (out / run / "metrics.json").stat().st_mtime_ns for run in registry["run"]} == stamps
    assert pd.read_csv(out / "registry.csv")["status"].eq("finished").all()
