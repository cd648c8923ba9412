"""Linear attention: both variants against their formulas, decoding, and Theorem 1 at the layer level."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from ttt_bench.models.linear_attention import LinearAttention, LinearAttentionBlock
from ttt_bench.models.lm import LanguageModel
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


@pytest.mark.parametrize("variant", ["katharopoulos", "improved"])
def test_decode_equals_full_forward(variant):
    torch.manual_seed(0)
    model = LanguageModel(
        50,
        16,
        2,
        partial(LinearAttentionBlock, d_model=16, n_heads=2, mlp_hidden=32, variant=variant, rope=True),
    )
    ids = torch.randint(0, 50, (2, 9))
    caches = model.init_caches(2)
    out = torch.cat([model(ids[:, :5], caches)] + [model(ids[:, t : t + 1], caches) for t in range(5, 9)], 1)
    assert torch.allclose(out, model(ids), atol=1e-10)


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
