"""Tokenize a corpus with `datasets.map` and cache it as memory-mapped token arrays.

Documents are tokenized (batched, multi-process), each followed by EOS, and concatenated. A split is one
cache, except the train split of a `LocalCorpus`, which is one cache per train file (a `Shard`) so that a run
tokenizes only the files its token budget reaches, in file order (`split_tokens`): a Pile run of 2.5B tokens
starts after the few shards that hold them, not after all 30. A cache lives in `<cache_dir>/tokens/<key>/`
with key = (fingerprint of the corpus or of the shard, tokenizer, format version), so a second run, or
another rank, starts in seconds and a cache of other documents or another tokenizer is never read. The
array is written to a temporary file and renamed; `<split>.json` is written last, so a cache that was
killed during preparation has no valid metadata and is rebuilt.
"""

import json
import logging
import tempfile
from collections import Counter
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..io import atomic_file, chained_os_error, write_atomic
from .corpora import LocalCorpus, ReadStats, Shard
from .tokenizers import fingerprint, from_spec

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@lru_cache(maxsize=4)
def _tokenizer(spec_json: str):
    return from_spec(json.loads(spec_json))


def _tokenize_batch(batch: dict, spec_json: str) -> dict:
    tok = _tokenizer(spec_json)
    texts = batch["text"]
    ids = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in texts]
    return {"ids": ids, "n_bytes": [len(t.encode("utf-8")) for t in texts]}


def _documents(corpus, split: str, stats: ReadStats):
    for text in corpus.documents(split, stats):
        yield {"text": text}


def dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def cache_key(corpus, tokenizer) -> str:
    """The key of `corpus`' caches (a corpus or a `Shard`) with `tokenizer`."""
    return fingerprint({"corpus": corpus.fingerprint(), "tokenizer": fingerprint(tokenizer.spec),
                        "format": FORMAT_VERSION})


def _open(path: Path, dtype, n_tokens: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r") if n_tokens else np.zeros(0, dtype)  # mmap refuses 0 bytes


def load_tokens(cache_dir: Path, key: str, split: str) -> tuple[np.ndarray, dict] | None:
    """The cached token array and its metadata, or None if absent, partial or inconsistent."""
    folder = Path(cache_dir) / "tokens" / key
    meta_path, bin_path = folder / f"{split}.json", folder / f"{split}.bin"
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        if meta.get("format") != FORMAT_VERSION or meta.get("key") != key:
            return None
        if bin_path.stat().st_size != meta["n_tokens"] * dtype.itemsize:
            log.warning("token cache %s is truncated; rebuilding it", bin_path)
            return None
    except (OSError, ValueError, KeyError):
        return None
    return _open(bin_path, dtype, meta["n_tokens"]), meta


def _token_batches(corpus, tokenizer, split: str, num_proc: int, hf_cache: str, stats: ReadStats):
    """The split's documents tokenized, in batches of {"ids", "n_bytes"}; none when it has no documents."""
    import datasets

    try:
        docs = datasets.Dataset.from_generator(
            _documents, cache_dir=hf_cache, gen_kwargs={"corpus": corpus, "split": split, "stats": stats})
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, UserError):  # e.g. a bad line with data.corpus.on_bad_line=error
            raise e.__cause__ from None
        if failed := chained_os_error(e):  # a full disk under the cache: the OSError, not datasets' wrapper
            raise failed from None
        if stats.documents:
            raise
        return  # datasets cannot build an empty dataset
    spec_json = json.dumps(tokenizer.spec, sort_keys=True)
    tokenized = docs.map(_tokenize_batch, batched=True, batch_size=64, fn_kwargs={"spec_json": spec_json},
                         remove_columns=["text"], desc=f"tokenizing {split}",
                         num_proc=num_proc if num_proc > 1 and len(docs) >= 2 * num_proc else None)
    yield from tokenized.with_format("numpy").iter(batch_size=256)


def build_tokens(corpus, tokenizer, split: str, cache_dir: Path, key: str,
                 num_proc: int = 1) -> tuple[np.ndarray, dict]:
    """Tokenize `corpus`' split into the cache `key` (a split without documents: an empty array)."""
    import datasets

    folder = Path(cache_dir) / "tokens" / key
    folder.mkdir(parents=True, exist_ok=True)
    stats = ReadStats()
    datasets.disable_progress_bars()
    dtype = dtype_for(tokenizer.vocab_size)
    n_tokens = n_bytes = 0
    with tempfile.TemporaryDirectory(dir=folder) as hf_cache:
        with atomic_file(folder / f"{split}.bin") as out:  # a full disk leaves no partial array behind
            for batch in _token_batches(corpus, tokenizer, split, num_proc, hf_cache, stats):
                for ids in batch["ids"]:
                    out.write(np.append(ids, tokenizer.eos_id).astype(dtype).tobytes())
                    n_tokens += len(ids) + 1
                n_bytes += int(np.sum(batch["n_bytes"]))
    meta = {"format": FORMAT_VERSION, "key": key, "split": split, "dtype": np.dtype(dtype).name,
            "n_tokens": n_tokens, "n_bytes": n_bytes, "n_documents": stats.documents,
            "read_stats": asdict(stats), "tokenizer": tokenizer.spec.get("kind")}
    write_atomic(folder / f"{split}.json", json.dumps(meta, indent=1))  # last: it marks the cache complete
    skipped = stats.bad_lines + stats.missing_text  # on_bad_line=skip: counted and reported, never silent
    (log.warning if skipped else log.info)("tokenized %s: %d tokens (%s)", split, n_tokens, stats.report())
    return _open(folder / f"{split}.bin", dtype, n_tokens), meta


def _ids_outside(array: np.ndarray, vocab_size: int) -> int | None:
    """A token id of `array` that the tokenizer's vocabulary [0, vocab_size) has no embedding for (a damaged
    cache, or one whose metadata was edited), or None when every id is in range."""
    if not array.size:
        return None
    high = int(array.max())
    low = int(array.min()) if array.dtype.kind == "i" else 0  # unsigned (as written): never negative
    return high if high >= vocab_size else low if low < 0 else None


def cached_tokens(corpus, tokenizer, split: str, cache_dir: Path,
                  num_proc: int = 1) -> tuple[np.ndarray, dict]:
    """`corpus`' split from its cache, built first when there is no valid one (none, partial, or holding
    ids outside the tokenizer's vocabulary, which the embedding would fail on)."""
    key = cache_key(corpus, tokenizer)
    loaded = load_tokens(cache_dir, key, split)
    if loaded is not None and (bad := _ids_outside(loaded[0], tokenizer.vocab_size)) is not None:
        log.warning("token cache %s/%s holds token id %s, outside the tokenizer's vocabulary [0, %d); "
                    "rebuilding it", key, split, bad, tokenizer.vocab_size)
        loaded = None
    if loaded is None:
        log.info("building token cache %s/%s under %s", key, split, cache_dir)
        loaded = build_tokens(corpus, tokenizer, split, cache_dir, key, num_proc)
    return loaded


def split_tokens(corpus, tokenizer, split: str, cache_dir: Path, num_proc: int = 1,
                 budget: int | None = None) -> tuple[list[np.ndarray], dict]:
    """A split's token arrays in stream order, and its metadata summed over them (n_tokens, n_bytes,
    n_documents, read_stats). A LocalCorpus' train split: one cache per train file, in file order, until
    they hold more than `budget` tokens (None: every file); the files past it are never read. Joined, the
    arrays are (the start of) the stream one cache of the whole split holds. Any other split: one cache."""
    if split == "train" and isinstance(corpus, LocalCorpus):
        parts = _train_shards(corpus, tokenizer, cache_dir, num_proc, budget)
    else:
        parts = [cached_tokens(corpus, tokenizer, split, cache_dir, num_proc)]
    stats = Counter()
    for _, meta in parts:
        stats.update(meta["read_stats"])
    meta = {"split": split, "read_stats": dict(stats), "caches": [m["key"] for _, m in parts],
            **{n: sum(m[n] for _, m in parts) for n in ("n_tokens", "n_bytes", "n_documents")}}
    if not meta["n_documents"]:
        raise UserError(f"the corpus has no documents in its '{split}' split "
                        f"({ReadStats(**meta['read_stats']).report()}); check data.corpus paths and filters")
    return [array for array, _ in parts], meta


def _train_shards(corpus: LocalCorpus, tokenizer, cache_dir: Path, num_proc: int,
                  budget: int | None) -> list[tuple[np.ndarray, dict]]:
    files, cap = corpus.files("train"), corpus.max_documents
    parts, first_index, kept, n_tokens = [], 0, 0, 0
    for path in files:
        if (budget is not None and n_tokens > budget) or (cap and kept >= cap):
            break
        shard = Shard(corpus, path, first_index, cap - kept if cap else None)
        array, meta = cached_tokens(shard, tokenizer, "train", cache_dir, num_proc)
        stats = meta["read_stats"]
        first_index, kept = first_index + stats["documents"] + stats["held_out"], kept + stats["documents"]
        n_tokens += meta["n_tokens"]
        parts.append((array, meta))
    log.info("train split: %d of %d files, %d tokens%s", len(parts), len(files), n_tokens,
             "" if budget is None else f" for a budget of {budget}")
    return parts
