"""Validation windows drawn across every document (data/windows.py), their n-gram floors, and the
bootstrap standard error of the validation loss over documents (training/evaluate.py)."""

import numpy as np
import torch

from ttt_bench.data.windows import ValidationWindows, allocate, document_starts
from ttt_bench.ngram import ngram_perplexities
from ttt_bench.training.evaluate import document_bootstrap_se, evaluate

EOS = 9


def stream(lengths, seed=0):
    """Documents of the given lengths (tokens 0-8) each followed by EOS."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.append(rng.integers(0, 9, n), EOS) for n in lengths]).astype(np.uint16)


def test_every_document_contributes_in_proportion_to_its_length():
    tokens = stream([5000, 40, 40, 900, 60])
    ds = ValidationWindows.drawn(tokens, seq_len=16, n=64, eos_id=EOS)
    assert len(ds) == 64
    counts = np.bincount(ds.documents, minlength=5)
    assert (counts >= 1).all() and counts[0] > counts[3] > counts[1]
    starts = document_starts(tokens, EOS)
    ends = np.append(starts[1:], len(tokens))
    for s, d in zip(ds.starts, ds.documents, strict=True):
        assert starts[d] <= s < ends[d]  # a window starts inside its document
        assert len(ds[int(np.flatnonzero(ds.starts == s)[0])]) == 17


def test_windows_are_fixed_whatever_the_run():
    tokens = stream([3000, 200, 700])
    a = ValidationWindows.drawn(tokens, 32, 20, EOS)
    b = ValidationWindows.drawn(tokens, 32, 20, EOS)
    np.testing.assert_array_equal(a.starts, b.starts)
    assert not np.array_equal(a.starts, ValidationWindows.drawn(tokens, 32, 20, EOS, seed=1).starts)


def test_allocation_with_fewer_windows_than_documents():
    counts = allocate(np.array([10, 10, 10, 10]), 2, np.random.default_rng(0))
    assert counts.sum() == 2 and counts.max() == 1
    assert allocate(np.array([30, 10]), 4, np.random.default_rng(0)).tolist() == [3, 1]


def test_packed_is_the_whole_split_end_to_end():
    tokens = stream([50, 30, 20])
    ds = ValidationWindows.packed(tokens, 10, EOS)
    assert len(ds) == (len(tokens) - 1) // 10
    np.testing.assert_array_equal(torch.cat([ds[i][:-1] for i in range(len(ds))]).numpy(),
                                  tokens[: len(ds) * 10])
    assert ds.documents.tolist()[:6] == [0, 0, 0, 0, 0, 0] and ds.documents[-1] == 2


def test_the_floors_read_the_windows_with_their_own_history():
    """The floors of windows end to end equal the floors of each window alone, pooled."""
    train, val = stream([4000], seed=1), stream([300, 300], seed=2)
    ds = ValidationWindows.drawn(val, 8, 12, EOS)
    tokens, history = ds.stream()
    pooled = ngram_perplexities(train, tokens, 10, orders=(1, 3), history=history)
    nll = {k: [] for k in ("unigram", "3-gram (Witten-Bell)")}
    for i in range(len(ds)):
        one = ngram_perplexities(train, ds[i].numpy(), 10, orders=(1, 3), seq_len=8)
        for k in nll:
            nll[k].append(np.log(one[k]) * 8)
    for k in nll:
        np.testing.assert_allclose(pooled[k], np.exp(np.sum(nll[k]) / (8 * len(ds))), rtol=1e-10)


def test_the_bootstrap_error_shrinks_with_more_documents_and_needs_two():
    rng = np.random.default_rng(0)

    def se(n_docs):
        loss = rng.normal(2.0, 0.3, n_docs)
        sums = np.stack([loss * 100, np.full(n_docs, 100.0)], 1)
        return document_bootstrap_se(sums, np.arange(n_docs))

    few, many = se(8), se(800)
    assert 0 < many < few and abs(many - 0.3 / np.sqrt(800)) < 0.003
    assert np.isnan(document_bootstrap_se(np.ones((3, 2)), np.zeros(3)))


def test_evaluate_reports_the_error_over_documents():
    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(10))

        def forward(self, x):
            return self.w.expand(*x.shape, 10)

    ds = ValidationWindows.drawn(stream([400, 400, 400]), 16, 9, EOS)
    result = evaluate(Uniform(), ds, batch_size=4)
    assert abs(result["val_loss"] - np.log(10)) < 1e-6 and result["val_loss_se"] < 1e-6
