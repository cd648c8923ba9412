"""Paper-scale data without paper-scale preprocessing (issue 33, point 5): training tokenizes only the train
shards its token budget reaches, each into a cache of its own; evaluation prepares only the validation split.

Also the measurement of docs/sharded_data.md, on a generated corpus of Pile-format shards:
    .venv/bin/python -m tests.test_shards [--shards 20] [--docs-per-shard 300] [--vocab 8192] [--folder DIR]
"""

import argparse
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import find_run, run_cli, write_shard
from ttt_bench.data import LMDataModule, LocalCorpus, SyntheticCorpus
from ttt_bench.data.datamodule import PackedSequences, ShardedSequences
from ttt_bench.data.synthetic import SyntheticLanguage, generate_document
from ttt_bench.data.token_cache import build_tokens, cache_key, cached_tokens
from ttt_bench.errors import UserError


def write_corpus(folder: Path, shards: int, docs_per_shard: int, doc_bytes: int) -> dict:
    """`shards` Pile-format train files train-NN.jsonl.zst of synthetic documents (synthetic.py) and one
    validation file of `docs_per_shard` documents; returns the data.corpus settings that read them and the
    train tokens of each shard for the byte tokenizer (each document's bytes and its EOS)."""
    folder.mkdir(parents=True, exist_ok=True)
    lang, tokens = SyntheticLanguage(seed=0), []
    for k in range(shards + 1):
        split, first = ("validation", 0) if k == shards else ("train", k * docs_per_shard)
        docs = [generate_document(lang, 0, split, first + i, doc_bytes) for i in range(docs_per_shard)]
        write_shard(folder / (f"{split}.jsonl.zst" if k == shards else f"train-{k:02d}.jsonl.zst"),
                    [{"text": d} for d in docs])
        tokens.append(sum(len(d.encode()) + 1 for d in docs))
    corpus = {"train_files": str(folder / "train-*.jsonl.zst"),
              "validation_files": str(folder / "validation.jsonl.zst")}
    return {"corpus": corpus, "shard_tokens": tokens[:-1]}


def datamodule(corpus, cache_dir: Path, train_tokens: int | None = None, seq_len: int = 64, num_proc: int = 1,
               tokenizer: dict | None = None) -> LMDataModule:
    dm = LMDataModule(corpus, tokenizer or {"kind": "byte"}, seq_len=seq_len, micro_batch_size=1,
                      cache_dir=str(cache_dir), num_proc=num_proc)
    dm.train_tokens = train_tokens  # as the trainer set-up does
    return dm


def cached(cache_dir: Path, split: str) -> list[Path]:
    """The complete caches of a split (their metadata is written last)."""
    return sorted((Path(cache_dir) / "tokens").glob(f"*/{split}.json"))


def shards_needed(shard_tokens: list[int], budget: int) -> int:
    return int(np.searchsorted(np.cumsum(shard_tokens), budget, side="right")) + 1


@pytest.fixture(scope="module")
def corpus20(tmp_path_factory) -> dict:
    return write_corpus(tmp_path_factory.mktemp("shards"), shards=20, docs_per_shard=4, doc_bytes=600)


def test_training_caches_only_the_shards_its_budget_reaches(corpus20, tmp_path):
    corpus, per_shard = LocalCorpus(**corpus20["corpus"]), corpus20["shard_tokens"]
    budget = per_shard[0] + per_shard[1] // 2
    dm = datamodule(corpus, tmp_path, budget)
    dm.prepare_data()
    assert shards_needed(per_shard, budget) == 2
    assert len(cached(tmp_path, "train")) == 2 and len(cached(tmp_path, "validation")) == 1
    assert dm.meta["train"]["n_tokens"] == sum(per_shard[:2]) and dm.meta["train"]["n_documents"] == 8
    assert len(dm.train_dataset()) == (sum(per_shard[:2]) - 1) // 64

    first = {p: p.stat().st_mtime_ns for p in cached(tmp_path, "train")}
    more = datamodule(corpus, tmp_path, sum(per_shard[:4]) - 1)
    more.prepare_data()
    assert len(cached(tmp_path, "train")) == 4  # two more shards, the first two read from their caches
    assert all(p.stat().st_mtime_ns == t for p, t in first.items())
    assert np.array_equal(more.tokens["train"][: sum(per_shard[:2])], dm.tokens["train"])
    assert not list(tmp_path.rglob("*.tmp"))


def test_sharded_train_stream_is_the_flat_stream(tmp_path):
    """Shards joined are the stream one cache of the whole split holds (as before shards): one file or
    several, a validation file or a hashed hold-out, max_documents; fileless corpora are one cache."""
    docs = [{"text": f"document {i} " * (1 + i % 7)} for i in range(120)]
    files = [write_shard(tmp_path / f"part-{k}.jsonl.zst", docs[k * 30 : (k + 1) * 30]) for k in range(4)]
    corpora = {  # name: (corpus, train caches)
        "one file, held out": (LocalCorpus(train_files=files[0], val_fraction=0.2), 1),
        "four files, held out": (LocalCorpus(train_files=str(tmp_path / "part-*"), val_fraction=0.2), 4),
        "70 documents of 4 files": (LocalCorpus(train_files=files, validation_files=files[0],
                                                 max_documents=70), 3),
        "synthetic": (SyntheticCorpus(train_docs=3, validation_docs=1, mean_doc_bytes=2000), 1),
    }
    for name, (corpus, caches) in corpora.items():
        dm = datamodule(corpus, tmp_path / "cache", seq_len=8)
        tok = dm.build_tokenizer()
        for split in ("train", "validation"):
            flat, meta = build_tokens(corpus, tok, split, tmp_path / "flat", cache_key(corpus, tok))
            assert np.array_equal(dm.tokens[split], flat), (name, split)
            assert {k: dm.meta[split][k] for k in ("n_tokens", "n_bytes", "n_documents")} == {
                k: meta[k] for k in ("n_tokens", "n_bytes", "n_documents")}, (name, split)
        expected = PackedSequences(np.asarray(dm.tokens["train"]), 8)
        sharded = dm.train_dataset()
        assert len(dm.shards["train"]) == caches, name
        assert len(sharded) == len(expected) and all(
            torch.equal(sharded[i], expected[i]) for i in range(len(expected))), name

    held_out = corpora["four files, held out"][0]  # with a budget: the first train file; validation reads all
    dm = datamodule(held_out, tmp_path / "cache", train_tokens=1, seq_len=8)
    whole = datamodule(held_out, tmp_path / "cache", seq_len=8)
    dm.prepare_data()
    first = dm.tokens["train"]
    assert len(dm.shards["train"]) == 1 and np.array_equal(first, whole.tokens["train"][: len(first)])
    assert np.array_equal(dm.tokens["validation"], whole.tokens["validation"])


def test_sequences_span_shard_boundaries():
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 257, n).astype(np.uint16) for n in (5, 0, 3, 17, 1, 9, 40)]
    for seq_len in (1, 2, 4, 7, 30):
        flat = PackedSequences(np.concatenate(shards), seq_len)
        ds = ShardedSequences(shards, seq_len)
        assert len(ds) == len(flat) and all(torch.equal(ds[i], flat[i]) for i in range(len(flat)))


def test_a_shard_without_documents_is_skipped_and_an_empty_split_is_an_error(tmp_path):
    books = [{"text": "a book " * 20, "meta": {"pile_set_name": "Books3"}}] * 3
    code = [{"text": "some code " * 20, "meta": {"pile_set_name": "Github"}}] * 3
    files = [write_shard(tmp_path / "a.jsonl.zst", code), write_shard(tmp_path / "b.jsonl.zst", books)]
    dm = datamodule(LocalCorpus(train_files=files, validation_files=files[1], pile_set_names=["Books3"]),
                    tmp_path / "c")
    assert len(dm.train_dataset()) == (3 * 141 - 1) // 64  # 3 books of 140 bytes, each with its EOS
    assert dm.meta["train"]["read_stats"]["filtered_out"] == 3
    dm = datamodule(LocalCorpus(train_files=files[0], validation_files=files[1], pile_set_names=["Books3"]),
                    tmp_path / "c")
    with pytest.raises(UserError, match="the corpus has no documents in its 'train' split"):
        dm.prepare_data()


def test_train_tokenizes_the_shards_of_its_budget_and_eval_only_validation(corpus20, tmp_path, monkeypatch):
    """`ttt-bench train` passes its token budget (max_steps x tokens per step) to the data; `ttt-bench eval`
    of the run tokenizes no training data."""
    monkeypatch.setenv("TTT_BENCH_RUNS", str(tmp_path / "runs"))
    data = ["data=pile", f"data.corpus.train_files={corpus20['corpus']['train_files']}",
            f"data.corpus.validation_files={corpus20['corpus']['validation_files']}", "data.seq_len=64",
            "data.num_proc=1", "data.val_tokens=512"]
    steps, tokens_per_step = 12, 256
    run_cli("train", "size=xs", *data, "data.micro_batch_size=4", f"trainer.max_steps={steps}",
            f"recipe.tokens_per_batch={tokens_per_step}", "eval_every_n_steps=100",
            "trainer.enable_progress_bar=false", f"data.cache_dir={tmp_path / 'train-cache'}")
    needed = shards_needed(corpus20["shard_tokens"], steps * tokens_per_step)
    assert 1 < needed < 20 and len(cached(tmp_path / "train-cache", "train")) == needed

    run = find_run(str(tmp_path / "runs"), "transformer-xs-pile")
    run_cli("eval", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", *data, "max_tokens=512",
            f"data.cache_dir={tmp_path / 'eval-cache'}", f"paths.runs={tmp_path / 'runs'}")
    assert not cached(tmp_path / "eval-cache", "train")
    assert len(cached(tmp_path / "eval-cache", "validation")) == 1


# -- the measurement of docs/sharded_data.md ----------------------------------------------------------------


def flat_prepare(dm: LMDataModule) -> None:
    """What prepare_data did before shards: one cache of each whole split."""
    for split in ("train", "validation"):
        cached_tokens(dm.corpus, dm.build_tokenizer(), split, dm.cache_dir, dm.num_proc)


def time_preparation(make_dm, prepare) -> dict:
    """`prepare` (LMDataModule.prepare_data or flat_prepare) of `make_dm()`'s data from an empty token cache,
    then from the cache it left (the tokenizer is trained before, untimed): seconds, train caches, bytes, and
    the tokens of each train shard prepared."""
    cache = make_dm().cache_dir
    shutil.rmtree(cache / "tokens", ignore_errors=True)
    seconds = []
    for _ in range(2):
        dm = make_dm()
        dm.build_tokenizer()
        start = time.perf_counter()
        prepare(dm)
        seconds.append(time.perf_counter() - start)
    return {"caches": len(cached(cache, "train")), "fresh_s": seconds[0], "cached_s": seconds[1],
            "mb": sum(p.stat().st_size for p in (cache / "tokens").rglob("*") if p.is_file()) / 1e6,
            "shard_tokens": [len(a) for a in dm.shards.get("train", [])]}


def measure(folder: Path, shards: int, docs_per_shard: int, doc_bytes: int, num_proc: int, vocab: int) -> str:
    """A markdown table: preparing the data of a run whose budget needs 2 of the shards, against tokenizing
    all of them (sharded, and as one cache of the whole split, as before shards); vocab: 0 for the byte
    tokenizer, else a BPE of that many tokens."""
    corpus = LocalCorpus(**write_corpus(folder / "corpus", shards, docs_per_shard, doc_bytes)["corpus"])
    tokenizer = {"kind": "bpe", "vocab_size": vocab} if vocab else {"kind": "byte"}

    def make_dm(budget=None):
        return datamodule(corpus, folder / "cache", budget, 2048, num_proc, tokenizer)

    every = time_preparation(make_dm, LMDataModule.prepare_data)
    flat = time_preparation(make_dm, flat_prepare)
    per_shard = every["shard_tokens"]
    budget = per_shard[0] + per_shard[1] // 2
    two = time_preparation(lambda: make_dm(budget), LMDataModule.prepare_data)
    rows = {f"a budget of {budget:,} tokens: 2 shards": two, f"no budget: all {shards} shards": every,
            "before: one cache of the whole split": flat}
    shard_mb = np.mean([f.stat().st_size for f in (folder / "corpus").glob("train-*")]) / 1e6
    return "\n".join([
        f"{shards} train shards of {docs_per_shard} synthetic documents of ~{doc_bytes} bytes "
        f"({shard_mb:.2f} MB .jsonl.zst, {np.mean(per_shard) / 1e6:.2f}M tokens each), tokenizer "
        f"{tokenizer}, data.num_proc={num_proc}, {platform.machine()} with {os.cpu_count()} CPU cores", "",
        "| train split | train caches | prepare_data, empty cache (s) | again, cached (s) | cache (MB) |",
        "|---|---|---|---|---|",
        *(f"| {name} | {r['caches']} | {r['fresh_s']:.1f} | {r['cached_s']:.2f} | {r['mb']:.1f} |"
          for name, r in rows.items())])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=measure.__doc__)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ttt-bench-shards"))
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--docs-per-shard", type=int, default=300)
    parser.add_argument("--doc-bytes", type=int, default=24_000)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=0, help="0: the byte tokenizer; else a BPE of this size")
    args = parser.parse_args()
    print(measure(args.folder, args.shards, args.docs_per_shard, args.doc_bytes, args.num_proc, args.vocab))
