"""Linear attention: both variants against their formulas and Theorem 1 at the layer level (decoding:
tests/test_models.py)."""


import pytest
import torch
import torch.nn.functional as F

from ttt_bench.models.linear_attention import LinearAttention
from ttt_bench.models.ttt import TTTLayer

pytestmark = pytest.mark.usefixtures("float64_one_thread")


def test_katharopoulos_matches_formula():
    torch.manual_seed(0)
    layer = LinearAttention(8, 2, "katharopoulos")
    x = torch.randn(2, 70, 8)  # longer than one chunk
    B, T, H, f = 2, 70, 2, 4
    heads = lambda t: t.view(B, T, H, f).transpose(1, 2)
    q, k, v = F.elu(heads(layer.q_proj(x))) + 1, F.elu(heads(layer.k_proj(x))) + 1, heads(layer.v_proj(x))
    a = (q @ k.transpose(-1, -2)).tril()  # phi(q_t) . phi(k_s), s <= t
    z = (a @ v) / a.sum(-1, keepdim=True)
    assert torch.allclose(layer(x), layer.o_proj(z.transpose(1, 2).reshape(B, T, H * f)), atol=1e-12)


def test_theorem_1_ttt_layer_equals_improved_linear_attention():
    """TTT layer with f(x) = xW, W_0 = 0, batch GD, fixed eta and no token scaling == linear attention."""
    torch.manual_seed(0)
    d, H, T = 12, 3, 10
    la = LinearAttention(d, H, "improved")
    ttt = TTTLayer(
        d,
        H,
        mini_batch_size=T,
        ln_residual=False,
        inner_bias=False,
        learnable_w0=False,
        learnable_lr=False,
        token_scaling="none",
        rope=False,
        eta_base=d // H,
    )  # eta = 1 for l/2
    ttt.load_state_dict(la.state_dict(), strict=False)
    x = torch.randn(2, T, d)
    assert torch.allclose(ttt(x), la(x), atol=1e-12)
