"""Analytic FLOPs (ttt_bench/flops.py) against torch.utils.flop_counter on small models, and matched FLOPs."""

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ttt_bench.config import REPO_ROOT, compose
from ttt_bench.flops import SCAN_FLOPS_PER_STATE, flops_per_token, match_flops

VOCAB = 257

CASES = {
    "transformer": ["model=transformer"],
    "linear_attention_katharopoulos": ["model=linear_attention", "model.block.variant=katharopoulos"],
    "ttt_linear": ["model=ttt_linear"],
    "ttt_linear_transformer_backbone": ["model=ttt_linear", "model.block.backbone=transformer"],
    "ttt_linear_b4_primal": ["model=ttt_linear", "model.block.mini_batch_size=4", "model.block.form=primal"],
    "ttt_mlp": ["model=ttt_mlp"],
    "mamba": ["model=mamba", "model.block.backend=torch"],
}


def model_cfg(overrides: list[str], seq_len: int) -> dict:
    name = overrides[0].split("=")[1]
    if not (REPO_ROOT / "conf" / "model" / f"{name}.yaml").is_file():
        pytest.skip(f"conf/model/{name}.yaml does not exist yet")
    cfg = compose("train", ["size=xs", f"data.seq_len={seq_len}", *overrides])
    return OmegaConf.to_container(cfg.model, resolve=True)


def measure(model, x) -> float:
    """Forward + backward FLOPs per token counted by FlopCounterMode, with three corrections: attention
    runs on the math backend (CPU's fused kernel is not in the counter's registry), in-place baddbmm_ (the
    dual scans' accumulations) is counted as baddbmm, and the backward of a depthwise conv is counted as
    twice its forward (the counter's formula ignores groups, overcounting by the width)."""
    in_place = {torch.ops.aten.baddbmm_: lambda _, a, b, *args, **kwargs: 2 * a[0] * a[1] * a[2] * b[2]}
    with FlopCounterMode(display=False, custom_mapping=in_place) as counter, sdpa_kernel(SDPBackend.MATH):
        model(x).sum().backward()
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    conv = ops.get("aten.convolution", 0)
    return (counter.get_total_flops() - ops.get("aten.convolution_backward", 0) + 2 * conv) / x.numel()


@pytest.mark.parametrize("case", CASES)
def test_train_flops_match_flop_counter(case):
    """The analytic training FLOPs per token are within 10% of FlopCounterMode's count. Of Mamba's 9 E N scan
    FLOPs the counter only sees y = C h (2 E N, a bmm): the rest is elementwise."""
    seq_len = 64
    cfg = model_cfg(CASES[case], seq_len)
    torch.manual_seed(0)
    measured = measure(instantiate(cfg, vocab_size=VOCAB), torch.randint(0, VOCAB, (1, seq_len)))
    analytic = flops_per_token(cfg, seq_len, VOCAB)
    expected = analytic["train"] - 3 * analytic["scan"] * (SCAN_FLOPS_PER_STATE - 2) / SCAN_FLOPS_PER_STATE
    assert measured == pytest.approx(expected, rel=0.10), (case, analytic)


def test_attention_term_grows_with_context_and_ttt_does_not():
    for name, grows in (("transformer", True), ("ttt_linear", False), ("mamba", False)):
        short, long = (
            flops_per_token(model_cfg([f"model={name}"], T), T, VOCAB)["train"] for T in (512, 4096)
        )
        assert (long > 1.5 * short) == grows, name


def test_matched_flops_reproduce_appendix_c():
    """Appendix C: to match Mamba 1.4B, TTT-Linear's MLP goes 5504 -> 5808 and TTT-MLP's 5504 -> 5248."""
    reference = OmegaConf.to_container(
        compose("train", ["model=mamba", "size=1.3b", "data.seq_len=2048"]).model, resolve=True
    )
    for name, paper in (("ttt_linear", 5808), ("ttt_mlp", 5248)):
        cfg = OmegaConf.to_container(
            compose("train", [f"model={name}", "size=1.3b", "data.seq_len=2048"]).model, resolve=True
        )
        overrides, ratio = match_flops(cfg, reference, 2048, 32000, by="width")
        assert overrides["model.block.mlp_hidden"] == pytest.approx(paper, rel=0.02), name
        assert ratio == pytest.approx(1.0, abs=0.01)
    tf = OmegaConf.to_container(
        compose("train", ["model=transformer", "size=1.3b", "data.seq_len=2048"]).model, resolve=True
    )
    overrides, ratio = match_flops(tf, reference, 2048, 32000, by="depth")
    assert overrides["model.n_layers"] < 24 and ratio == pytest.approx(1.0, abs=0.05)
