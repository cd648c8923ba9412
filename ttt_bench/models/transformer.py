"""Transformer++ (Mamba paper / Llama): pre-RMSNorm blocks, causal SDPA attention with RoPE, SwiGLU."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ResidualBlock, apply_rope, rope_cos_sin


@dataclass
class KVCache:
    k: torch.Tensor  # [B, H, T_seen, head_dim]
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[2]


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, rope_theta: float = 10_000.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.n_heads, self.head_dim, self.rope_theta = n_heads, d_model // n_heads, rope_theta
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, D = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        start = cache.length if cache is not None else 0
        cos, sin = rope_cos_sin(
            torch.arange(start, start + T, device=x.device), self.head_dim, self.rope_theta, q.dtype
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.k, cache.v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
            k, v = cache.k, cache.v
        if start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new queries attend to every cached key and causally among themselves
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))

    def init_cache(self, batch_size: int, device=None, dtype=None) -> KVCache:
        empty = torch.empty(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(k=empty, v=empty.clone())


class TransformerBlock(ResidualBlock):
    """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(
        self,
        layer_idx: int,
        d_model: int,
        n_heads: int,
        mlp_hidden: int,
        rope_theta: float = 10_000.0,
        norm_eps: float = 1e-6,
    ):
        super().__init__(layer_idx, Attention(d_model, n_heads, rope_theta), d_model, mlp_hidden, norm_eps)
