"""Multi-query associative recall (MQAR; Arora, Eyuboglu et al., 2023, "Zoology"): the recall task of the
Zoology benchmark, as a datamodule the training loop uses like any other (`data=mqar`, docs/recall.md).

Every sequence of `seq_len + 1` tokens (inputs tokens[:-1], targets tokens[1:], as the packed corpora) is

    k_1 v_1 k_2 v_2 ... k_N v_N | . . k_3 v_3 . . . . k_1 v_1 . . k_N v_N . . .
    \\______ N pairs ________/   \\_____ queries: each key once, followed by its value ____/

- keys are distinct within a sequence, drawn from [1, V/2); values (distinct too) from [V/2, V): disjoint
  halves of the vocabulary, token 0 is the filler;
- the query region has (seq_len + 1 - 2N) // 2 slots of two tokens; key i goes to slot g_i, the slots drawn
  without replacement with P(g) proportional to g^(power_a - 1), g = 1, 2, ... (Zoology's power law: small
  power_a puts queries near the pairs, power_a = 1 is uniform over the region), key i taking the i-th draw;
- every other position of the query region carries a uniformly random token of the whole vocabulary
  (`random_non_queries`, Zoology's default) or the filler 0;
- the loss mask marks the input positions t of the queries: their target tokens[t + 1] is the paired value,
  the only predictable tokens of a sequence. Loss and accuracy count these positions only.

Generation is vectorised NumPy in chunks of CHUNK sequences, each chunk from its own random stream
(seed, split, chunk): sequence i depends only on the options, the seed, the split and i (a larger split
extends a smaller one). Generated splits are cached as .npy files under `cache_dir` (memory-mapped),
keyed by every option and FORMAT_VERSION.
"""

import hashlib
import json
import logging
import math
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from ..io import atomic_file
from .loaders import loader, stream_loader
from .tokenizers import MQARVocab

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHUNK = 4096  # sequences per random stream
FILLER = 0  # never a key nor a value
SPLITS = {"train": 0, "validation": 1}


def query_slots(seq_len: int, num_kv_pairs: int) -> int:
    """Two-token (key, value) slots of the query region, the tokens after the N pairs."""
    return (seq_len + 1 - 2 * num_kv_pairs) // 2


def check_options(vocab_size: int, num_kv_pairs: int, seq_len: int, power_a: float,
                  key: str | None = None) -> None:
    """`key`: the setting the number of pairs comes from, as the messages name it (a training mixture's:
    data.train_num_kv_pairs=[2, 40]); default data.num_kv_pairs=N."""
    key = key or f"data.num_kv_pairs={num_kv_pairs}"
    if num_kv_pairs < 1 or seq_len < 1 or vocab_size < 1:
        raise UserError(f"{key}, data.seq_len={seq_len} and data.vocab_size={vocab_size} must all be >= 1")
    if num_kv_pairs > vocab_size // 2 - 1:
        raise UserError(f"{num_kv_pairs} distinct keys ({key}) need data.vocab_size >= "
                        f"{2 * num_kv_pairs + 2} (keys come from [1, V/2), values from [V/2, V))")
    if query_slots(seq_len, num_kv_pairs) < num_kv_pairs:
        raise UserError(f"data.seq_len={seq_len} is too short for {num_kv_pairs} pairs ({key}) and their "
                        f"queries: it needs >= {4 * num_kv_pairs - 1} tokens (2 per pair, 2 per query)")
    if not (power_a > 0 and math.isfinite(power_a)):  # inf would give every sequence the same query slots
        raise UserError(f"data.power_a={power_a} must be a finite number > 0 (1.0: uniform query placement)")
    if vocab_size > np.iinfo(np.int32).max:
        raise UserError(f"data.vocab_size={vocab_size} is too large")


def slot_probabilities(space: int, power_a: float) -> np.ndarray:
    """P(slot g), g = 0..space-1: proportional to (g + 1)^(power_a - 1), Zoology's power law."""
    p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    return p / p.sum()


def distinct_integers(rng: np.random.Generator, n: int, k: int, low: int, high: int) -> np.ndarray:
    """[n, k] integers of [low, high), distinct within each row, each row a uniformly random ordered draw."""
    size = high - low
    if k * k <= 16 * size:  # Floyd's algorithm over the rows, O(n k^2), then a random order
        out = np.empty((n, k), dtype=np.int64)
        for j, m in enumerate(range(size - k, size)):
            t = rng.integers(0, m + 1, size=n)
            taken = (out[:, :j] == t[:, None]).any(axis=1)
            out[:, j] = np.where(taken, m, t)
        out = rng.permuted(out, axis=1)
    else:  # many of few: the first k of a random permutation of each row, O(n * size)
        out = np.argsort(rng.random((n, size)), axis=1)[:, :k]
    return out + low


def weighted_draws(rng: np.random.Generator, n: int, k: int, p: np.ndarray) -> np.ndarray:
    """[n, k] indices into p, drawn without replacement with probabilities p, in the order of the draws:
    the k smallest of E_g / p_g (E_g ~ Exp(1)), sorted, are distributed as k successive draws."""
    scores = rng.standard_exponential(size=(n, len(p))) / p[None, :]
    top = np.argpartition(scores, k - 1, axis=1)[:, :k] if k < len(p) else np.tile(np.arange(k), (n, 1))
    order = np.argsort(np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


def generate_chunk(rng: np.random.Generator, n: int, vocab_size: int, num_kv_pairs: int, seq_len: int,
                   power_a: float, random_non_queries: bool) -> tuple[np.ndarray, np.ndarray]:
    """n sequences: tokens [n, seq_len + 1] and the query positions [n, N] (input positions whose target
    is the paired value), in the order of the pairs."""
    N, half = num_kv_pairs, vocab_size // 2
    keys = distinct_integers(rng, n, N, 1, half)
    values = distinct_integers(rng, n, N, half, vocab_size)
    slots = weighted_draws(rng, n, N, slot_probabilities(query_slots(seq_len, N), power_a))
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    if random_non_queries:
        tokens = rng.integers(0, vocab_size, size=(n, seq_len + 1), dtype=dtype)
    else:
        tokens = np.full((n, seq_len + 1), FILLER, dtype=dtype)
    tokens[:, 0 : 2 * N : 2], tokens[:, 1 : 2 * N : 2] = keys, values
    queries = 2 * N + 2 * slots
    np.put_along_axis(tokens, queries, keys.astype(dtype), axis=1)
    np.put_along_axis(tokens, queries + 1, values.astype(dtype), axis=1)
    return tokens, queries.astype(np.int32)


def generate(n: int, vocab_size: int, num_kv_pairs: int, seq_len: int, power_a: float = 0.01,
             random_non_queries: bool = True, seed: int = 0, split: str = "train",
             mixture: list[int] | None = None):
    """The first n sequences of a split: (tokens [n, seq_len + 1], query positions [n, N]). `mixture`:
    numbers of pairs that share every chunk in equal parts instead of `num_kv_pairs` (Zoology trains on such
    a mix of easy and hard sequences); the query positions are then padded with -1 to the largest."""
    counts = list(mixture) if mixture else [num_kv_pairs]
    key = f"data.train_num_kv_pairs={counts}" if mixture else None
    for N in counts:
        check_options(vocab_size, N, seq_len, power_a, key)
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; use one of {', '.join(SPLITS)}")
    width = max(counts)
    tokens, queries = [], []
    for c in range(-(-n // CHUNK)):
        rng = np.random.default_rng([seed, SPLITS[split], c])
        for N, part in zip(counts, np.array_split(np.arange(CHUNK), len(counts)), strict=True):
            t, q = generate_chunk(rng, len(part), vocab_size, N, seq_len, power_a, random_non_queries)
            tokens.append(t)
            queries.append(np.pad(q, ((0, 0), (0, width - N)), constant_values=-1))
    if not tokens:
        return np.zeros((0, seq_len + 1), np.uint16), np.zeros((0, width), np.int32)
    return np.concatenate(tokens)[:n], np.concatenate(queries)[:n]


class MQARSequences(Dataset):
    """Item i: the sequence's tokens [seq_len + 1] (int64), as PackedSequences gives them, so evaluation code
    that takes token windows runs on it unchanged; `loss_mask(i)` [seq_len] marks the answer targets."""

    def __init__(self, tokens: np.ndarray, queries: np.ndarray, max_sequences: int | None = None):
        self.tokens, self.queries = tokens, queries
        self.n = min(len(tokens), max_sequences) if max_sequences else len(tokens)
        self.seq_len = tokens.shape[1] - 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return torch.from_numpy(self.tokens[i % self.n].astype(np.int64))

    def loss_mask(self, i: int) -> torch.Tensor:
        mask = torch.zeros(self.seq_len, dtype=torch.bool)
        q = self.queries[i % self.n]
        mask[torch.from_numpy(q[q >= 0].astype(np.int64))] = True  # -1: padding (fewer pairs than others)
        return mask

    def with_loss_mask(self) -> "MaskedSequences":
        return MaskedSequences(self)


class MaskedSequences(Dataset):
    """The batches of the training loop: items {"tokens": [seq_len + 1], "loss_mask": [seq_len]}."""

    def __init__(self, sequences: MQARSequences):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict:
        return {"tokens": self.sequences[i], "loss_mask": self.sequences.loss_mask(i)}


class MQARDataModule(L.LightningDataModule):
    """MQAR with the surface of LMDataModule (vocab_size, build_tokenizer, prepare_data, train_dataset,
    val_dataset, bytes_per_token, samples_per_step, meta). Its loaders give dict batches
    {"tokens", "loss_mask"} (LitLM computes loss and accuracy over the masked positions);
    `train_dataset()`/`val_dataset()` give plain token windows, whose full-sequence loss is what train.py's
    final `evaluate` reports."""

    def __init__(
        self,
        vocab_size: int = 8192,
        num_kv_pairs: int = 16,
        seq_len: int = 256,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        train_num_kv_pairs: list[int] | None = None,
        train_examples: int = 100_000,
        val_examples: int = 3_000,
        micro_batch_size: int = 64,
        cache_dir: str | None = None,
        val_tokens: int | None = None,
        seed: int = 0,
        name: str = "mqar",
        tokenizer: dict | None = None,  # set by `ttt-bench eval` from the checkpoint; MQAR has none
        num_proc: int = 1,  # unused, for overrides shared with the text datamodule
    ):
        super().__init__()
        check_options(vocab_size, num_kv_pairs, seq_len, power_a)
        if micro_batch_size < 1 or train_examples < 1 or val_examples < 1:
            raise UserError(f"data.micro_batch_size ({micro_batch_size}), data.train_examples "
                            f"({train_examples}) and data.val_examples ({val_examples}) must be >= 1")
        if tokenizer and (tokenizer.get("kind"), tokenizer.get("vocab_size")) != ("mqar", vocab_size):
            raise UserError(f"a checkpoint trained with tokenizer {tokenizer} cannot be evaluated on MQAR "
                            f"with data.vocab_size={vocab_size}")
        self.vocab, self.num_kv_pairs, self.seq_len = MQARVocab(vocab_size), num_kv_pairs, seq_len
        self.power_a, self.random_non_queries = float(power_a), bool(random_non_queries)
        self.mixture = [int(n) for n in train_num_kv_pairs] if train_num_kv_pairs else None
        for n in self.mixture or []:
            check_options(vocab_size, n, seq_len, power_a, f"data.train_num_kv_pairs={self.mixture}")
        self.examples = {"train": train_examples, "validation": val_examples}
        self.micro_batch_size, self.val_tokens = micro_batch_size, val_tokens
        self.seed, self.name = seed, name
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.meta: dict[str, dict] = {}
        self.samples_per_step = 0  # sequences per optimizer step (all ranks); set by the trainer set-up

    # -- preparation ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def build_tokenizer(self) -> MQARVocab:
        return self.vocab

    def options(self, split: str) -> dict:
        """Everything the data of a split depends on."""
        return {"format": FORMAT_VERSION, "chunk": CHUNK, "vocab_size": self.vocab_size,
                "num_kv_pairs": self.num_kv_pairs, "seq_len": self.seq_len, "power_a": self.power_a,
                "random_non_queries": self.random_non_queries, "seed": self.seed, "split": split,
                "n": self.examples[split], **self.split_mixture(split)}

    def split_mixture(self, split: str) -> dict:
        """The training split's mixture of numbers of pairs, where one is set (validation: num_kv_pairs)."""
        return {"mixture": self.mixture} if split == "train" and self.mixture else {}

    def cache_paths(self, split: str) -> tuple[Path, Path] | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(json.dumps(self.options(split), sort_keys=True).encode()).hexdigest()[:16]
        folder = self.cache_dir / "mqar"
        return folder / f"{key}-tokens.npy", folder / f"{key}-queries.npy"

    def load_split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        paths = self.cache_paths(split)
        if paths is not None and all(p.is_file() for p in paths):
            try:
                return tuple(np.load(p, mmap_mode="r") for p in paths)
            except (OSError, ValueError) as e:  # damaged: build again
                log.warning("MQAR cache %s unreadable (%s); generating it again", paths[0], e)
        o = self.options(split)
        tokens, queries = generate(o["n"], self.vocab_size, self.num_kv_pairs, self.seq_len, self.power_a,
                                   self.random_non_queries, self.seed, split, o.get("mixture"))
        if paths is not None:
            for path, array in zip(paths, (tokens, queries)):
                with atomic_file(path) as f:
                    np.save(f, array)
        return tokens, queries

    def prepare_data(self) -> None:
        for split in SPLITS:
            if split not in self.data:
                self.data[split] = self.load_split(split)
                n = len(self.data[split][0])
                self.meta[split] = {"n_sequences": n, "n_tokens": n * (self.seq_len + 1),
                                    "n_answers": int((self.data[split][1] >= 0).sum())}

    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataset(self) -> MQARSequences:
        self.prepare_data()
        return MQARSequences(*self.data["train"])

    def val_dataset(self, max_tokens: int | None = ...) -> MQARSequences:
        """The validation sequences holding the first `max_tokens` tokens (None: all; left out:
        data.val_tokens)."""
        self.prepare_data()
        max_tokens = self.val_tokens if max_tokens is ... else max_tokens
        max_sequences = max(1, max_tokens // self.seq_len) if max_tokens else None
        return MQARSequences(*self.data["validation"], max_sequences)

    def train_dataloader(self) -> DataLoader:
        return stream_loader(self.train_dataset().with_loss_mask(), self.micro_batch_size, self.seed,
                             self.samples_per_step, self.trainer)

    def val_dataloader(self) -> DataLoader:
        ds = self.val_dataset().with_loss_mask()
        return loader(ds, self.micro_batch_size)

    def bytes_per_token(self, split: str = "validation") -> float:
        """Tokens are not text: 1, so val_bpb reads as bits per token."""
        return 1.0
