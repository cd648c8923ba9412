"""Same function as the authors' code (test-time-training/ttt-lm-pytorch, ttt.py), given the same weights.

Set TTT_LM_PYTORCH to a directory holding their ttt.py (it needs the `transformers` package) to run it.
"""

import importlib
import os
import sys
from functools import partial

import pytest
import torch

from ttt_bench.models.lm import LanguageModel
from ttt_bench.models.ttt import TTTBlock
from ttt_bench.models.ttt.convert import authors_config, from_authors, to_authors

REF = os.environ.get("TTT_LM_PYTORCH")
pytestmark = pytest.mark.skipif(
    not REF,
    reason="set TTT_LM_PYTORCH to a directory containing the authors' ttt.py (ttt-lm-pytorch) to compare",
)


def authors_module():
    pytest.importorskip("transformers", reason="the authors' ttt.py needs the transformers package")
    sys.path.insert(0, REF)
    try:
        return importlib.import_module("ttt")
    finally:
        sys.path.remove(REF)


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def compare(learner: str, backbone: str, **flags) -> tuple:
    """Their model with random weights and ours loaded from it: the logits of both on two mini-batches and
    a remainder, and both models."""
    ttt = authors_module()
    torch.manual_seed(0)
    size = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, mlp_hidden=128)
    eta_base = 1.0 if learner == "linear" else 0.1
    theirs = ttt.TTTForCausalLM(
        ttt.TTTConfig(
            **authors_config(
                **size, learner=learner, backbone=backbone, mini_batch_size=16, eta_base=eta_base, **flags
            )
        )
    ).eval()
    with torch.no_grad():  # every parameter off its init, so that each one matters
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn_like(p))
    block = partial(
        TTTBlock, d_model=64, n_heads=4, mlp_hidden=128, backbone=backbone, learner=learner,
        eta_base=eta_base, **flags,
    )
    ours = LanguageModel(97, 64, 2, block).eval()
    missing, unexpected = ours.load_state_dict(from_authors(theirs.state_dict()), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied to the embedding

    ids = torch.randint(0, 97, (2, 45))  # two mini-batches and a remainder
    with torch.no_grad():
        expected = logits_of(theirs(input_ids=ids))
        got = ours(ids)
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"{learner}/{backbone} {flags}: max rel err {err:.2e}")
    assert err <= 1e-4
    return ids, expected, theirs, ours


@pytest.mark.parametrize(
    "flags",
    [dict(pre_conv=True, share_qk=False, use_gate=False), dict(pre_conv=False, share_qk=True, use_gate=False),
     dict(pre_conv=False, share_qk=False, use_gate=True), dict(pre_conv=True, share_qk=True, use_gate=False)],
    ids=lambda f: "-".join(k for k, v in f.items() if v),
)
def test_the_authors_flags_are_independent(flags):
    """pre_conv, share_qk and use_gate are independent in their TTTConfig (the backbone only sets their
    defaults); any mix is the same function as theirs."""
    compare("linear", "transformer", **flags)


@pytest.mark.parametrize("learner", ["linear", "mlp"])
@pytest.mark.parametrize("backbone", ["mamba", "transformer"])
def test_same_logits_as_authors_code(learner, backbone):
    ids, expected, theirs, ours = compare(learner, backbone)
    back = to_authors(ours.state_dict())  # and the other direction
    theirs.load_state_dict({k: v for k, v in back.items() if k in theirs.state_dict()})
    with torch.no_grad():
        assert torch.allclose(logits_of(theirs(input_ids=ids)), expected)
