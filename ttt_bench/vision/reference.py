"""Naive references for the inner loop of `MTTTLayer`, slow and obvious, for tests/test_mttt.py.

- `per_token_inner_gradient`: grad_W l(W; X) for one example and one head as the mean of per-token
  gradients, each from its own loss 1/(2 d_h) ||LN_dec(g(f(phi x_i; W))) - x_i||^2 (Eq. 1 is their mean), one
  token at a time, written with plain tensors (no einsum over heads or examples).
- `linear_inner_gradient`: the closed form for MTTT-Linear without Decoder LN (Eq. 9-10):
      grad_W = 1/(n d_h) sum_i phi_i^T (phi_i W G + g_b - x_i) G^T
  (row vectors, f(x) = x W, g(y) = y G + g_b)
"""

import torch
import torch.nn.functional as F

from .mixers import MTTTLayer


def _head_params(layer: MTTTLayer, h: int) -> dict:
    p = {
        "phi_w": layer.phi.weight[h],
        "phi_b": layer.phi.bias[h],
        "g_w": layer.g.weight[h],
        "g_b": layer.g_bias,
    }
    if layer.decoder_ln:
        p["ln_w"], p["ln_b"] = layer.ln_weight[h], layer.ln_bias[h]
    return p


def _f(layer: MTTTLayer, z: torch.Tensor, W: dict) -> torch.Tensor:
    y = z @ W["w1"] + W.get("b1", 0)
    if layer.encoder == "mlp":
        y = F.gelu(y) @ W["w2"] + W.get("b2", 0)
    return y


def per_token_inner_gradient(layer: MTTTLayer, x: torch.Tensor, W: dict, h: int) -> dict:
    """x [n, d] one image's tokens; W the weights of head h (unbatched: w1 [d_h, .], b1 [.], ...)."""
    p = _head_params(layer, h)
    n, dh = x.shape[0], layer.dh
    total = {k: torch.zeros_like(w) for k, w in W.items()}
    for i in range(n):
        Wi = {k: w.detach().clone().requires_grad_(True) for k, w in W.items()}
        z = x[i] @ p["phi_w"] + p["phi_b"]
        y = _f(layer, z, Wi) @ p["g_w"] + p["g_b"]
        if layer.decoder_ln:
            y = (y - y.mean()) / torch.sqrt(y.var(unbiased=False) + 1e-5) * p["ln_w"] + p["ln_b"]
        loss = 0.5 * ((y - x[i]) ** 2).sum() / dh
        for k, g in zip(Wi, torch.autograd.grad(loss, list(Wi.values()))):
            total[k] += g / n
    return total


def linear_inner_gradient(layer: MTTTLayer, x: torch.Tensor, W: torch.Tensor, h: int) -> torch.Tensor:
    """Closed form for encoder='linear', no inner bias, no Decoder LN: x [n, d], W [d_h, d_h]."""
    p = _head_params(layer, h)
    phi = x @ p["phi_w"] + p["phi_b"]  # [n, d_h]
    residual = phi @ W @ p["g_w"] + p["g_b"] - x  # [n, d]
    return phi.T @ residual @ p["g_w"].T / (x.shape[0] * layer.dh)
