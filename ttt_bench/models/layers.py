"""Building blocks shared by every model: RMSNorm, rotary embeddings, SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos/sin tables of rotary embeddings (Su et al.) for integer `positions` of shape [T]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    )
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, head_dim] by the Llama 'rotate half' convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SwiGLU(nn.Module):
    """Llama MLP block: W2 (silu(W1 x) * W3 x), no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ResidualBlock(nn.Module):
    """The Llama block around a token mixer: x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).

    The mixer (attention, linear attention, ...) owns its decoding cache: `mixer.init_cache(...)`.
    """

    def __init__(
        self, layer_idx: int, mixer: nn.Module, d_model: int, mlp_hidden: int, norm_eps: float = 1e-6
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(d_model, norm_eps)
        self.attn = mixer
        self.mlp_norm = RMSNorm(d_model, norm_eps)
        self.mlp = SwiGLU(d_model, mlp_hidden)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))

    def init_cache(self, batch_size: int, device=None, dtype=None):
        return self.attn.init_cache(batch_size, device, dtype)
