"""N-gram floors: the validation perplexity of count-based models fitted on the training split, so that a
results table shows whether a neural model has learned at least unigram/bigram statistics.

Models (all share one recursion, so every order is computed in one pass):
- unigram: add-one (Laplace) smoothing, P1(w) = (c(w) + 1) / (N + V);
- order k >= 2: interpolated Witten-Bell (Witten & Bell 1991; the "interpolated" form of Chen & Goodman
  1998, section 2.5), each order interpolated with the next lower one, down to the add-one unigram:
      Pk(w | h) = (c(h w) + T(h) Pk-1(w | h')) / (c(h) + T(h))
  with h the k-1 preceding tokens, h' = h without its oldest token, c(h) the count of h followed by
  any token, T(h) the number of distinct tokens seen after h; a context never seen in training
  (c(h) = 0) falls back to Pk-1. "bigram" is this model at k = 2. Every Pk(. | h) sums to 1 over the
  vocabulary. (Witten-Bell rather than Kneser-Ney (Kneser & Ney 1995): it needs no continuation counts
  or discount estimates, so it stays a short, exact implementation; KN is usually somewhat lower.)

Convention (the same for every model, and the one the neural models' validation loss uses): the training
split is one token stream (documents joined by EOS); on validation, every position that has at least
one token of history is predicted, EOS included, and a model of order k uses only the history inside
its evaluation sequence: with `seq_len` L, the stream is cut like `PackedSequences` (sequence i =
val[i*L : i*L+L+1], positions 1..L predicted), so the first positions of a sequence use the lower orders
their short history allows; `floors_for` passes the validation windows end to end with their own history
(data/windows.py). Without `seq_len`, val[1:] is predicted, each token given all of val before
it. Perplexity = exp(mean negative log-likelihood, natural log) over the predicted positions.

Counting is vectorised: an n-gram is the integer sum t_i V^(k-1-i) (oldest token most significant, so a
sorted array of k-gram codes is also sorted by context, code // V); per order one sort and run-length
counts (a bincount where V^k <= 2^24), binary-search look-ups. That needs V^k < 2^63: orders above that
(e.g. order 5 with a vocabulary above ~6.2k tokens) are lowered to the largest that fits, with a warning.
"""

import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from .io import write_atomic

log = logging.getLogger(__name__)

DEFAULT_ORDERS = (1, 2, 5)
FORMAT_VERSION = 1


def model_name(order: int) -> str:
    """The key of a model in the returned dicts (and the row name in report tables)."""
    return {1: "unigram", 2: "bigram"}.get(order, f"{order}-gram (Witten-Bell)")


def max_order(vocab_size: int) -> int:
    """The largest n-gram order whose integer codes fit in int64."""
    k = 1
    while vocab_size ** (k + 1) < 2**63:
        k += 1
    return k


def _runs(sorted_keys: np.ndarray) -> np.ndarray:
    """Starts of the runs of equal values in a sorted array."""
    new = np.empty(len(sorted_keys), dtype=bool)
    new[:1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=new[1:])
    return np.flatnonzero(new)


def _lookup(keys: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, found) of each query in the sorted unique array `keys`."""
    idx = np.minimum(np.searchsorted(keys, queries), max(len(keys) - 1, 0))
    found = keys[idx] == queries if len(keys) else np.zeros(len(queries), dtype=bool)
    return idx, found


class NgramCounts:
    """Counts of every order 1..order on a token stream, in sorted arrays."""

    def __init__(self, train: np.ndarray, vocab_size: int, order: int):
        if order > max_order(vocab_size):
            raise ValueError(f"order {order} codes overflow int64 for vocab_size {vocab_size}")
        x = np.asarray(train).astype(np.int64)
        if len(x) and (x.min() < 0 or x.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        self.vocab_size, self.order, self.n_tokens = vocab_size, order, len(x)
        self.unigram = np.bincount(x, minlength=vocab_size)
        self.tables = {}  # order -> (k-gram codes, their counts, contexts, c(h), T(h))
        code, buf = x.copy(), np.empty_like(x)  # reused buffers: no page faults per order
        for k in range(2, min(order, len(x)) + 1):
            n = len(x) - k + 1
            code = code[:n]
            code *= vocab_size
            code += x[k - 1 :]  # code[i] = tokens i .. i+k-1
            if vocab_size**k <= 2**24:  # small table: count directly
                dense = np.bincount(code, minlength=vocab_size**k)
                grams = np.flatnonzero(dense)
                counts = dense[grams]
            else:  # sort, then run lengths
                s = buf[:n]
                np.copyto(s, code)
                s.sort()
                starts = _runs(s)
                grams, counts = s[starts], np.diff(np.append(starts, n))
            h = grams // vocab_size
            cstarts = _runs(h)
            self.tables[k] = (grams, counts, h[cstarts], np.add.reduceat(counts, cstarts),
                              np.diff(np.append(cstarts, len(grams))))

    def probs(self, tokens: np.ndarray, history: np.ndarray) -> dict[int, np.ndarray]:
        """order -> P_order(tokens[i] | up to order-1 tokens before it) for every i, using at most
        history[i] tokens of history (an order needing more falls back to the lower ones)."""
        V = self.vocab_size
        x = np.asarray(tokens).astype(np.int64)
        history = np.asarray(history)
        p = (self.unigram[x] + 1.0) / (self.n_tokens + V)
        out, code = {1: p.copy()}, x.copy()
        for k in range(2, self.order + 1):
            code[k - 1 :] += x[: len(x) - k + 1] * V ** (k - 1)  # code of tokens[i-k+1 .. i]
            if k in self.tables:
                grams, counts, ctx, ctx_total, ctx_types = self.tables[k]
                use = np.flatnonzero(history >= k - 1)
                ci, seen = _lookup(ctx, code[use] // V)
                use, ci = use[seen], ci[seen]
                gi, found = _lookup(grams, code[use])
                c_hw = np.where(found, counts[gi], 0)
                t, c_h = ctx_types[ci], ctx_total[ci]
                p[use] = (c_hw + t * p[use]) / (c_h + t)
            out[k] = p.copy()
        return out


def _history(n: int, seq_len: int | None) -> np.ndarray:
    """Tokens of history each position of an n-token validation stream may use (0: not predicted)."""
    i = np.arange(n)
    if seq_len is None:
        return i
    return np.where(i == 0, 0, (i - 1) % seq_len + 1)


def ngram_perplexities(train: np.ndarray, val: np.ndarray, vocab_size: int, orders=DEFAULT_ORDERS,
                       seq_len: int | None = None, history: np.ndarray | None = None) -> dict[str, float]:
    """Validation perplexity of each model in `orders` (1: add-one unigram, k >= 2: interpolated
    Witten-Bell k-gram) fitted on `train`; see the module docstring for the convention. With `seq_len`,
    history resets every seq_len tokens as in `PackedSequences` (val should hold n*seq_len + 1 tokens);
    `history` gives each position's history instead (0: not predicted), e.g. windows' `stream()`."""
    kmax = max_order(vocab_size)
    if max(orders) > kmax:
        log.warning("n-gram orders above %d overflow int64 codes for vocab_size %d: using order %d",
                    kmax, vocab_size, kmax)
    orders = sorted({min(int(k), kmax) for k in orders})
    if len(val) < 2:
        raise ValueError("the validation stream needs at least 2 tokens")
    model = NgramCounts(train, vocab_size, max(orders))
    history = _history(len(val), seq_len) if history is None else np.asarray(history)
    probs = model.probs(val, history)
    predicted = history > 0
    return {model_name(k): float(np.exp(-np.mean(np.log(probs[k][predicted])))) for k in orders}


def floors_for(cfg, orders=DEFAULT_ORDERS) -> dict[str, float]:
    """N-gram floors on exactly the validation tokens a model trained with `cfg` (a composed train config)
    is evaluated on: `dm.val_dataset()`'s windows, history reset at each window's start. Cached as JSON
    under <cfg.data.cache_dir>/ngram/, keyed by the token cache, seq_len, the windows and orders."""
    import hydra

    from .data.token_cache import cache_key
    from .data.tokenizers import fingerprint

    dm = hydra.utils.instantiate(cfg.data)
    dm.prepare_data()
    val_ds = dm.val_dataset()
    seq_len, n_seqs = val_ds.seq_len, len(val_ds)
    spec = {"tokens": cache_key(dm.corpus, dm.build_tokenizer()), "seq_len": seq_len,
            "val_sequences": n_seqs, "windows": fingerprint({"starts": val_ds.starts.tolist()}),
            "orders": sorted(int(k) for k in orders), "format": FORMAT_VERSION}
    path = Path(cfg.data.cache_dir) / "ngram" / f"{fingerprint(spec)}.json"
    try:
        return json.loads(path.read_text())["perplexities"]
    except (OSError, ValueError, KeyError):
        pass
    train, (val, history) = dm.tokens["train"], val_ds.stream()
    log.info("computing n-gram floors (orders %s) for %s: %d train tokens, %d validation sequences of %d",
             spec["orders"], dm.name, len(train), n_seqs, seq_len)
    start = time.perf_counter()
    ppl = ngram_perplexities(train, val, dm.vocab_size, orders, history=history)
    seconds = time.perf_counter() - start
    log.info("n-gram floors for %s in %.1f s: %s", dm.name, seconds,
             ", ".join(f"{k} {v:.3f}" for k, v in ppl.items()))
    record = {**spec, "name": dm.name, "vocab_size": dm.vocab_size, "train_tokens": len(train),
              "seconds": round(seconds, 2), "perplexities": ppl,
              "nll": {k: math.log(v) for k, v in ppl.items()}}
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return ppl
