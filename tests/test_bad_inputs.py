"""Bad inputs: each gives one line saying what is wrong and how to fix it, exit code 2, and leaves no
half-written output folder. Run through the CLI in-process."""

import json

import pytest
import torch
import zstandard
from omegaconf import OmegaConf
from ttt_bench.cli.main import main

from ttt_bench.config import compose
from ttt_bench.data import LMDataModule, LocalCorpus
from ttt_bench.data.corpora import ReadStats
from ttt_bench.training.module import LitLM

BASE = ["size=xs", "data.seq_len=64", "data.micro_batch_size=4", "recipe.tokens_per_batch=256",
        "data.num_proc=1", "trainer.max_steps=2", "trainer.enable_progress_bar=false"]
TINY = [*BASE, "data.corpus.train_docs=6", "data.corpus.validation_docs=2", "data.corpus.mean_doc_bytes=2000"]


def cli_error(capsys, tmp_path, *argv: str) -> str:
    """Run `ttt-bench argv` with outputs under tmp_path; return its one-line error."""
    with pytest.raises(SystemExit) as e:
        main([*argv, f"paths.runs={tmp_path / 'runs'}"] if argv[0] in ("train", "eval") else list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ttt-bench: error: "), err
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "output folder left behind"
    return err


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
