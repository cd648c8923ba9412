"""The long-range fact metric: which bytes are recallable facts, their distances, and the loss bins."""

import math

import pytest
import torch

from ttt_bench.data.synthetic import SyntheticLanguage, generate_document
from ttt_bench.experiments.longrange import code_digits, fact_recall


@pytest.fixture(scope="module")
def document() -> str:
    return generate_document(
        SyntheticLanguage(seed=0, vocab=256), seed=0, split="validation", index=0, mean_bytes=6000
    )


def test_restated_digits_repeat_their_first_mention(document):
    data = document.encode()
    restated, firsts = code_digits(data)
    assert restated and firsts and len(firsts) % 8 == 0
    for p, dist in restated.items():
        assert chr(data[p]).isdigit() and data[p] == data[p - dist] and dist > 0
        assert p - dist in firsts  # the same digit of the fact's first mention


class Uniform(torch.nn.Module):
    """Every byte equally likely: loss ln 257 everywhere."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.p.expand(*x.shape, 257) * 0


def test_fact_recall_bins_every_restated_digit_in_or_beyond_the_window(document):
    restated, firsts = code_digits(document.encode())
    long = fact_recall(Uniform(), [document], seq_len=len(document.encode()))
    short = fact_recall(Uniform(), [document], seq_len=64)
    for df in (long, short):
        assert df["loss"].tolist() == pytest.approx([math.log(257)] * len(df))
        assert df.loc[df["kind"] == "restated", "n"].sum() == len(restated)
        assert df.loc[df["kind"] == "first mention", "n"].sum() == len(firsts)
    assert long.loc[long["kind"] == "restated", "in_context"].all()  # one window holds the whole document
    beyond = short[(short["kind"] == "restated") & ~short["in_context"]]
    assert beyond["n"].sum() > 0 and set(beyond["distance"]) - {"0-256"}  # far mentions fall outside 64 bytes
