"""Bad inputs: each gives one line saying what is wrong and how to fix it, exit code 2, and leaves no
half-written output folder. Run through the CLI in-process."""

import gzip
import io
import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
import zstandard
from omegaconf import OmegaConf
from ttt_bench.cli.main import main

from tests.conftest import TINY_BATCH, TINY_CORPUS, TINY_IMAGE
from tests.helpers import cli_error
from ttt_bench.config import compose
from ttt_bench.data import LMDataModule, LocalCorpus
from ttt_bench.data.corpora import ReadStats
from ttt_bench.errors import UserError
from ttt_bench.training.module import LitLM

# The tiny run's batch geometry without its corpus (for data=pile, text or mqar), 2 steps of 256 tokens; TINY
# adds a corpus of 6 documents.
BASE = [*TINY_BATCH, "size=xs", "recipe.tokens_per_batch=256", "trainer.max_steps=2"]
TINY = [*BASE, "data.corpus.train_docs=6", "data.corpus.validation_docs=2", "data.corpus.mean_doc_bytes=2000"]


CONFIG_ERRORS = [
    (["model=transfomer"], "unknown model 'transfomer'; did you mean 'transformer'?"),
    (["size=xxl"], "unknown size 'xxl'; use one of: 1.3b, 125m"),
    (["data=synth"], "unknown data 'synth'; did you mean 'synthetic'?"),
    (["trainer=gpuu"], "unknown trainer 'gpuu'; did you mean 'gpu'?"),
    (["data.seq_lenn=64"], "unknown config key 'data.seq_lenn'; did you mean 'data.seq_len'?"),
    (["modle=transformer"], "unknown config key 'modle'; did you mean 'model'?"),
    (["data.corpus.train_doc=3"], "did you mean 'data.corpus.train_docs'?"),
    (["data.seq_len=[64"], "bad override"),
    (["data.seq_len=abc"], "data.seq_len='abc' must be a positive integer, e.g. data.seq_len=512"),
    (["recipe.lr=fast"], "recipe.lr='fast' must be a positive number"),
    (["size.d_model=0"], "size.d_model=0 must be a positive integer"),
    (["data.micro_batch_size=-4"], "data.micro_batch_size=-4 must be a positive integer"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be a positive integer"),
    (["size.n_heads=3"], "size.n_heads=3 does not divide size.d_model=64"),
    (["model=ttt_linear", "model.block.mini_batch_size=0"], "mini_batch_size=0 must be between 1 and"),
    (["model=ttt_linear", "model.block.mini_batch_size=128"], "mini_batch_size=128 must be between 1 and"),
    (["model.max_seq_len=32"], "data.seq_len=64 is above the model's maximum context model.max_seq_len=32"),
    (["recipe.tokens_per_batch=320"], "not a multiple of data.micro_batch_size"),
    (["nonfinite=ignore"], "nonfinite must be 'stop' or 'skip'"),
    (["data.corpus.train_docs=0"], "the corpus has no documents in its 'train' split"),
]


@pytest.mark.parametrize("overrides,message", CONFIG_ERRORS, ids=[" ".join(o) for o, _ in CONFIG_ERRORS])
def test_bad_train_config(capsys, tmp_path, overrides, message):
    assert message in cli_error(capsys, tmp_path, "train", *TINY, *overrides)


def test_gpu_trainer_without_cuda(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = cli_error(capsys, tmp_path, "train", *TINY, "trainer=gpu")
    assert "needs a CUDA GPU and this machine has none; use trainer=cpu" in err


def test_unknown_subcommand(capsys, tmp_path):
    assert "did you mean 'train'?" in cli_error(capsys, tmp_path, "trian")


def write_shard(path, lines: list[bytes]) -> str:
    path.write_bytes(zstandard.ZstdCompressor().compress(b"".join(line + b"\n" for line in lines)))
    return str(path)


GOOD = json.dumps({"text": "a good document " * 20}).encode()


BAD_LINES = [(b"{not json", "not a JSON object"), (b'{"txt": "x"}', "document has no 'text'")]


@pytest.mark.parametrize("bad_line,message", BAD_LINES)
def test_bad_pile_lines_error_or_skip(capsys, tmp_path, bad_line, message):
    shard = write_shard(tmp_path / "shard.jsonl.zst", [GOOD, bad_line, GOOD])
    files = [f"data.corpus.train_files={shard}", f"data.corpus.validation_files={shard}"]
    err = cli_error(capsys, tmp_path, "train", *BASE, "data=pile", *files, "data.corpus.on_bad_line=error")
    assert f"{shard}:2: " in err and message in err and "data.corpus.on_bad_line=skip" in err
    stats = ReadStats()
    assert len(list(LocalCorpus(train_files=shard, validation_files=shard).documents("train", stats))) == 2
    assert stats.bad_lines + stats.missing_text == 1 and stats.documents == 2


def test_glob_matching_no_files(capsys, tmp_path):
    glob = f"data.corpus.train_files={tmp_path}/none/*.txt"
    err = cli_error(capsys, tmp_path, "train", *BASE, "data=text", glob)
    assert "no files match data.corpus.train_files" in err


def test_non_utf8_bytes_are_replaced_counted_and_reported(tmp_path):
    bad = b'{"text": "caf\xe9 ' + b"ok " * 40 + b'"}'  # latin-1 byte, not UTF-8
    shard = write_shard(tmp_path / "shard.jsonl.zst", [GOOD, bad, GOOD])
    dm = LMDataModule(LocalCorpus(train_files=shard, validation_files=shard), {"kind": "byte"}, seq_len=32,
                      micro_batch_size=2, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    stats = dm.meta["train"]["read_stats"]
    assert stats["non_utf8_documents"] == 1 and stats["documents"] == 3
    assert "caf\ufffd" in list(LocalCorpus(train_files=shard).documents("train"))[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Checkpoints of the TINY transformer: valid, another architecture, unfit for its config, truncated."""
    folder = tmp_path_factory.mktemp("ckpts")
    cfg = compose("train", TINY)

    def module(**size):
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True) | size
        return LitLM(model_cfg=model_cfg, recipe=OmegaConf.to_container(cfg.recipe, resolve=True),
                     vocab_size=257, tokenizer={"kind": "byte"})

    good, other = module(), module(n_layers=2)
    paths = {name: folder / f"{name}.ckpt" for name in ("good", "other_arch", "mismatch", "truncated")}
    for name, config, weights in [("good", good, good), ("other_arch", other, other),
                                  ("mismatch", good, other)]:
        torch.save({"hyper_parameters": dict(config.hparams), "state_dict": weights.state_dict()},
                   paths[name])
    paths["truncated"].write_bytes(paths["good"].read_bytes()[:1000])
    return paths


def test_checkpoint_errors(capsys, tmp_path, checkpoints):
    missing = tmp_path / "nope.ckpt"
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={missing}")
    assert f"checkpoint {missing} does not exist" in err
    assert "does not exist" in cli_error(capsys, tmp_path, "train", *TINY, f"ckpt_path={missing}")
    assert "does not exist" in cli_error(capsys, tmp_path, "generate", str(missing), "--prompt", "a")
    assert "no checkpoint given; run ttt-bench eval ckpt_path=" in cli_error(capsys, tmp_path, "eval")
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={checkpoints['truncated']}")
    assert f"checkpoint {checkpoints['truncated']} is unreadable" in err
    err = cli_error(capsys, tmp_path, "train", *TINY, f"ckpt_path={checkpoints['other_arch']}")
    assert "holds another model (n_layers=2, this run has n_layers=4)" in err
    err = cli_error(capsys, tmp_path, "generate", str(checkpoints["mismatch"]), "--prompt", "a")
    assert "does not match its model config" in err
    err = cli_error(capsys, tmp_path, "generate", str(checkpoints["good"]), "--prompt", "")
    assert "--prompt is empty" in err


# -- issue 21: corrupt corpora, device, disk full, registries, every subcommand ---------------------------

CORRUPT_SHARDS = [
    ("truncated", lambda z, data: z[: len(z) // 2], "is truncated or empty"),
    ("gzip", lambda z, data: __import__("gzip").compress(data), "is not a valid zstd file"),
    ("plain_text", lambda z, data: data, "is not a valid zstd file"),
]


@pytest.mark.parametrize("name,damage,message", CORRUPT_SHARDS, ids=[c[0] for c in CORRUPT_SHARDS])
def test_corrupt_shard_is_an_error_even_when_skipping_bad_lines(capsys, tmp_path, name, damage, message):
    data = b"".join(GOOD + b"\n" for _ in range(200))
    shard = tmp_path / f"{name}.jsonl.zst"
    shard.write_bytes(damage(zstandard.ZstdCompressor().compress(data), data))
    files = [f"data.corpus.train_files={shard}", f"data.corpus.validation_files={shard}"]
    err = cli_error(capsys, tmp_path, "train", *BASE, "data=pile", *files, "data.corpus.on_bad_line=skip")
    assert f"{shard} {message}" in err and "re-download" in err


BUDGET = "trainer.max_steps='${ttt.steps:${recipe.total_tokens},${recipe.tokens_per_batch}}'"  # conf/trainer
MORE_CONFIG_ERRORS = [
    (["recipe.total_tokens=abc", BUDGET], "recipe.total_tokens='abc' must be a positive number of tokens"),
    (["recipe.total_tokens=-5", BUDGET], "recipe.total_tokens=-5 must be a positive number of tokens"),
    (["data.val_tokens=0"], "data.val_tokens=0 must be a positive integer or null"),
    (["data.tokenizer.kind=bpe", "+data.tokenizer.vocab_size=100"],
     "data.tokenizer.vocab_size=100 must be an integer of at least 257"),
    (["data.corpus.train_docs=1", "data.corpus.mean_doc_bytes=200", "recipe.tokens_per_batch=512"],
     "has 5 sequences of data.seq_len=64, fewer than the 8 of one batch"),
    (["recipe.tokens_per_batch=500"], "recipe.tokens_per_batch=500 is not a whole number of sequences of "
     "data.seq_len=64 tokens; use a multiple, e.g. recipe.tokens_per_batch=512"),
    (["recipe.lr=nan"], "recipe.lr=nan must be a positive number"),
    (["recipe.lr=inf"], "recipe.lr=inf must be a positive number"),
    (["recipe.min_lr=1.0"], "recipe.min_lr=1.0 must be a number between 0 and recipe.lr=0.003"),
    (["recipe.min_lr=-1e-5"], "recipe.min_lr=-1e-05 must be a number between 0 and recipe.lr"),
    (["recipe.warmup_fraction=1.5"], "recipe.warmup_fraction=1.5 must be a fraction of the steps in [0, 1)"),
    (["recipe.warmup_fraction=nan"], "recipe.warmup_fraction=nan must be a fraction"),
    (["seed=abc"], "seed='abc' must be an integer >= 0, e.g. seed=1"),
    (["seed=-3"], "seed=-3 must be an integer >= 0"),
    (["trainer.precision=16-mixed"], "trainer.precision=16-mixed (float16) needs a GPU; on the CPU use"),
    (["data=mqar", "data.power_a=inf"], "data.power_a=inf must be a finite number > 0"),
]


@pytest.mark.parametrize("overrides,message", MORE_CONFIG_ERRORS, ids=[o[0] for o, _ in MORE_CONFIG_ERRORS])
def test_more_bad_train_values(capsys, tmp_path, overrides, message):
    base = BASE if "data=mqar" in overrides else TINY  # (MQAR has no corpus and no num_proc)
    base = [o for o in base if not ("data=mqar" in overrides and o.startswith("data.num_proc"))]
    assert message in cli_error(capsys, tmp_path, "train", *base, *overrides)


def test_an_empty_runs_variable_means_the_default_folder_not_the_root(tmp_path, monkeypatch):
    """TTT_BENCH_RUNS= (set but empty) is the default ./runs, as a shell's ${NAME:-default}: never /."""
    monkeypatch.setenv("TTT_BENCH_RUNS", "")
    monkeypatch.chdir(tmp_path)
    main(["train", *TINY, "trainer.max_steps=1", "trainer.enable_progress_bar=false"])
    assert list((tmp_path / "runs").glob("*/*/metrics.json"))


def test_reproduce_steps_that_name_no_step_are_an_error(capsys):
    from ttt_bench import reproduce

    with pytest.raises(SystemExit) as e:
        reproduce.main(["--steps", ","])
    assert e.value.code == 2 and "names no step" in capsys.readouterr().err


def test_cuda_device_without_a_gpu_is_not_a_truncated_checkpoint(capsys, tmp_path, checkpoints):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    good = str(checkpoints["good"])
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={good}", "device=cuda")
    assert "device=cuda needs a CUDA GPU and this machine has none; use device=cpu" in err
    err = cli_error(capsys, tmp_path, "generate", good, "--prompt", "a", "--device", "cuda")
    assert "--device=cuda needs a CUDA GPU" in err and "unreadable" not in err
    err = cli_error(capsys, tmp_path, "generate", good, "--prompt", "a", "--device", "tpu")
    assert "is not a device" in err


def test_eval_options_are_checked(capsys, tmp_path, checkpoints):
    good = f"ckpt_path={checkpoints['good']}"
    err = cli_error(capsys, tmp_path, "eval", good, "batch_size=0")
    assert "batch_size=0 must be a positive integer" in err
    err = cli_error(capsys, tmp_path, "eval", good, "max_tokens=abc")
    assert "max_tokens='abc' must be a positive integer or null" in err


# What eval reads: the tiny corpus, 256 of its tokens.
SMALL_DATA = ["data=synthetic", *TINY_CORPUS, "data.num_proc=1", "max_tokens=256", "batch_size=2"]


def test_eval_on_another_data_config(capsys, tmp_path, checkpoints):
    """README: `ttt-bench eval ckpt_path=... data=books` failed with "Interpolation key 'seed' not found"."""
    main(["eval", f"ckpt_path={checkpoints['good']}", *SMALL_DATA, f"paths.runs={tmp_path}"])
    metrics = json.loads(next(tmp_path.rglob("metrics.json")).read_text())
    assert metrics["data"] == "synthetic" and metrics["val_tokens"] > 0


def test_disk_full_is_one_line_and_leaves_no_partial_output(capsys, tmp_path, checkpoints, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("ttt_bench.io.os.fsync", full)  # every atomic write fails as on a full disk
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={checkpoints['good']}", *SMALL_DATA,
                    f"paths.cache={tmp_path / 'cache'}")
    assert "no space left on device" in err and "TTT_BENCH_RUNS" in err
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()], "partial token cache left"


def test_a_full_disk_under_torch_save_or_datasets_is_one_line_naming_the_path(capsys, tmp_path, monkeypatch):
    """torch.save reports a full disk as RuntimeError("... file write failed"), datasets wraps the OSError in
    its DatasetGenerationError: both reach the user as "no space left on device (PATH)", exit 2, nothing
    half-written."""
    import errno

    import datasets

    def torch_save(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                           "file data/3: file write failed")

    monkeypatch.setattr("ttt_bench.training.checkpoint.torch.save", torch_save)
    monkeypatch.setattr("ttt_bench.io.shutil.disk_usage", lambda p: type("U", (), {"free": 4096})())
    err = cli_error(capsys, tmp_path, "train", *TINY, "trainer.max_steps=2", "checkpoint_every_n_steps=1",
                    f"paths.cache={tmp_path / 'cache'}")
    assert "no space left on device" in err and "step-1.ckpt" in err and "TTT_BENCH_RUNS" in err
    monkeypatch.undo()

    def generate(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "arrow"))
        except OSError as e:
            raise datasets.exceptions.DatasetGenerationError("generating the dataset failed") from e

    monkeypatch.setattr(datasets.Dataset, "from_generator", generate)
    err = cli_error(capsys, tmp_path, "train", *TINY, f"paths.cache={tmp_path / 'cache2'}")
    assert "no space left on device" in err and str(tmp_path / "cache" / "arrow") in err
    assert not [p for p in (tmp_path / "cache2").rglob("*") if p.is_file() and "tokens" in p.name]


def test_registries_that_are_empty_or_corrupt(capsys, tmp_path):
    out = tmp_path / "runs"  # cli_error checks that nothing is left there
    empty, corrupt, no_runs, not_sweep = (tmp_path / n for n in ("empty", "corrupt", "no_runs", "not_sweep"))
    for folder, content in [(empty, b""), (corrupt, bytes(range(256)) * 4), (no_runs, b"run,status\n")]:
        folder.mkdir()
        (folder / "registry.csv").write_bytes(content)
    not_sweep.mkdir()
    for figure, folder in [("scaling", empty), ("scaling", corrupt), ("context", no_runs),
                           ("recall", no_runs), ("token-index", no_runs), ("minibatch", empty)]:
        err = cli_error(capsys, tmp_path, "plot", figure, str(folder), "--out", str(out))
        assert f"cannot draw {figure} from {folder}" in err
    err = cli_error(capsys, tmp_path, "plot", "scaling", str(not_sweep), "--out", str(out))
    assert "is not a sweep folder" in err


def test_ablate_data_dir_and_launcher_overrides(capsys, tmp_path):
    err = cli_error(capsys, tmp_path, "ablate", "table1", "--profile", "smoke", "--data-dir",
                    str(tmp_path / "missing"), "--out", str(tmp_path / "runs" / "sweep"))
    assert f"--data-dir {tmp_path / 'missing'} is not a folder" in err
    err = cli_error(capsys, tmp_path, "ablate", "minibatch", "--profile", "gpu", "--plan")
    assert "conf/sweep/minibatch.yaml defines no gpu profile; use one of smoke, quick, cpu" in err
    # README: launcher overrides after the options (parsed intermixed; --plan runs nothing)
    main(["ablate", "minibatch", "--profile", "smoke", "--plan", "hydra/launcher=joblib",
          "hydra.launcher.n_jobs=2"])
    assert "# CPU runs: ~" in capsys.readouterr().out


def test_ablate_scale_multiplies_every_runs_budget_and_is_part_of_its_identity(capsys, tmp_path, monkeypatch):
    import re

    from ttt_bench.experiments.engine.runner import Trained

    def tokens(*extra):
        main(["ablate", "table1", "--profile", "cpu", "--plan", *extra])
        out = capsys.readouterr().out
        return [float(t) for t in re.findall(r"\[([\d.e+]+) tokens", out)], out

    full, _ = tokens()
    tenth, out = tokens("--scale", "0.1")
    assert len(full) == len(tenth) and all(t == pytest.approx(f / 10, rel=0.02) for f, t in zip(full, tenth))
    assert "budget_scale=0.1" in out  # in every run's overrides: another run folder, never a resumed one
    err = cli_error(capsys, tmp_path, "ablate", "table1", "--plan", "--scale", "0")
    assert "--scale 0 must be a positive number" in err
    seen = {}

    def sweep(profile, out, data_dir, launcher, overrides=(), replace=False):
        seen["out"], seen["overrides"] = out, list(overrides)
        return Trained(pd.DataFrame({"status": ["finished"]}))

    from ttt_bench.experiments import EXPERIMENTS

    monkeypatch.setattr(EXPERIMENTS["minibatch"], "train", sweep)
    monkeypatch.setenv("TTT_BENCH_RUNS", str(tmp_path / "runs"))
    main(["ablate", "minibatch", "--profile", "smoke", "--scale", "0.5"])
    assert seen["overrides"] == ["budget_scale=0.5"] and seen["out"].name == "minibatch-smoke-x0.5"


def test_ablate_with_failed_runs_exits_2(capsys, tmp_path, monkeypatch):
    import pandas as pd

    from ttt_bench.experiments import EXPERIMENTS
    from ttt_bench.experiments.engine.runner import Trained

    seen = {}

    def sweep(profile, out, data_dir, launcher, overrides=(), replace=False):
        seen["launcher"], seen["overrides"] = launcher, overrides
        return Trained(pd.DataFrame({"status": ["finished", "failed"], "error": [None, "boom"]}))

    monkeypatch.setattr(EXPERIMENTS["table1"], "train", sweep)
    err = cli_error(capsys, tmp_path, "ablate", "table1", "hydra/launcher=joblib", "--profile", "smoke",
                    "--out", str(tmp_path / "sweep"), "hydra.launcher.n_jobs=2", "trainer.max_steps=2")
    assert "1 of 2 runs failed" in err and "run the same command again" in err
    assert seen["launcher"] == ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    assert seen["overrides"] == ["trainer.max_steps=2"]  # a training override: every run, not the launcher


def test_ablate_applies_training_overrides_to_every_run_or_refuses_them(capsys, tmp_path):
    """A training override reaches every run's overrides (its identity: another folder's worth of runs),
    --plan shows it, and the seed, which the sweep sets per run, is refused in one line."""
    from ttt_bench.experiments import EXPERIMENTS

    runs = EXPERIMENTS["minibatch"].plan("smoke", overrides=["trainer.max_steps=2", "size=xs"])
    assert all(r.overrides[-1] == "trainer.max_steps=2" for r in runs.values())
    assert all(r.overrides.count("size=xs") == 1 for r in runs.values())  # set again in place, not twice
    main(["ablate", "minibatch", "--profile", "smoke", "--plan", "trainer.max_steps=2"])
    out = capsys.readouterr().out
    assert out.count("trainer.max_steps=2") == len(runs)
    err = cli_error(capsys, tmp_path, "ablate", "minibatch", "--profile", "smoke", "seed=3")
    assert "seed=3: the sweep sets each run's seed" in err


# Wrong values for every subcommand: each must give one line (no traceback), a non-zero exit and no output.
# {command: (base arguments, {option: wrong values})}; option None: the value is a positional argument.
FUZZ = {
    "train": (["train", *TINY], {k: ["-1", "0", "abc", "[1"] for k in (
        "data.seq_len", "data.micro_batch_size", "recipe.lr", "data.val_tokens", "trainer.max_steps")}),
    "eval": (["eval", "ckpt_path=CKPT"], {"batch_size": ["-1", "0", "abc"], "max_tokens": ["-1", "0", "abc"],
                                          "seq_len": ["-1", "0", "abc"], "device": ["-1", "abc", "tpu"]}),
    "generate": (["generate", "CKPT", "--prompt", "a"], {
        "--max-new-tokens": ["-1", "0", "abc"], "--top-k": ["-1", "abc", "nan"],
        "--temperature": ["-1", "abc", "nan", "-inf"], "--device": ["-1", "abc", "nan"]}),
    "bench": (["bench", "scan", "--out", "OUT/scan.csv"], {k: ["-1", "0", "abc", "1.5"] for k in (
        "--batch", "--seqlen", "--d-model", "--threads", "--repeats")}),
    "bench models": (["bench", "models", "--quick", "--phases", "prefill", "--out", "OUT/m.csv"], {
        "--contexts": ["0", "64-32", "a,b"], "--decode-batch": ["0", "-1", "x"], "--size": ["xxl", "s m"]}),
    "plot": (["plot", "--out", "OUT"], {None: ["scalin OUT", "scaling OUT/none", "latency OUT/none.csv",
                                               "inner-loss", "scaling"]}),
    "ablate": (["ablate", "table1", "--out", "OUT/sweep"], {"--profile": ["abc", "-1", ""],
                                                            "--data-dir": ["abc", "-1", ""]}),
}


@pytest.mark.parametrize("command", FUZZ)
def test_fuzz_every_subcommand_with_wrong_values(capsys, tmp_path, checkpoints, command):
    import random

    rng = random.Random(command)
    out = str(tmp_path / "runs")
    base, options = FUZZ[command]
    base = [a.replace("CKPT", str(checkpoints["good"])).replace("OUT", out) for a in base]
    command = command.split()[0]
    for option, values in options.items():
        for value in rng.sample(values, 1 if command in ("train", "eval") else 2):  # Hydra apps: ~1 s each
            if option is None:
                wrong = value.replace("OUT", out).split()
            else:
                wrong = [f"{option}={value}"] if command in ("train", "eval") else [option, value]
            cli_error(capsys, tmp_path, *base, *wrong)  # one line, exit code 2, nothing under runs/


def test_a_failed_rerun_leaves_a_finished_runs_results(tmp_path, capsys):
    """A finished run whose checkpoints were pruned, run again with a checkpoint that is not there: a
    one-line error, and the earlier run's results stay (only a folder the failed command made is removed)."""
    import shutil

    args = ["train", "model=transformer", *TINY, f"paths.runs={tmp_path / 'runs'}"]
    main(args)
    (run_dir,) = (tmp_path / "runs").glob("*/*/metrics.json")
    run_dir = run_dir.parent
    shutil.rmtree(run_dir / "checkpoints")  # pruned to save disk
    kept = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(SystemExit) as e:
        main([*args, f"ckpt_path={tmp_path / 'no_such.ckpt'}"])
    assert e.value.code == 2 and "no_such.ckpt" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == kept
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "finished"


# -- issue 34 point 5: crossed inputs are checked at the boundary ------------------------------------------


def test_eval_of_a_language_model_on_images_is_one_line(capsys, tmp_path, checkpoints):
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={checkpoints['good']}", "data=synthetic_images")
    assert "holds a language model and data=synthetic_images is images" in err


def test_eval_of_an_image_classifier_on_text_is_one_line(capsys, tmp_path):
    main(["train", *TINY_IMAGE, f"paths.runs={tmp_path / 'train'}"])
    (ckpt,) = (tmp_path / "train").rglob("last.ckpt")
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={ckpt}", "data=synthetic")
    assert "holds an image classifier and data=synthetic is text" in err


@pytest.mark.parametrize("prompt", ["hello", "3 99999", "-1"])
def test_an_mqar_prompt_must_be_token_ids_of_its_vocabulary(prompt):
    from ttt_bench.data.tokenizers import MQARVocab

    with pytest.raises(UserError, match=r"space-separated token ids in \[0, 64\)"):
        MQARVocab(64).encode(prompt)
    assert MQARVocab(64).encode("3 17 5").tolist() == [3, 17, 5]


def test_a_prompt_that_is_not_utf8_is_read_as_bytes(capsys, checkpoints):
    main(["generate", str(checkpoints["good"]), "--prompt", os.fsdecode(b"\xff\xfe ab"),
          "--max-new-tokens", "2"])
    assert capsys.readouterr().out.startswith("\ufffd\ufffd ab")


def test_a_damaged_gz_idx_file_is_one_line(tmp_path):
    from ttt_bench.data.images import read_idx

    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + b"\x00" * 100)[:-12] + b"garbage-garbage")
    with pytest.raises(UserError, match="is unreadable"):
        read_idx(path, "labels")


def test_a_metrics_log_with_an_edited_header_is_one_line_on_resume(capsys, tmp_path):
    args = ["train", *TINY, "trainer.max_steps=2", "checkpoint_every_n_steps=1", "eval_every_n_steps=1",
            "trainer.enable_progress_bar=false", f"paths.runs={tmp_path}"]
    main(args)
    (run,) = [p.parent for p in tmp_path.rglob("identity.json")]
    (run / "metrics.json").unlink()  # unfinished: the same command resumes from step-1.ckpt
    (run / "checkpoints" / "last.ckpt").unlink()
    (run / "checkpoints" / "step-2.ckpt").unlink()
    text = (run / "metrics.csv").read_text()
    (run / "metrics.csv").write_text(text.replace("step", "stop", 1))
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "has no 'step' column" in err


def test_a_damaged_registry_is_a_one_line_error_naming_the_file_and_line(capsys, tmp_path):
    """Read as the plots and the report read it: a duplicated run would count as two seeds, a non-numeric
    value would drop a point, a missing column would be a KeyError."""
    committed = Path(__file__).parents[1] / "results" / "cpu" / "recall" / "registry.csv"
    good = pd.read_csv(committed)
    text = good.astype({"val_accuracy": object})
    text.loc[2, "val_accuracy"] = "0.9x"
    cases = {
        "duplicated": (pd.concat([good, good.iloc[[3]]]), f"lists run {good['run'].iloc[3]} twice (lines 5"),
        "non-numeric": (text, f"line 4 (run {good['run'].iloc[2]}): val_accuracy is '0.9x', not a number"),
        "no status": (good.drop(columns=["status"]), "has no column status"),
    }
    for name, (df, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        df.to_csv(folder / "registry.csv", index=False)
        before = (folder / "registry.csv").read_bytes()
        err = cli_error(capsys, tmp_path, "plot", "recall", str(folder), "--out", str(tmp_path / "fig"))
        assert f"registry {folder / 'registry.csv'}" in err and message in err, err
        assert (folder / "registry.csv").read_bytes() == before and not (tmp_path / "fig").exists()


@pytest.mark.parametrize("value, shell", [("/x/a,b", "\"paths.runs='/x/a,b'\""),
                                          ("/x/it's", "\"paths.runs=\\\"/x/it's\\\"\""),
                                          ("/x/ü", "\"paths.runs='/x/ü'\"")])
def test_a_path_hydra_cannot_read_unquoted_gets_a_quoting_hint_that_works(capsys, tmp_path, value, shell):
    """Commas, apostrophes and non-ASCII letters break Hydra's override grammar: the error says how to quote
    the value, and the quoted form (as the shell passes it) composes to the same path."""
    err = cli_error(capsys, tmp_path, "train", f"paths.runs={value}")
    assert f"bad override paths.runs={value}:" in err and f"write it as {shell}" in err
    quoted = shell[1:-1].replace('\\"', '"')  # what the shell hands over
    main(["train", quoted, "--cfg", "job"])
    assert f"runs: {value}" in capsys.readouterr().out


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(capsys, tmp_path):
    """The fuzz drew size.n_layers=1904028957: building it exhausted the memory of the machine."""
    err = cli_error(capsys, tmp_path, "train", *TINY, "size.n_layers=1904028957")
    assert "has about 9.58e+13 parameters" in err and "GiB of this machine; choose a smaller size" in err
    assert "ckpt_path" in cli_error(capsys, tmp_path, "eval", "ckpt_path=")


def test_optimizer_values_torch_refuses_name_the_config_key(capsys, tmp_path):
    err = cli_error(capsys, tmp_path, "train", *TINY, "recipe.optimizer.betas=[0.9,1.5]")
    assert "recipe.optimizer (betas=[0.9, 1.5]" in err and "Invalid beta parameter" in err


def test_a_damaged_run_file_is_a_one_line_error_naming_the_file_and_line(capsys, tmp_path):
    """The files a run folder holds are checked as the plots and a resume read them: a row that is not a
    number, a repeated step, an edited header."""
    from types import SimpleNamespace

    from ttt_bench.training.callbacks import LossLog

    main(["train", *TINY, "model=ttt_linear", f"paths.runs={tmp_path / 'trained'}"])
    (run,) = {p.parent for p in (tmp_path / "trained").rglob("losses.csv")}
    cases = [  # file, how it is damaged, the plot that reads it, what the error says
        ("losses.csv", lambda t: t.replace("\n2,", "\nx,"), "curves",
         "losses.csv, line 3: step is 'x', not a number; restore it"),
        ("losses.csv", lambda t: t + t.splitlines()[-1] + "\n", "curves", "has step 2 twice (lines 3 and 4)"),
        ("token_index.csv", lambda t: t.replace("token_index,", "position,", 1), "token-index",
         "token_index.csv has no column token_index (was its header edited?)"),
        ("inner_losses.csv", lambda t: t[:t.rindex(",")] + ",oops\n", "inner-loss", "now is 'oops'"),
    ]
    for name, damage, figure, message in cases:
        folder = tmp_path / f"{figure}-{message[:12]}"
        folder.mkdir()
        for f in run.iterdir():
            if f.is_file():
                (folder / f.name).write_bytes(f.read_bytes())
        (folder / name).write_text(damage((run / name).read_text()))
        err = cli_error(capsys, tmp_path, "plot", figure, str(folder), "--out", str(tmp_path / "fig"))
        assert str(folder / name) in err and message in err, err
    # a resume reads losses.csv to drop the rows after its checkpoint
    (folder := tmp_path / "resume").mkdir()
    (folder / "losses.csv").write_text("step,loss\n1,0.5\n2,0.4,\n")
    with pytest.raises(UserError, match="losses.csv is not a readable CSV"):
        trainer = SimpleNamespace(global_step=1, is_global_zero=True)
        LossLog(folder / "losses.csv").on_train_start(trainer, None)
    # `ttt-bench runs` lists many runs: a damaged one shows what is wrong and where as its status, and the
    # listing goes on (a stopped run's step comes from losses.csv, a finished run's numbers from metrics.json)
    listing = tmp_path / "listing"
    bad_losses = "step,loss\n1,0.5\nx,0.4\n"
    for name, damage in (("stopped", lambda f: f.with_name("losses.csv").write_text(bad_losses)),
                         ("finished", lambda f: f.write_text('{"val_ppl": 3.')), ("fine", lambda f: None)):
        (listing / name).mkdir(parents=True)
        for f in run.iterdir():
            if f.is_file():
                (listing / name / f.name).write_bytes(f.read_bytes())
        damage(listing / name / "metrics.json")
        if name == "stopped":
            (listing / name / "metrics.json").unlink()
    main(["runs", str(listing), "--csv"])
    table = pd.read_csv(io.StringIO(capsys.readouterr().out)).set_index("run")
    assert table.at["fine", "status"] == "finished"
    assert table.at["stopped", "status"].startswith("unreadable: ") and "losses.csv, line 3: step is 'x'" in \
        table.at["stopped", "status"]
    assert "metrics.json is not readable JSON" in table.at["finished", "status"]


# -- issue 46: reliability round 4 ------------------------------------------------------------------------


def test_a_registry_measurement_pandas_would_read_as_missing_is_a_one_line_error(capsys, tmp_path):
    """pandas reads "n/a", "NA" or "null" as NaN by default: a finished run's val_ppl so written would drop
    its point without a word. It is text, not a number: one line naming the file, the row and the column."""
    from ttt_bench.io import read_table

    committed = Path(__file__).parents[1] / "results" / "cpu" / "scaling" / "registry.csv"
    reg = pd.read_csv(committed).astype({"val_ppl": object})
    i = int(reg.index[reg["status"] == "finished"][1])
    reg.loc[i, "val_ppl"] = "n/a"
    folder = tmp_path / "sweep"
    folder.mkdir()
    reg.to_csv(folder / "registry.csv", index=False)
    err = cli_error(capsys, tmp_path, "plot", "scaling", str(folder), "--out", str(tmp_path / "fig"))
    where = f"registry {folder / 'registry.csv'}, line {i + 2} (run {reg['run'][i]})"
    assert f"{where}: val_ppl is 'n/a', not a number" in err, err
    # the run files read_table checks: "NA" is an error, nan (a skipped step's loss) and empty cells are not
    (tmp_path / "losses.csv").write_text("step,loss\n1,0.5\n2,nan\n3,\n4,NA\n")
    with pytest.raises(UserError, match=r"losses.csv, line 5: loss is 'NA', not a number"):
        read_table(tmp_path / "losses.csv", numeric=("step", "loss"))
    (tmp_path / "losses.csv").write_text("step,loss\n1,0.5\n2,nan\n3,\n")
    assert read_table(tmp_path / "losses.csv", numeric=("step", "loss"))["loss"].isna().tolist() == [
        False, True, True]


def test_a_token_cache_with_ids_outside_the_vocabulary_is_rebuilt(tmp_path, caplog):
    """A damaged cache (or one whose metadata was edited) whose ids the embedding has no row for is rebuilt
    when it is loaded, never an IndexError in the first step."""
    import logging

    import numpy as np

    from ttt_bench.data import SyntheticCorpus
    from ttt_bench.data.token_cache import cache_key
    from ttt_bench.data.tokenizers import ByteTokenizer

    corpus = SyntheticCorpus(train_docs=3, validation_docs=2, mean_doc_bytes=2000)

    def tokens():
        dm = LMDataModule(corpus, {"kind": "byte"}, seq_len=32, micro_batch_size=2, cache_dir=str(tmp_path))
        return np.array(dm.prepare_split("train")[0])

    good = tokens()
    folder = tmp_path / "tokens" / cache_key(corpus, ByteTokenizer())
    damaged = good.copy()
    damaged[7] = 300  # the byte tokenizer's vocabulary is [0, 257)
    (folder / "train.bin").write_bytes(damaged.tobytes())
    with caplog.at_level(logging.WARNING, logger="ttt_bench.data.token_cache"):
        assert np.array_equal(tokens(), good)
    assert "holds token id 300, outside the tokenizer's vocabulary [0, 257); rebuilding it" in caplog.text
    meta = json.loads((folder / "train.json").read_text())  # negative ids: a signed dtype in the metadata
    (folder / "train.json").write_text(json.dumps(meta | {"dtype": "int16"}))
    (folder / "train.bin").write_bytes(np.full(len(good), -1, np.int16).tobytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ttt_bench.data.token_cache"):
        assert np.array_equal(tokens(), good)
    assert "holds token id -1" in caplog.text


def test_a_generate_seed_torch_cannot_take_is_one_line(capsys, tmp_path, checkpoints):
    good = str(checkpoints["good"])
    for seed in (2**64, -(2**63) - 1):
        err = cli_error(capsys, tmp_path, "generate", good, "--prompt", "a", "--seed", str(seed))
        assert f"--seed {seed} is outside torch's seed range [-2**63, 2**64)" in err
    main(["generate", good, "--prompt", "a", "--seed", str(2**64 - 1), "--max-new-tokens", "2"])
    main(["generate", good, "--prompt", "a", "--seed", "-1", "--max-new-tokens", "2"])  # torch takes both


def test_evaluations_of_two_checkpoints_of_a_run_are_kept_apart(tmp_path, capsys):
    """step-1.ckpt and last.ckpt of one run, evaluated alike, get a folder each, named by the checkpoint's
    step and a fingerprint of its bytes; reuse follows the bytes, not the path or the modification time."""
    import shutil

    main(["train", *TINY, "trainer.max_steps=2", "checkpoint_every_n_steps=1", f"paths.runs={tmp_path}"])
    (last,) = tmp_path.rglob("last.ckpt")
    run, step1 = last.parent.parent, last.with_name("step-1.ckpt")
    for ckpt in (step1, last):
        main(["eval", f"ckpt_path={ckpt}", "max_tokens=256", f"paths.runs={tmp_path}"])
    found = {p.parent.name: json.loads(p.read_text()) for p in (run / "eval").glob("*/metrics.json")}
    assert len(found) == 2 and {m["ckpt_path"] for m in found.values()} == {str(step1), str(last)}
    names = sorted(found)
    assert [n.rsplit("-", 2)[0] for n in names] == ["trained-data-Ttrained-256"] * 2
    assert [n.rsplit("-", 2)[1] for n in names] == ["step1", "step2"] and all(
        len(n.rsplit("-", 1)[1]) == 12 for n in names)
    assert found[names[0]]["val_loss"] != found[names[1]]["val_loss"]
    capsys.readouterr()
    os.utime(last)  # touched, the same bytes: the same evaluation
    main(["eval", f"ckpt_path={last}", "max_tokens=256", f"paths.runs={tmp_path}"])
    assert "this eval ran before on the same checkpoint" in "".join(capsys.readouterr())
    shutil.copy(step1, last)  # step-1's bytes at last.ckpt's path: step-1's evaluation
    main(["eval", f"ckpt_path={last}", "max_tokens=256", f"paths.runs={tmp_path}"])
    assert "this eval ran before on the same checkpoint" in "".join(capsys.readouterr())
    assert sorted(p.parent.name for p in (run / "eval").glob("*/metrics.json")) == names


BENCH_FORMS = ["bench", "forms", "--d-model", "32", "--n-heads", "2", "--repeats", "1", "--no-fused"]


@pytest.mark.parametrize("options,message", [
    (["--scopes", "layer,lyer"], "--scopes layer,lyer: unknown scope 'lyer'; use layer, core or layer,core"),
    (["--quick", "--tokens", "64"], "--tokens 64 is less than one sequence of --seq-len 128"),
    (["--seq-len", "64", "--tokens", "100"],
     "--tokens 100 is not a whole number of sequences of --seq-len 64"),
    (["--seq-len", "128", "--tokens", "128", "--mini-batch-size", "48"],
     "--mini-batch-size 48 does not divide --seq-len 128 (its last 32 tokens would not be timed)"),
], ids=["scope", "tokens-quick", "tokens-multiple", "mini-batch"])
def test_bench_forms_times_what_its_row_says_or_refuses(capsys, tmp_path, options, message):
    assert message in cli_error(capsys, tmp_path, *BENCH_FORMS, *options, "--out", str(tmp_path / "f.csv"))


@pytest.mark.parametrize("run_name", ["../escaped", "a/../../escaped", "ABS"])
def test_a_run_name_cannot_put_the_run_outside_the_runs_folder(capsys, tmp_path, run_name):
    run_name = run_name.replace("ABS", str(tmp_path / "escaped"))
    err = cli_error(capsys, tmp_path, "train", *TINY, f"run_name={run_name}")
    assert f"run_name={run_name} would put the run outside paths.runs; use a plain name" in err
    assert not (tmp_path / "escaped").exists()


def test_an_empty_image_test_split_is_one_line_naming_it(capsys, tmp_path):
    from ttt_bench.data.images import ImageDataModule

    err = cli_error(capsys, tmp_path, "train", "task=image", "data=synthetic_images", "model=mttt_linear",
                    "size=xs", "data.synthetic_test=0", "data.val_examples=32")
    assert "the test split of data=synthetic_images has no images; set data.synthetic_test to a" in err
    folder = tmp_path / "fashion"  # IDX files whose test split holds no image
    folder.mkdir()
    for name, count in [("train", 40), ("t10k", 0)]:
        header = b"".join(n.to_bytes(4, "big") for n in (count, 28, 28))
        (folder / f"{name}-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + header + bytes(count * 784))
        (folder / f"{name}-labels-idx1-ubyte").write_bytes(
            b"\x00\x00\x08\x01" + count.to_bytes(4, "big") + bytes(count))
    dm = ImageDataModule(source="fashion_mnist", folder=str(folder), name="fashion_mnist", val_examples=8)
    with pytest.raises(UserError, match=f"the test split of data=fashion_mnist has no images; its IDX files "
                                        f"in {folder} hold no images"):
        dm.prepare_data()


@pytest.mark.parametrize("overrides,message", [
    (["data.train_num_kv_pairs=[2,40]"],
     "data.seq_len=64 is too short for 40 pairs (data.train_num_kv_pairs=[2, 40]) and their queries"),
    (["data.train_num_kv_pairs=[2,40]", "data.vocab_size=64"],
     "40 distinct keys (data.train_num_kv_pairs=[2, 40]) need data.vocab_size >= 82"),
    (["data.train_num_kv_pairs=[2,0]"],
     "data.train_num_kv_pairs=[2, 0], data.seq_len=64 and data.vocab_size"),
    (["data.num_kv_pairs=40", "data.vocab_size=64"],
     "40 distinct keys (data.num_kv_pairs=40) need data.vocab_size >= 82"),
], ids=["mixture-seq_len", "mixture-vocab", "mixture-zero", "validation-vocab"])
def test_mqar_pair_errors_name_the_key_that_was_set(capsys, tmp_path, overrides, message):
    base = [o for o in BASE if not o.startswith("data.num_proc")]
    err = cli_error(capsys, tmp_path, "train", *base, "data=mqar", *overrides)
    assert message in err
    assert "train_num_kv_pairs" in err or not any("train_num_kv_pairs" in o for o in overrides)


@pytest.mark.parametrize("override", ["model=mamba", "+model=mamba", "size=xs", "model.d_model=32",
                                      "trainer=gpu", "recipe=paper"])
def test_eval_refuses_what_it_takes_from_the_checkpoint(capsys, tmp_path, checkpoints, override):
    """`eval ... model=mamba` suggested +model=mamba, which then evaluated the checkpoint's own model."""
    err = cli_error(capsys, tmp_path, "eval", f"ckpt_path={checkpoints['good']}", override)
    said = f"{override}: ttt-bench eval takes the model, its size and how it was trained from the checkpoint"
    assert f"{said}; leave it out" in err and "+model" not in err.replace(override, "")
