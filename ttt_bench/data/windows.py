"""Validation windows drawn across every document of the validation text.

The first `val_tokens` of a split are a sliver of it (on pile-mini 8 of its 98 documents, on books-mini part
of one book), so every conclusion would be about one text. `ValidationWindows` instead draws n windows of
seq_len + 1 tokens from a fixed seed (never the run's), stratified by document: each document gets windows in
proportion to its length, at least one when n allows (so every book and every short work contributes), at
evenly spread random offsets inside it. A window starts inside its document and may run on into the next, as
training's packed sequences do. Every run and the n-gram floors (`stream()`) read the same windows, and
`documents` says which document each window comes from (the unit of the bootstrap in evaluate.py).
"""

import numpy as np
import torch
from torch.utils.data import Dataset

WINDOW_SEED = 0  # one set of windows for every run, whatever its seed


def document_starts(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Where each document begins in a token stream of documents each followed by EOS."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_id)
    return np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(1, dtype=np.int64)


def allocate(lengths: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Windows per document: proportional to length (largest remainder), at least one each when n >= the
    number of documents; with fewer windows than documents, n documents drawn in proportion to length."""
    lengths = np.asarray(lengths, dtype=np.float64)
    d = len(lengths)
    if n < d:
        counts = np.zeros(d, dtype=np.int64)
        counts[rng.choice(d, size=n, replace=False, p=lengths / lengths.sum())] = 1
        return counts
    share = (n - d) * lengths / lengths.sum()
    counts = 1 + np.floor(share).astype(np.int64)
    left = n - counts.sum()
    counts[np.argsort(-(share - np.floor(share)), kind="stable")[:left]] += 1
    return counts


class ValidationWindows(Dataset):
    """Windows of seq_len + 1 tokens of a validation stream at `starts`, each from document `documents[i]`:
    `drawn` across every document (see the module docstring) or `packed`, the whole split cut end to end."""

    def __init__(self, tokens: np.ndarray, seq_len: int, starts: np.ndarray, documents: np.ndarray):
        self.tokens, self.seq_len = tokens, seq_len
        self.starts, self.documents = np.asarray(starts, dtype=np.int64), np.asarray(documents)

    @classmethod
    def drawn(cls, tokens: np.ndarray, seq_len: int, n: int, eos_id: int, seed: int = WINDOW_SEED):
        last = len(tokens) - seq_len - 1  # the last start with a whole window after it
        starts = document_starts(tokens, eos_id)
        starts = starts[starts <= last]
        ends = np.append(starts[1:], last + 1)  # a document's windows start before the next document
        rng = np.random.default_rng(seed)
        counts = allocate(ends - starts, min(n, last + 1), rng)
        chosen, docs = [], []
        for doc, (lo, hi, k) in enumerate(zip(starts, ends, counts, strict=True)):
            if k:  # k starts at evenly spread random offsets: one in each of k equal strata of the document
                chosen.append(lo + np.floor((np.arange(k) + rng.random(k)) * (hi - lo) / k).astype(np.int64))
                docs.append(np.full(k, doc))
        return cls(tokens, seq_len, np.concatenate(chosen), np.concatenate(docs))

    @classmethod
    def packed(cls, tokens: np.ndarray, seq_len: int, eos_id: int):
        """Sequence i = tokens[i*L : i*L + L + 1]: every token of the split is a target exactly once."""
        starts = np.arange((len(tokens) - 1) // seq_len) * seq_len
        documents = np.searchsorted(document_starts(tokens, eos_id), starts, side="right") - 1
        return cls(tokens, seq_len, starts, documents)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = self.starts[i]
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def stream(self) -> tuple[np.ndarray, np.ndarray]:
        """The windows end to end and, per token, the history a model has of it (0 at a window's first
        token, which nothing predicts): what the n-gram floors are computed on."""
        index = self.starts[:, None] + np.arange(self.seq_len + 1)
        history = np.broadcast_to(np.arange(self.seq_len + 1), index.shape)
        return np.asarray(self.tokens)[index].ravel(), history.ravel()
