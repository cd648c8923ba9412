"""LightningDataModule: corpus -> tokenizer -> cached token array -> packed fixed-length sequences."""

import logging
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from .loaders import EpochShuffleSampler, loader, stream_loader  # noqa: F401  (the sampler: tests import it here)
from .token_cache import build_tokens, cache_key, load_tokens
from .tokenizers import ByteTokenizer, fingerprint, from_spec, train_bpe

log = logging.getLogger(__name__)


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
        self.tokens: dict[str, np.ndarray] = {}
        self.meta: dict[str, dict] = {}
        self.fingerprint: str | None = None  # set by prepare_data
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
        tok = self.build_tokenizer()
        key = self.fingerprint = cache_key(self.corpus, tok)  # the corpus' content and the tokenizer
        for split in ("train", "validation"):
            loaded = load_tokens(self.cache_dir, key, split)
            if loaded is None:
                log.info("building token cache for %s/%s under %s", self.name, split, self.cache_dir)
                loaded = build_tokens(self.corpus, tok, split, self.cache_dir, key, self.num_proc)
            self.tokens[split], self.meta[split] = loaded
            if len(loaded[0]) < self.seq_len + 1:
                raise UserError(
                    f"the {split} split of '{self.name}' has {len(loaded[0])} tokens, fewer than one "
                    f"sequence of data.seq_len+1 = {self.seq_len + 1}; use more data or a shorter seq_len"
                )

    def setup(self, stage: str | None = None) -> None:
        if not self.tokens:
            self.prepare_data()

    @property
    def vocab_size(self) -> int:
        return self.build_tokenizer().vocab_size

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataset(self) -> PackedSequences:
        return PackedSequences(self.tokens["train"], self.seq_len)

    def val_dataset(self, max_tokens: int | None = ...) -> PackedSequences:
        """The validation split's first `max_tokens` tokens as sequences (None: the whole split; left out:
        data.val_tokens, what training evaluates on)."""
        max_tokens = self.val_tokens if max_tokens is ... else max_tokens
        max_seqs = max(1, max_tokens // self.seq_len) if max_tokens else None
        return PackedSequences(self.tokens["validation"], self.seq_len, max_seqs)

    @property
    def samples_per_step(self) -> int:
        return self._samples_per_step

    @samples_per_step.setter
    def samples_per_step(self, n: int) -> None:
        if self.tokens:  # set by the trainer set-up after prepare_data: refuse before training starts
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
        meta = self.meta[split]
        return meta["n_bytes"] / max(1, meta["n_tokens"] - meta["n_documents"])  # EOS tokens carry no bytes
