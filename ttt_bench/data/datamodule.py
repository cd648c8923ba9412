"""LightningDataModule: corpus -> tokenizer -> cached token arrays -> packed fixed-length sequences.

Each split is prepared (tokenized into its cache, token_cache.py, or memory-mapped from it) when first used:
training prepares the train split and the validation split (`prepare_data`), `ttt-bench eval` only the
validation split it reads. The train split of a LocalCorpus is prepared shard by shard, only the train files
that hold `train_tokens`, the tokens the run trains on (set by the trainer set-up), and read in place by
`ShardedSequences`.
"""

from collections.abc import Mapping
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from .corpora import SPLITS
from .loaders import EpochShuffleSampler, loader, stream_loader  # noqa: F401  (the sampler: tests import it here)
from .token_cache import cache_key, split_tokens
from .tokenizers import ByteTokenizer, fingerprint, from_spec, train_bpe
from .windows import ValidationWindows


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PackedSequences(Dataset):
    """Sequence i = tokens[i*L : i*L + L + 1] (inputs and shifted targets share one token), so
    every token of the stream is a prediction target exactly once."""

    def __init__(self, tokens: np.ndarray, seq_len: int, max_sequences: int | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        n = (len(tokens) - 1) // seq_len
        self.n = min(n, max_sequences) if max_sequences else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class ShardedSequences(Dataset):
    """`PackedSequences` over a stream kept in several arrays (a split's shards), without joining them:
    sequence i is PackedSequences(np.concatenate(shards))[i], so a sequence may span a shard boundary and
    the sequences of a single array are those of PackedSequences."""

    def __init__(self, shards: list[np.ndarray], seq_len: int):
        self.shards, self.seq_len = [s for s in shards if len(s)], seq_len
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # where each shard starts, then the end
        self.n = max(0, (int(self.starts[-1]) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start, stop = i * self.seq_len, (i + 1) * self.seq_len + 1
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            piece = self.shards[k][start - self.starts[k] : stop - self.starts[k]]
            pieces.append(piece)
            start, k = start + len(piece), k + 1
        return torch.from_numpy(np.concatenate(pieces).astype(np.int64))


class SplitStreams(Mapping):
    """`LMDataModule.tokens`: split -> its whole token stream, the split prepared on first read. A split of
    one cache is its memory map; train shards are joined in memory, for readers of the whole split such as
    the n-gram floors (training reads them in place)."""

    def __init__(self, prepare):
        self.prepare = prepare

    def __getitem__(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise KeyError(split)
        arrays = self.prepare(split)
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def __iter__(self):
        return iter(SPLITS)

    def __len__(self) -> int:
        return len(SPLITS)


class LMDataModule(L.LightningDataModule):
    def __init__(
        self,
        corpus,
        tokenizer: dict,
        seq_len: int,
        micro_batch_size: int,
        cache_dir: str,
        val_tokens: int | None = 262_144,
        num_proc: int = 1,
        seed: int = 0,
        name: str = "data",
        bpe_train_documents: int = 2000,
    ):
        super().__init__()
        if seq_len < 1 or micro_batch_size < 1:
            raise UserError(
                f"data.seq_len ({seq_len}) and data.micro_batch_size ({micro_batch_size}) must be >= 1"
            )
        if val_tokens is not None and (not _is_int(val_tokens) or val_tokens < 1):
            raise UserError(f"data.val_tokens={val_tokens!r} must be a positive integer or null (the whole "
                            "split), e.g. data.val_tokens=131072")
        vocab = tokenizer.get("vocab_size", 8192)
        if tokenizer.get("kind") == "bpe" and (not _is_int(vocab) or vocab < 257):
            raise UserError(f"data.tokenizer.vocab_size={vocab!r} must be an integer of at least 257 (the "
                            "256 bytes and end-of-text), e.g. data.tokenizer.vocab_size=8192")
        self.corpus, self.tokenizer_spec = corpus, dict(tokenizer)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.cache_dir, self.val_tokens, self.num_proc, self.seed, self.name = (
            Path(cache_dir),
            val_tokens,
            num_proc,
            seed,
            name,
        )
        self.bpe_train_documents = bpe_train_documents
        self.tokenizer = None
        self.shards: dict[str, list[np.ndarray]] = {}  # each prepared split's token arrays, in stream order
        self.tokens = SplitStreams(self.prepare_split)
        self.meta: dict[str, dict] = {}  # each prepared split's n_tokens, n_bytes, n_documents, read_stats
        self.fingerprint: str | None = None  # set when a split is prepared
        # tokens the run trains on (all ranks), set by the trainer set-up before prepare_data; None: all
        self.train_tokens: int | None = None
        self.samples_per_step = 0  # sequences per optimizer step (all ranks); set by the trainer set-up

    # -- preparation ------------------------------------------------------------------------------
    def build_tokenizer(self):
        if self.tokenizer is None:
            spec = self.tokenizer_spec
            if spec.get("kind") == "bpe" and "json" not in spec:
                key = fingerprint(
                    {"corpus": self.corpus.fingerprint(), "vocab": spec.get("vocab_size", 8192)}
                )
                docs = (d for _, d in zip(range(self.bpe_train_documents), self.corpus.documents("train")))
                self.tokenizer = train_bpe(
                    docs, int(spec.get("vocab_size", 8192)), self.cache_dir / "tokenizers", key
                )
            else:
                self.tokenizer = ByteTokenizer() if spec.get("kind", "byte") == "byte" else from_spec(spec)
        return self.tokenizer

    def prepare_data(self) -> None:
        """Training's splits: the train shards that hold `train_tokens` (None: all of them), validation."""
        for split in SPLITS:
            self.prepare_split(split)

    def prepare_split(self, split: str) -> list[np.ndarray]:
        """The split's token arrays in stream order, from their caches (built first where missing)."""
        if split not in self.shards:
            tok = self.build_tokenizer()
            self.fingerprint = cache_key(self.corpus, tok)  # the corpus' content and the tokenizer
            budget = self.train_tokens if split == "train" else None
            arrays, meta = split_tokens(self.corpus, tok, split, self.cache_dir, self.num_proc, budget)
            if meta["n_tokens"] < self.seq_len + 1:
                raise UserError(
                    f"the {split} split of '{self.name}' has {meta['n_tokens']} tokens, fewer than one "
                    f"sequence of data.seq_len+1 = {self.seq_len + 1}; use more data or a shorter seq_len"
                )
            self.shards[split], self.meta[split] = arrays, meta
        return self.shards[split]

    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()

    @property
    def vocab_size(self) -> int:
        return self.build_tokenizer().vocab_size

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataset(self) -> ShardedSequences:
        return ShardedSequences(self.prepare_split("train"), self.seq_len)

    def val_dataset(self, max_tokens: int | None = ...) -> ValidationWindows:
        """About `max_tokens` tokens of validation windows drawn across every validation document, the same
        for every run (data/windows.py); None: the whole split, cut end to end; left out: data.val_tokens,
        what training evaluates on."""
        max_tokens = self.val_tokens if max_tokens is ... else max_tokens
        tokens, eos = self.tokens["validation"], self.build_tokenizer().eos_id
        if max_tokens is None:
            return ValidationWindows.packed(tokens, self.seq_len, eos)
        return ValidationWindows.drawn(tokens, self.seq_len, max(1, max_tokens // self.seq_len), eos)

    @property
    def samples_per_step(self) -> int:
        return self._samples_per_step

    @samples_per_step.setter
    def samples_per_step(self, n: int) -> None:
        if "train" in self.shards:  # set by the trainer set-up after prepare_data: refuse before training
            self._check_batch(n)
        self._samples_per_step = n

    def _check_batch(self, n: int) -> None:
        """A batch larger than the training split would repeat sequences inside it."""
        sequences = len(self.train_dataset())
        if sequences < max(n, self.micro_batch_size):
            raise UserError(
                f"the train split of '{self.name}' has {sequences} sequences of data.seq_len={self.seq_len}, "
                f"fewer than the {max(n, self.micro_batch_size)} of one batch (data.micro_batch_size, "
                "recipe.tokens_per_batch); use more data or smaller batches"
            )

    def train_dataloader(self) -> DataLoader:
        self._check_batch(self.samples_per_step)
        return stream_loader(self.train_dataset(), self.micro_batch_size, self.seed, self.samples_per_step,
                             self.trainer)

    def val_dataloader(self) -> DataLoader:
        return loader(self.val_dataset(), self.micro_batch_size)

    def bytes_per_token(self, split: str = "validation") -> float:
        self.prepare_split(split)
        meta = self.meta[split]
        return meta["n_bytes"] / max(1, meta["n_tokens"] - meta["n_documents"])  # EOS tokens carry no bytes
