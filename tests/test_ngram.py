import json
import math
import time

import numpy as np
import pytest

from ttt_bench.config import compose
from ttt_bench.data.datamodule import PackedSequences
from ttt_bench.ngram import NgramCounts, _history, floors_for, ngram_perplexities


def markov_stream(n: int, vocab: int, order: int, seed: int) -> np.ndarray:
    """A stream whose next token depends on the `order` previous ones through peaked random transitions."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(vocab, 0.2), size=vocab**order).cumsum(axis=1)
    out = list(rng.integers(0, vocab, order))
    u = rng.random(n)
    for i in range(n):
        ctx = 0
        for t in out[-order:]:
            ctx = ctx * vocab + t
        out.append(min(int(np.searchsorted(table[ctx], u[i])), vocab - 1))
    return np.array(out[order:], dtype=np.uint8)


def test_every_order_is_normalised():
    vocab = 5
    train = markov_stream(400, vocab, 2, seed=0)
    model = NgramCounts(train, vocab, order=5)
    rng = np.random.default_rng(1)
    contexts = [[], [0], [1, 2], [4, 4, 4], [0, 1, 2, 3]]
    contexts += [list(rng.integers(0, vocab, 4)) for _ in range(20)]
    contexts += [list(train[i - m : i]) for i, m in [(10, 4), (200, 4), (399, 4), (400, 4), (50, 3), (7, 2)]]
    for ctx in contexts:
        m = len(ctx)
        tokens = np.concatenate([ctx + [w] for w in range(vocab)])
        history = np.tile(np.arange(m + 1), vocab)
        probs = model.probs(tokens, history)
        last = np.arange(vocab) * (m + 1) + m
        for k, p in probs.items():
            assert p[last].sum() == pytest.approx(1.0, abs=1e-12), (ctx, k)
            assert (p[last] > 0).all()


def test_unigram_and_bigram_match_hand_computation():
    train = np.array([0, 1, 0, 1, 1])  # c(0)=2 c(1)=3 c(2)=0; bigrams 01 x2, 10, 11
    val = np.array([0, 1, 2, 1])  # predicts 1|0, 2|1, 1|2
    ppl = ngram_perplexities(train, val, vocab_size=3, orders=(1, 2))
    # unigram (c+1)/(5+3): P(1)=4/8, P(2)=1/8
    assert ppl["unigram"] == pytest.approx((0.5 * 0.125 * 0.5) ** (-1 / 3))
    # Witten-Bell: P(1|0) = (2 + 1*4/8)/(2+1); P(2|1) = (0 + 2*1/8)/(2+2); context 2 unseen -> P1(1)
    assert ppl["bigram"] == pytest.approx((2.5 / 3 * (0.25 / 4) * 0.5) ** (-1 / 3))


def test_history_resets_like_packed_sequences():
    tokens, seq_len = np.arange(3 * 4 + 1), 4
    ds = PackedSequences(tokens, seq_len)
    expected = np.zeros(len(tokens), dtype=int)
    for i in range(len(ds)):
        seq = ds[i].numpy()
        expected[seq[1:]] = np.arange(1, seq_len + 1)  # token value = its position in the stream
    np.testing.assert_array_equal(_history(len(tokens), seq_len), expected)
    np.testing.assert_array_equal(_history(5, None), np.arange(5))


def test_periodic_text_is_predictable_for_the_5gram():
    text = np.frombuffer(b"the cat sat on a mat. " * 500, dtype=np.uint8)
    ppl = ngram_perplexities(text, text[7:3000], vocab_size=257, orders=(1, 2, 5))
    assert ppl["5-gram (Witten-Bell)"] < 1.02
    assert ppl["unigram"] > 8
    # with history reset every 8 tokens the 5-gram still sees >= 4 tokens for most positions
    short = ngram_perplexities(text, text[7:3000], vocab_size=257, orders=(5,), seq_len=8)
    assert ppl["5-gram (Witten-Bell)"] < short["5-gram (Witten-Bell)"] < 1.5


def test_orders_are_monotone_on_a_markov_chain():
    stream = markov_stream(120_000, vocab=6, order=3, seed=2)
    ppl = ngram_perplexities(stream[:100_000], stream[100_000:], vocab_size=6, orders=(1, 2, 3, 5))
    assert ppl["5-gram (Witten-Bell)"] <= ppl["3-gram (Witten-Bell)"] <= ppl["bigram"] <= ppl["unigram"]
    assert ppl["5-gram (Witten-Bell)"] < 0.9 * ppl["bigram"]


def test_large_vocab_lowers_the_order():
    stream = np.random.default_rng(0).integers(0, 70_000, 1000)
    ppl = ngram_perplexities(stream, stream[:100], vocab_size=70_000, orders=(1, 2, 5))
    assert list(ppl) == ["unigram", "bigram", "3-gram (Witten-Bell)"]  # 70000^4 overflows int64
    with pytest.raises(ValueError):
        ngram_perplexities(stream, stream[:100], vocab_size=100)


def test_floors_for_synthetic_is_cached(tmp_path):
    overrides = ["data=synthetic", "data.corpus.train_docs=20", "data.corpus.validation_docs=4",
                 "data.seq_len=64", "data.num_proc=1", f"paths.cache={tmp_path}"]
    cfg = compose("train", [*overrides, "data.val_tokens=4096"])
    floors = floors_for(cfg)
    assert list(floors) == ["unigram", "bigram", "5-gram (Witten-Bell)"]
    assert floors["5-gram (Witten-Bell)"] < floors["bigram"] < floors["unigram"] < 257
    files = list((tmp_path / "ngram").glob("*.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["seq_len"] == 64 and record["val_sequences"] == 4096 // 64
    start = time.perf_counter()
    assert floors_for(cfg) == floors
    assert time.perf_counter() - start < 1.0
    # another validation span is another cache entry
    other = floors_for(compose("train", [*overrides, "data.val_tokens=2048"]))
    assert other != floors and len(list((tmp_path / "ngram").glob("*.json"))) == 2


@pytest.mark.slow
def test_pile_mini_floors_have_the_known_scale(shared_data, tmp_path):
    cfg = compose("train", ["data=pile", f"paths.data_dir={shared_data}", f"paths.cache={tmp_path}",
                            "data.seq_len=2048", "data.val_tokens=1048576"])
    floors = floors_for(cfg, orders=(1, 2, 3))
    assert 11.5 < floors["bigram"] < 15  # ~13.1 on the whole validation text
    assert 6.8 < floors["3-gram (Witten-Bell)"] < 8.8  # ~7.7
    assert math.isfinite(floors["unigram"]) and floors["unigram"] > floors["bigram"]
