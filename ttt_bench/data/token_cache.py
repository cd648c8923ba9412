"""Tokenize a corpus split once with `datasets.map` and cache it as one flat memory-mapped array.

Documents are tokenized (batched, multi-process), each followed by EOS, and concatenated. The cache
lives in `<cache_dir>/tokens/<key>/` with key = (corpus fingerprint, tokenizer, format version), so a
second run starts in seconds and a cache of another corpus or tokenizer is never read. The array is
written to a temporary file and renamed; `<split>.json` is written last, so a cache that was killed
during preparation has no valid metadata and is rebuilt.
"""

import json
import logging
import tempfile
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..io import atomic_file, write_atomic
from .corpora import ReadStats
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
    return fingerprint({"corpus": corpus.fingerprint(), "tokenizer": fingerprint(tokenizer.spec),
                        "format": FORMAT_VERSION})


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
    return np.memmap(bin_path, dtype=dtype, mode="r"), meta


def build_tokens(corpus, tokenizer, split: str, cache_dir: Path, key: str,
                 num_proc: int = 1) -> tuple[np.ndarray, dict]:
    import datasets

    folder = Path(cache_dir) / "tokens" / key
    folder.mkdir(parents=True, exist_ok=True)
    stats = ReadStats()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(dir=folder) as hf_cache:
        try:
            docs = datasets.Dataset.from_generator(
                _documents, cache_dir=hf_cache, gen_kwargs={"corpus": corpus, "split": split, "stats": stats})
        except datasets.exceptions.DatasetGenerationError as e:
            if isinstance(e.__cause__, UserError):  # e.g. a bad line with data.corpus.on_bad_line=error
                raise e.__cause__ from None
            if stats.documents:
                raise
            docs = None  # datasets cannot build an empty dataset
        if not docs:
            raise UserError(f"the corpus has no documents in its '{split}' split ({stats.report()}); "
                            "check data.corpus paths and filters")
        spec_json = json.dumps(tokenizer.spec, sort_keys=True)
        tokenized = docs.map(_tokenize_batch, batched=True, batch_size=64, fn_kwargs={"spec_json": spec_json},
                             remove_columns=["text"], desc=f"tokenizing {split}",
                             num_proc=num_proc if num_proc > 1 and len(docs) >= 2 * num_proc else None)
        dtype = dtype_for(tokenizer.vocab_size)
        n_tokens = n_bytes = 0
        with atomic_file(folder / f"{split}.bin") as out:  # a full disk leaves no partial array behind
            for batch in tokenized.with_format("numpy").iter(batch_size=256):
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
    return np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r"), meta
