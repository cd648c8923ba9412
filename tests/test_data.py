import gzip
import json
import os
import time

import numpy as np
import pytest
import zstandard

from tests.helpers import write_shard
from ttt_bench.data import LMDataModule, LocalCorpus, SyntheticCorpus
from ttt_bench.data.datamodule import PackedSequences
from ttt_bench.data.loaders import EpochShuffleSampler
from ttt_bench.data.synthetic import SyntheticLanguage, generate_document
from ttt_bench.data.tokenizers import ByteTokenizer, from_spec
from ttt_bench.errors import UserError


def test_synthetic_is_deterministic_fast_and_long_range():
    lang = SyntheticLanguage(seed=0)
    a = generate_document(lang, 0, "train", 3)
    assert a == generate_document(SyntheticLanguage(seed=0), 0, "train", 3)
    assert a != generate_document(lang, 0, "validation", 3)
    start = time.perf_counter()
    n = sum(len(generate_document(lang, 0, "train", i)) for i in range(60))
    assert n / (time.perf_counter() - start) > 5e6  # >= 10 MB/s on an idle core; loose bound for noisy CI
    # long-range structure: facts about document-specific entities recur far apart
    facts = [s for s in a.split(". ") if "holds the code" in s]
    assert len(facts) > len(set(facts)) > 0


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "héllo, wörld"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 256 and tok.vocab_size == 257


def test_packing_puts_eos_between_documents_and_covers_every_token(tmp_path):
    shard = write_shard(tmp_path / "t.jsonl.zst", [{"text": "abc"}, {"text": "defg"}])
    dm = LMDataModule(
        LocalCorpus(train_files=shard, validation_files=shard),
        {"kind": "byte"},
        seq_len=3,
        micro_batch_size=1,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.prepare_data()
    tokens = np.asarray(dm.tokens["train"])
    assert tokens.tolist() == [97, 98, 99, 256, 100, 101, 102, 103, 256]
    ds = PackedSequences(tokens, seq_len=3)
    assert len(ds) == 2
    # windows of L+1 overlap by one token, so each token is a target exactly once
    assert ds[0].tolist() == [97, 98, 99, 256] and ds[1].tolist() == [256, 100, 101, 102]


def test_validation_takes_the_configured_tokens_or_the_whole_split(tmp_path):
    """Training evaluates on data.val_tokens; `ttt-bench eval max_tokens=null` (None) on the whole split."""
    shard = write_shard(tmp_path / "t.jsonl.zst", [{"text": "x" * 400}, {"text": "y" * 400}])
    dm = LMDataModule(LocalCorpus(train_files=shard, validation_files=shard), {"kind": "byte"}, seq_len=16,
                      micro_batch_size=1, cache_dir=str(tmp_path / "cache"), val_tokens=64)
    dm.prepare_data()
    assert len(dm.val_dataset()) == 4 and len(dm.val_dataset(32)) == 2
    assert len(dm.val_dataset(None)) == len(PackedSequences(np.asarray(dm.tokens["validation"]), 16)) > 4


def test_token_cache_is_reused_and_keyed_by_tokenizer(tmp_path):
    corpus = SyntheticCorpus(train_docs=3, validation_docs=1, mean_doc_bytes=2000)
    dm = LMDataModule(corpus, {"kind": "byte"}, seq_len=32, micro_batch_size=2, cache_dir=str(tmp_path))
    dm.prepare_data()
    folders = list((tmp_path / "tokens").iterdir())
    mtime = (folders[0] / "train.bin").stat().st_mtime_ns
    dm2 = LMDataModule(corpus, {"kind": "byte"}, seq_len=32, micro_batch_size=2, cache_dir=str(tmp_path))
    dm2.prepare_data()
    assert (folders[0] / "train.bin").stat().st_mtime_ns == mtime  # read from cache, not rebuilt
    np.testing.assert_array_equal(dm.tokens["train"], dm2.tokens["train"])
    dm3 = LMDataModule(
        corpus, {"kind": "bpe", "vocab_size": 300}, seq_len=32, micro_batch_size=2, cache_dir=str(tmp_path)
    )
    dm3.prepare_data()
    assert len(list((tmp_path / "tokens").iterdir())) == 2  # another tokenizer, another cache
    assert dm3.vocab_size == 300 and len(dm3.tokens["train"]) < len(dm.tokens["train"])
    tok = from_spec(dm3.build_tokenizer().spec)  # the spec (saved in checkpoints) rebuilds the same BPE
    text = "Zepibi holds the code 1350-5789."
    assert tok.decode(tok.encode(text)) == text


def test_train_and_validation_are_disjoint(tmp_path):
    docs = [{"text": f"document number {i} " * 5} for i in range(400)]
    shard = write_shard(tmp_path / "all.jsonl.zst", docs)
    corpus = LocalCorpus(train_files=shard, val_fraction=0.1)
    train, val = list(corpus.documents("train")), list(corpus.documents("validation"))
    assert set(train).isdisjoint(val) and len(train) + len(val) == 400 and 20 <= len(val) <= 70
    assert val == list(corpus.documents("validation"))  # deterministic


def test_pile_format_filter_bad_lines_and_non_utf8(tmp_path):
    shard = write_shard(
        tmp_path / "p.jsonl.zst",
        [
            {"text": "a book", "meta": {"pile_set_name": "Books3"}},
            {"text": "some code", "meta": {"pile_set_name": "Github"}},
            b"{not json",
            {"meta": {"pile_set_name": "Books3"}},
            b'{"text": "caf\xe9 latin-1", "meta": {"pile_set_name": "Books3"}}',
        ],
    )
    from ttt_bench.data.corpora import ReadStats

    stats = ReadStats()
    docs = list(
        LocalCorpus(train_files=shard, validation_files=shard, pile_set_names=["Books3"]).documents(
            "train", stats
        )
    )
    assert docs == ["a book", "caf\ufffd latin-1"]
    assert (stats.filtered_out, stats.bad_lines, stats.missing_text, stats.non_utf8_documents) == (1, 1, 1, 1)
    with pytest.raises(UserError, match="not a JSON object"):
        list(LocalCorpus(train_files=shard, validation_files=shard, on_bad_line="error").documents("train"))


def test_missing_files_and_too_small_corpus_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="no files match"):
        LocalCorpus(train_files=str(tmp_path / "nothing*.jsonl.zst")).fingerprint()
    shard = write_shard(tmp_path / "small.jsonl.zst", [{"text": "tiny"}])
    dm = LMDataModule(
        LocalCorpus(train_files=shard, validation_files=shard),
        {"kind": "byte"},
        seq_len=64,
        micro_batch_size=1,
        cache_dir=str(tmp_path / "c"),
    )
    with pytest.raises(UserError, match="fewer than one sequence"):
        dm.prepare_data()


DOCS = [{"text": f"document {i} " * 40} for i in range(300)]


def damaged_shards(tmp_path) -> dict:
    """Shards damaged the ways downloads are: cut mid-stream, gzip or plain text under a .zst name, empty."""
    data = b"".join(json.dumps(d).encode() + b"\n" for d in DOCS)
    whole = zstandard.ZstdCompressor().compress(data)
    shards = {"truncated": whole[: len(whole) // 2], "cut_after_a_frame": whole + whole[:-5],
              "gzip": gzip.compress(data), "plain_text": data, "empty": b""}
    for name, content in shards.items():
        (tmp_path / f"{name}.jsonl.zst").write_bytes(content)
    return {name: str(tmp_path / f"{name}.jsonl.zst") for name in shards}


@pytest.mark.parametrize("on_bad_line", ["skip", "error"])
def test_damaged_zstd_shards_are_errors_naming_the_file(tmp_path, on_bad_line):
    for name, path in damaged_shards(tmp_path).items():
        message = "is not a valid zstd file" if name in ("gzip", "plain_text") else "is truncated or empty"
        with pytest.raises(UserError, match=message) as e:
            corpus = LocalCorpus(train_files=path, validation_files=path, on_bad_line=on_bad_line)
            list(corpus.documents("train"))
        assert path in str(e.value) and "re-download" in str(e.value) and "\n" not in str(e.value), name
    # several frames, and lines across chunk boundaries, read whole
    data = b"".join(json.dumps(d).encode() + b"\n" for d in DOCS)
    frames = zstandard.ZstdCompressor().compress(data) * 2
    (tmp_path / "frames.jsonl.zst").write_bytes(frames)
    assert len(list(LocalCorpus(train_files=str(tmp_path / "frames.jsonl.zst")).documents("train"))) > 500


def test_unreadable_file_in_a_glob_is_an_error_naming_it(tmp_path, monkeypatch):
    write_shard(tmp_path / "a.jsonl.zst", DOCS[:3])
    bad = write_shard(tmp_path / "b.jsonl.zst", DOCS[:3])
    os.chmod(bad, 0)
    if os.access(bad, os.R_OK):  # root reads anything: make the open fail as it would for a user
        from ttt_bench.data import corpora

        def deny(path, *args, **kwargs):
            if path == bad:
                raise PermissionError(13, "Permission denied", path)
            return open(path, *args, **kwargs)

        monkeypatch.setattr(corpora, "open", deny, raising=False)
    with pytest.raises(UserError, match=f"cannot read {bad} \\(Permission denied\\); fix its permissions"):
        list(LocalCorpus(train_files=str(tmp_path / "*.jsonl.zst")).documents("train"))


def test_skipped_lines_are_reported_as_a_warning(tmp_path, caplog):
    shard = write_shard(tmp_path / "s.jsonl.zst", [DOCS[0], b"{broken", {"txt": 1}, DOCS[1]])
    dm = LMDataModule(LocalCorpus(train_files=shard, validation_files=shard), {"kind": "byte"}, seq_len=16,
                      micro_batch_size=1, cache_dir=str(tmp_path / "c"))
    with caplog.at_level("WARNING", logger="ttt_bench.data.token_cache"):
        dm.prepare_data()
    assert "2 documents read" in caplog.text and "1 unreadable lines, 1 without 'text'" in caplog.text
    assert not list((tmp_path / "c").rglob("*.tmp"))


def test_sampler_resumes_mid_stream_and_splits_ranks():
    full = EpochShuffleSampler(10, seed=1)
    stream = [i for _, i in zip(range(35), full)]
    assert sorted(stream[:10]) == list(range(10)) and stream[:10] != stream[10:20]
    resumed = [i for _, i in zip(range(12), EpochShuffleSampler(10, seed=1, start=23))]
    assert resumed == stream[23:35]
    r0 = [i for _, i in zip(range(5), EpochShuffleSampler(10, seed=1, rank=0, world_size=2))]
    r1 = [i for _, i in zip(range(5), EpochShuffleSampler(10, seed=1, rank=1, world_size=2))]
    assert r0 == stream[0:10:2] and r1 == stream[1:10:2]


def test_real_pile_mini_reads(shared_data, tmp_path):
    corpus = LocalCorpus(
        train_files=str(shared_data / "pile-mini" / "train.jsonl.zst"),
        max_documents=20,
        pile_set_names=["Github"],
    )
    docs = list(corpus.documents("train"))
    assert len(docs) == 20 and all(isinstance(d, str) and d for d in docs)


def test_corpus_fingerprint_follows_content_not_file_times(tmp_path):
    """A corpus copied to a new place or re-provisioned (new mtimes) keeps its token cache and run folders;
    a truncated shard (an interrupted download) or a changed tail does not."""
    import os
    import shutil

    from ttt_bench.data.corpora import file_fingerprint

    big = tmp_path / "big.jsonl"
    big.write_bytes(os.urandom(3 << 20))
    copy = tmp_path / "copy.jsonl"
    shutil.copy(big, copy)
    os.utime(copy, (0, 0))
    assert file_fingerprint(str(copy)) == file_fingerprint(str(big))
    with open(copy, "r+b") as f:
        f.truncate((3 << 20) - 1)
    assert file_fingerprint(str(copy)) != file_fingerprint(str(big))
    shutil.copy(big, copy)
    with open(copy, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\0" if big.read_bytes()[-1:] != b"\0" else b"\1")
    assert file_fingerprint(str(copy)) != file_fingerprint(str(big))
    before = LocalCorpus(train_files=str(big)).fingerprint()
    os.utime(big, (0, 0))  # touched, as a fresh checkout of the data would be
    assert LocalCorpus(train_files=str(big)).fingerprint() == before
