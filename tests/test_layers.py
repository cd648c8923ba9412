"""Shared building blocks against their PyTorch references: the causal conv (the op kernels/conv.py: conv2d on
a channels-last view with its own backward, causal-conv1d's CUDA kernel on a GPU) vs F.conv1d, the
complex-number RoPE of the TTT layer vs the rotation written out, RMSNorm vs its formula (float64)."""

import random

import pytest
import torch
import torch.nn.functional as F
from ttt_bench.kernels import conv

from tests.conftest import rel_err
from ttt_bench.models import layers
from ttt_bench.models.layers import (
    CausalConv1d,
    RMSNorm,
    apply_rope,
    apply_rope_pairs,
    rope_cos_sin,
    rope_freq_table,
    rope_freqs,
    rope_table_size,
    rope_tables,
)

pytestmark = pytest.mark.usefixtures("float64_one_thread")


@pytest.mark.parametrize("direct", [False, True], ids=["conv2d", "direct"])
@pytest.mark.parametrize("seed", range(4))
def test_causal_conv_equals_conv1d_in_one_call_and_in_pieces(seed, direct, monkeypatch):
    monkeypatch.setattr(layers, "DIRECT_MAX_TOKENS", 10**9 if direct else 0)  # a few tokens, or conv2d
    rng = random.Random(seed)
    for _ in range(5):
        B, T, C, k = rng.randint(1, 3), rng.randint(1, 24), rng.randint(1, 6), rng.randint(1, 5)
        torch.manual_seed(rng.randint(0, 10**6))
        conv = CausalConv1d(C, k, bias=rng.random() < 0.8)
        params = [p for p in (conv.weight, conv.bias) if p is not None]
        x = torch.randn(B, T, C, requires_grad=True)
        ref = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), conv.weight, conv.bias, groups=C).transpose(1, 2)
        y, _ = conv(x)
        assert rel_err(y, ref) <= 1e-12
        dy = torch.randn_like(y)
        for a, b in zip(torch.autograd.grad(y, [x, *params], dy),
                        torch.autograd.grad(ref, [x, *params], dy, retain_graph=True), strict=True):
            assert rel_err(a, b) <= 1e-12
        cut = rng.randint(0, T)  # decoding: the state carries the last k - 1 inputs over
        y1, state = conv(x[:, :cut])
        y2, _ = conv(x[:, cut:], state)
        assert rel_err(torch.cat([y1, y2], 1), ref) <= 1e-12
        for a, b in zip(torch.autograd.grad(torch.cat([y1, y2], 1), [x, *params], dy),  # through the state
                        torch.autograd.grad(ref, [x, *params], dy), strict=True):
            assert rel_err(a, b) <= 1e-12


def test_the_conv_op_names_its_backends():
    x, weight = torch.randn(1, 5, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        conv.causal_conv1d(x, weight, None, backend="triton")
    with pytest.raises(RuntimeError, match="CUDA input"):
        conv.causal_conv1d(x, weight, None, backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available() or conv._causal_conv1d_fn() is None,
                    reason="needs a CUDA GPU and causal-conv1d")
def test_causal_conv1d_backend_matches_torch_on_a_gpu():
    """causal-conv1d's kernel on a view into a fused projection (as the TTT layer passes it), float32:
    outputs and gradients against the torch backend."""
    torch.manual_seed(0)
    fused = torch.randn(2, 300, 3 * 768, device="cuda", dtype=torch.float32)
    x = fused[..., 768 : 2 * 768].requires_grad_()
    weight, bias = (torch.randn(*s, device="cuda", requires_grad=True) for s in ((768, 4), (768,)))
    runs = [conv.causal_conv1d(x, weight, bias, backend=b) for b in ("cuda", "torch")]
    dy = torch.randn_like(runs[0])
    grads = [torch.autograd.grad(y, (x, weight, bias), dy) for y in runs]
    assert rel_err(runs[0], runs[1]) <= 1e-5
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) <= 1e-4


def test_rope_pairs_rotate_adjacent_pairs():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 8).transpose(1, 2)  # [B, H, T, f], strided as the layer's views are
    positions = torch.arange(7) % 4
    cos, sin = rope_cos_sin(positions, 8, 10_000.0, torch.float64)
    x1, x2, c, s = x[..., 0::2], x[..., 1::2], cos[:, :4], sin[:, :4]
    ref = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
    assert rel_err(apply_rope_pairs(x, rope_freqs(positions, 8, 10_000.0)), ref) <= 1e-14


def test_rope_tables_are_the_positions_rows_and_serve_training_after_decoding():
    """The cached tables (a decoding step reads its rows) hold rope_cos_sin / rope_freqs of every position,
    bitwise; sized in powers of two from 2048; made in inference mode (decoding), they still train."""
    assert [rope_table_size(n) for n in (1, 2048, 2049, 5000)] == [2048, 2048, 4096, 8192]
    with torch.inference_mode():
        cos, sin = rope_tables(2048, 8, 10_000.0, torch.float32, torch.device("cpu"))
        freqs = rope_freq_table(16, 8, 10_000.0, torch.device("cpu"))
    positions = torch.tensor([0, 5, 2047])
    for table, row in zip((cos, sin), rope_cos_sin(positions, 8, 10_000.0, torch.float32), strict=True):
        assert torch.equal(table[positions], row)
    assert torch.equal(freqs[3:9], rope_freqs(torch.arange(3, 9), 8, 10_000.0))
    x = torch.randn(2, 3, 8, requires_grad=True)
    (apply_rope(x, cos[:3], sin[:3]).sum() + apply_rope_pairs(x, freqs[:3]).sum()).backward()
    assert x.grad is not None


def test_rms_norm_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    assert rel_err(norm(x), ref) <= 1e-14
