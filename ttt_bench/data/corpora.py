"""Corpora: where documents come from. Each yields plain-text documents per split and has a
fingerprint that changes whenever its content could (used to key the token cache).

- `SyntheticCorpus`: the embedded default (see synthetic.py).
- `LocalCorpus`: files on disk in the Pile's format (`.jsonl.zst` / `.jsonl` lines of
  `{"text", "meta": {"pile_set_name"}}`) or plain `.txt` files, chosen by globs. Each of its train files is
  also a `Shard`, a corpus of its own with a fingerprint of its own, so that the token cache can tokenize the
  train files one by one and only as many as a run needs (token_cache.py).
- `HubCorpus`: any Hugging Face hub dataset by name (e.g. PG-19), when online.
"""

import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import UserError
from .synthetic import SyntheticLanguage, generate_document

log = logging.getLogger(__name__)
SPLITS = ("train", "validation")


@dataclass
class ReadStats:
    """What reading a corpus skipped or repaired; reported, never silent."""

    documents: int = 0
    held_out: int = 0  # documents of the other split (a corpus without validation files: val_fraction)
    filtered_out: int = 0
    bad_lines: int = 0
    missing_text: int = 0
    non_utf8_documents: int = 0

    def report(self) -> str:
        return (
            f"{self.documents} documents read, {self.filtered_out} filtered out by pile_set_name, "
            f"{self.bad_lines} unreadable lines, {self.missing_text} without 'text', "
            f"{self.non_utf8_documents} with non-UTF-8 bytes replaced"
        )


def _sha(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


SAMPLE_BYTES = 1 << 20


def file_fingerprint(path: str) -> str:
    """A file's size and a hash of its first and last MiB: the same for a copy of the file (unlike its mtime,
    which a fresh checkout or a copy to scratch renews), different for a truncated, extended or replaced one.
    An edit that keeps the size and touches only the middle of a file larger than 2 MiB goes unseen."""
    digest, size = hashlib.blake2b(digest_size=8), os.path.getsize(path)
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            digest.update(f.read())
    return f"{size}:{digest.hexdigest()}"


def _in_validation(index: int, val_fraction: float) -> bool:
    """Deterministic document-level split for corpora without a validation file."""
    h = int(hashlib.blake2b(str(index).encode(), digest_size=8).hexdigest(), 16)
    return (h % 100_000) < val_fraction * 100_000


@dataclass
class SyntheticCorpus:
    seed: int = 0
    train_docs: int = 800
    validation_docs: int = 40
    mean_doc_bytes: int = 24_000
    vocab: int = 2048

    def fingerprint(self) -> str:
        return _sha(
            "synthetic-v1", self.seed, self.train_docs, self.validation_docs, self.mean_doc_bytes, self.vocab
        )

    def documents(self, split: str, stats: ReadStats | None = None) -> Iterator[str]:
        lang = SyntheticLanguage(seed=self.seed, vocab=self.vocab)
        n = self.train_docs if split == "train" else self.validation_docs
        for i in range(n):
            if stats is not None:
                stats.documents += 1
            yield generate_document(lang, self.seed, split, i, self.mean_doc_bytes)


def expand_globs(patterns: str | list[str], what: str) -> list[str]:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    files = sorted(
        {f for p in patterns for f in glob.glob(os.path.expanduser(p), recursive=True) if os.path.isfile(f)}
    )
    if not files:
        raise UserError(
            f"no files match {what} = {patterns}; point it at existing .jsonl.zst/.jsonl/.txt files "
            "(e.g. data.corpus.train_files=/path/to/pile/train/*.jsonl.zst)"
        )
    return files


def _zstd_chunks(path: str) -> Iterator[bytes]:
    """The decompressed bytes of a .zst file, frame after frame; a UserError naming the file when it is not
    zstd or ends inside a frame (an interrupted download), so a damaged shard is never read as a short one."""
    import zstandard

    fix = "re-download or re-compress it, or remove it from data.corpus.train_files/validation_files"
    with open(path, "rb") as raw:
        zstd = zstandard.ZstdDecompressor()
        dobj, in_frame = zstd.decompressobj(), False
        while chunk := raw.read(1 << 20):
            while chunk:
                try:
                    yield dobj.decompress(chunk)
                except zstandard.ZstdError as e:
                    raise UserError(f"{path} is not a valid zstd file ({e}); {fix}") from None
                in_frame = not dobj.eof
                chunk = dobj.unused_data if dobj.eof else b""
                if dobj.eof:
                    dobj = zstd.decompressobj()
        if in_frame or raw.tell() == 0:
            raise UserError(f"{path} is truncated or empty (it ends inside a zstd frame); {fix}")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    pending: list[bytes] = []
    for chunk in chunks:
        *complete, rest = chunk.split(b"\n")
        if complete:
            yield b"".join([*pending, complete[0]])
            yield from complete[1:]
            pending = []
        pending.append(rest)
    if any(pending):
        yield b"".join(pending)


def _open_text_lines(path: str) -> Iterator[bytes]:
    if path.endswith(".zst"):
        yield from _lines(_zstd_chunks(path))
    else:
        with open(path, "rb") as f:
            yield from f


def _decode(data: bytes, stats: ReadStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        stats.non_utf8_documents += 1
        return data.decode("utf-8", errors="replace")


@dataclass
class LocalCorpus:
    """Pile-format shards or text files. With no `validation_files`, a deterministic
    `val_fraction` of the documents is held out (document level, never trained on)."""

    train_files: str | list[str] = ""
    validation_files: str | list[str] | None = None
    pile_set_names: list[str] | None = None  # e.g. ["Books3"] selects the paper's Books subset
    val_fraction: float = 0.01
    on_bad_line: str = "skip"  # or "error"
    text_field: str = "text"
    max_documents: int | None = None

    def __post_init__(self):
        if self.on_bad_line not in ("skip", "error"):
            raise UserError(f"data.corpus.on_bad_line must be 'skip' or 'error', got '{self.on_bad_line}'")
        if not self.train_files:
            raise UserError(
                "data.corpus.train_files is empty; set it to a glob of .jsonl.zst/.jsonl/.txt files"
            )

    def files(self, split: str) -> list[str]:
        if split == "validation" and self.validation_files:
            return expand_globs(self.validation_files, "data.corpus.validation_files")
        return expand_globs(self.train_files, "data.corpus.train_files")

    def fingerprint(self) -> str:
        files = {
            s: [(f, file_fingerprint(f)) for f in self.files(s)] for s in SPLITS
        }
        return _sha(
            "local-v2",
            files,
            self.pile_set_names,
            self.val_fraction,
            self.on_bad_line,
            self.text_field,
            self.max_documents,
            bool(self.validation_files),
        )

    def documents(self, split: str, stats: ReadStats | None = None) -> Iterator[str]:
        return self.read(self.files(split), split, stats, first_index=0, limit=self.max_documents)

    def read(self, paths: list[str], split: str, stats: ReadStats | None, first_index: int,
             limit: int | None) -> Iterator[str]:
        """The documents of `split` in `paths`, at most `limit`; `first_index`: the documents (of both splits)
        in the files before them, as the hashed hold-out numbers documents across all the train files."""
        stats = stats if stats is not None else ReadStats()
        held_out = not self.validation_files
        index, kept = first_index, 0
        for path in paths:
            for lineno, raw in enumerate(self._records(path), start=1):
                text = self._text(raw, path, lineno, stats)
                if text is None:
                    continue
                index += 1
                if held_out and _in_validation(index, self.val_fraction) != (split == "validation"):
                    stats.held_out += 1
                    continue
                stats.documents += 1
                kept += 1
                yield text
                if limit and kept >= limit:
                    return

    def _records(self, path: str) -> Iterator[bytes]:
        try:
            if path.endswith(".txt"):
                with open(path, "rb") as f:
                    yield f.read()
            else:
                yield from _open_text_lines(path)
        except OSError as e:
            raise UserError(
                f"cannot read {path} ({e.strerror or e}); fix its permissions or remove it from "
                "data.corpus.train_files/validation_files"
            ) from None

    def _text(self, raw: bytes, path: str, lineno: int, stats: ReadStats) -> str | None:
        if path.endswith(".txt"):
            return _decode(raw, stats)
        if not raw.strip():
            return None
        try:
            record = json.loads(_decode(raw, stats))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            stats.bad_lines += 1
            if self.on_bad_line == "error":
                raise UserError(
                    f"{path}:{lineno}: not a JSON object ({e}); fix the shard or set "
                    "data.corpus.on_bad_line=skip"
                ) from None
            return None
        text = record.get(self.text_field)
        if not isinstance(text, str):
            stats.missing_text += 1
            if self.on_bad_line == "error":
                raise UserError(
                    f"{path}:{lineno}: document has no '{self.text_field}' string field; set "
                    "data.corpus.text_field or data.corpus.on_bad_line=skip"
                )
            return None
        if self.pile_set_names:
            name = (record.get("meta") or {}).get("pile_set_name")
            if name not in self.pile_set_names:
                stats.filtered_out += 1
                return None
        return text


@dataclass(frozen=True)
class Shard:
    """One train file of a LocalCorpus as a corpus of its own, what one token cache holds: the documents that
    `corpus.documents(split)` reads from that file, given `first_index` documents in the train files before it
    (the hashed hold-out numbers them across files) and `limit` documents still wanted (max_documents)."""

    corpus: LocalCorpus
    path: str
    first_index: int = 0
    limit: int | None = None

    def fingerprint(self) -> str:
        """The file's content and the settings that choose its documents; of the files before it, only how
        many documents they hold, and only for the hashed hold-out."""
        c = self.corpus
        held_out = None if c.validation_files else (c.val_fraction, self.first_index)
        return _sha("local-shard-v1", file_fingerprint(self.path), c.pile_set_names, c.on_bad_line,
                    c.text_field, self.limit, held_out)

    def documents(self, split: str, stats: ReadStats | None = None) -> Iterator[str]:
        return self.corpus.read([self.path], split, stats, self.first_index, self.limit)


@dataclass
class HubCorpus:
    """A Hugging Face hub dataset by name, e.g. path=deepmind/pg19 (needs network the first time)."""

    path: str = ""
    name: str | None = None
    text_field: str = "text"
    train_split: str = "train"
    validation_split: str = "validation"
    max_documents: int | None = None

    def fingerprint(self) -> str:
        return _sha(
            "hub-v1",
            self.path,
            self.name,
            self.text_field,
            self.train_split,
            self.validation_split,
            self.max_documents,
        )

    def documents(self, split: str, stats: ReadStats | None = None) -> Iterator[str]:
        import datasets

        hub_split = self.train_split if split == "train" else self.validation_split
        try:
            ds = datasets.load_dataset(self.path, self.name, split=hub_split, streaming=True)
        except Exception as e:
            raise UserError(
                f"could not load hub dataset '{self.path}' split '{hub_split}' ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); check the name and network, or use local files"
            ) from None
        for i, row in enumerate(ds):
            if self.max_documents and i >= self.max_documents:
                break
            if stats is not None:
                stats.documents += 1
            yield row[self.text_field]
