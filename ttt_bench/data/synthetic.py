"""The embedded default corpus: seeded, deterministic text with long-range structure.

Each document mixes three kinds of sentences:
- *fresh* sentences from a global bigram language over Zipf-distributed pseudo-words (learnable
  from short context, like ordinary text statistics);
- *facts* binding a document-specific entity name to a random code ("Kavomir holds the code
  4821-7730."), restated many times later in the document — the name and the code are only
  predictable from their first appearance, possibly thousands of tokens back;
- *recalls*: verbatim repeats of an earlier sentence of the same document.

So a model that uses more context gets lower loss at later token positions (Figures 2/14).
Generation is vectorised with NumPy (>= 10 MB/s) and depends only on (seed, split, document index).
"""

from dataclasses import dataclass

import numpy as np

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["th", "sh", "qu", "an", "er", "in", "on"]
_SPLIT_OFFSET = {"train": 0, "validation": 1 << 40}


def _words(rng: np.random.Generator, n: int, min_syl: int, max_syl: int) -> list[str]:
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice(_SYLLABLES, size=rng.integers(min_syl, max_syl + 1)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


@dataclass
class SyntheticLanguage:
    """The global part of the corpus: vocabulary and bigram successor table (same for every split)."""

    seed: int = 0
    vocab: int = 2048
    successors: int = 8

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        self.words = np.array(_words(rng, self.vocab, 1, 3), dtype=object)
        self.capitalized = np.array([w.capitalize() for w in self.words], dtype=object)
        zipf = 1.0 / np.arange(1, self.vocab + 1) ** 1.1
        self.unigram = zipf / zipf.sum()
        self.next_word = rng.choice(self.vocab, size=(self.vocab, self.successors), p=self.unigram)
        p = rng.dirichlet(np.full(self.successors, 0.5), size=self.vocab)
        self.next_cdf = np.cumsum(p, axis=1)

    def sentences(self, rng: np.random.Generator, n: int, min_len: int = 5, max_len: int = 14) -> list[str]:
        """n sentences sampled from the bigram chain, all chains advanced together."""
        lengths = rng.integers(min_len, max_len + 1, size=n)
        ids = np.empty((n, max_len), dtype=np.int64)
        ids[:, 0] = rng.choice(self.vocab, size=n, p=self.unigram)
        for j in range(1, max_len):
            u = rng.random(n)[:, None]
            choice = (u > self.next_cdf[ids[:, j - 1]]).sum(axis=1).clip(max=self.successors - 1)
            ids[:, j] = self.next_word[ids[:, j - 1], choice]
        words = self.words[ids]
        words[:, 0] = self.capitalized[ids[:, 0]]
        words[np.arange(n), lengths - 1] += "."
        return [" ".join(row[:k]) for row, k in zip(words.tolist(), lengths.tolist())]


def generate_document(
    lang: SyntheticLanguage, seed: int, split: str, index: int, mean_bytes: int = 24_000, n_entities: int = 12
) -> str:
    """Document `index` of `split`: deterministic in (seed, split, index)."""
    rng = np.random.default_rng([seed, _SPLIT_OFFSET[split] + index])
    target = int(rng.uniform(0.25, 1.75) * mean_bytes)
    n = max(8, target // 60)
    names = [w.capitalize() for w in _words(rng, n_entities, 2, 4)]
    codes = [f"{a:04d}-{b:04d}" for a, b in rng.integers(0, 10_000, size=(n_entities, 2))]
    kind = rng.choice(3, size=n, p=[0.6, 0.2, 0.2])  # 0 fresh, 1 fact, 2 recall
    fresh = iter(lang.sentences(rng, int((kind != 1).sum())))
    who = rng.integers(0, n_entities, size=n)
    back = rng.random(n)
    out: list[str] = []
    for i in range(n):
        if kind[i] == 1:
            out.append(f"{names[who[i]]} holds the code {codes[who[i]]}.")
        elif kind[i] == 2 and out:
            out.append(out[int(back[i] * len(out))])
        else:
            out.append(next(fresh))
    return " ".join(out)
