"""Linear attention (Katharopoulos et al., 2020) as the mixer of a Llama-style block: Table 1's first rows.

    katharopoulos: z_t = sum_s v_s phi(k_s)^T phi(q_t) / sum_s phi(k_s)^T phi(q_t),  phi = elu + 1
    improved:      z_t = sum_s v_s k_s^T q_t  (identity phi, no normalizer; LayerNorm on the output
                   instead, the 'improved' formulation of footnote 8 and the TTT layer of Theorem 1)

Computed chunk by chunk in the recurrent form: the state S_t = sum_{s<=t} phi(k_s) v_s^T (and the
normalizer n_t = sum_{s<=t} phi(k_s)) is also the decoding cache. With `rope`, q and k are rotated before
phi, in the TTT layer's convention (adjacent pairs, absolute positions), so that Theorem 1's TTT layer with
b = T and this layer stay one function with RoPE on (Table 1, docs/ttt_layer.md).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cost import swiglu_flops
from .graphs import StaticCache
from .layers import ResidualBlock, apply_rope_pairs, rope_freqs

CHUNK = 64  # tokens per chunk of causal_linear_attention


@dataclass
class LinearAttentionCache(StaticCache):
    state: torch.Tensor | None = None  # S [B, H, f, f]
    norm: torch.Tensor | None = None  # n [B, H, 1, f]
    pos: int = 0
    position: torch.Tensor | None = None  # static (CUDA graphs, models/graphs.py): pos on the device, [1]

    def make_static(self) -> None:  # on the state's device; before any state, moved by the first call
        self.position = torch.tensor([self.pos], device=None if self.state is None else self.state.device)

    def graph_key(self):
        return self.state is None

    def advance(self, n: int) -> None:
        self.pos += n


def causal_linear_attention(q, k, v, state=None, norm=None, normalize: bool = False, chunk: int = CHUNK):
    """q, k, v [B, H, T, f] (features already mapped by phi). Returns (z, S, n) with the updated state."""
    B, H, T, f = q.shape
    state = q.new_zeros(B, H, f, v.shape[-1]) if state is None else state
    norm = q.new_zeros(B, H, 1, f) if norm is None else norm
    outs = []
    for lo in range(0, T, chunk):
        qc, kc, vc = q[:, :, lo : lo + chunk], k[:, :, lo : lo + chunk], v[:, :, lo : lo + chunk]
        a = (qc @ kc.transpose(-1, -2)).tril()  # within the chunk, s <= t
        z = qc @ state + a @ vc
        if normalize:
            z = z / (qc @ norm.transpose(-1, -2) + a.sum(-1, keepdim=True))
        outs.append(z)
        state = state + kc.transpose(-1, -2) @ vc
        norm = norm + kc.sum(-2, keepdim=True)
    return torch.cat(outs, 2), state, norm


class LinearAttention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        variant: str = "improved",
        rope: bool = False,
        rope_theta: float = 10_000.0,
    ):
        super().__init__()
        if variant not in ("katharopoulos", "improved"):
            raise ValueError(f"variant must be 'katharopoulos' or 'improved', got {variant!r}")
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.variant, self.n_heads, self.head_dim = variant, n_heads, d_model // n_heads
        self.rope, self.rope_theta = rope, rope_theta
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.post_norm = nn.LayerNorm(d_model, eps=1e-6) if variant == "improved" else None

    def forward(self, x: torch.Tensor, cache: LinearAttentionCache | None = None) -> torch.Tensor:
        B, T, D = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        start = cache.pos if cache is not None else 0
        if self.rope:  # the TTT layer's convention (adjacent pairs), so Theorem 1 holds with RoPE too
            static = cache is not None and cache.position is not None
            if static and cache.position.device != x.device:
                cache.position = cache.position.to(x.device)
            positions = torch.arange(T, device=x.device) + (cache.position if static else start)
            freqs = rope_freqs(positions, self.head_dim, self.rope_theta)
            q, k = apply_rope_pairs(q, freqs), apply_rope_pairs(k, freqs)
        if self.variant == "katharopoulos":
            q, k = F.elu(q) + 1, F.elu(k) + 1
        z, state, norm = causal_linear_attention(
            q, k, v, cache and cache.state, cache and cache.norm, normalize=self.variant == "katharopoulos"
        )
        if cache is not None:
            cache.state, cache.norm, cache.pos = state, norm, start + T
            if cache.position is not None:
                cache.position += T
        z = z.transpose(1, 2).reshape(B, T, D)
        return self.o_proj(self.post_norm(z) if self.post_norm is not None else z)

    def init_cache(self, batch_size: int, device=None, dtype=None, max_len=None) -> LinearAttentionCache:
        return LinearAttentionCache()


class LinearAttentionBlock(ResidualBlock):
    """x + LinearAttention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(
        self,
        layer_idx: int,
        d_model: int,
        n_heads: int,
        mlp_hidden: int,
        variant: str = "improved",
        rope: bool = False,
        rope_theta: float = 10_000.0,
        norm_eps: float = 1e-6,
    ):
        mixer = LinearAttention(d_model, n_heads, variant, rope, rope_theta)
        super().__init__(layer_idx, mixer, d_model, mlp_hidden, norm_eps)

    @staticmethod
    def flops_per_token(seq_len: int, d_model: int, n_heads: int, mlp_hidden: int, variant: str, **_) -> dict:
        """The Q, K, V, O projections and the MLP; across time, causal_linear_attention's chunks."""
        f = d_model // n_heads
        sizes = [min(CHUNK, seq_len - lo) for lo in range(0, seq_len, CHUNK)]
        # per chunk of c tokens and head: q k^T and a v (2 c^2 f each), q S and k^T v (2 c f^2 each)
        per_head = sum(4.0 * c * c * f + 4.0 * c * f * f for c in sizes)
        if variant == "katharopoulos":
            per_head += 2.0 * f * seq_len  # the normalizer q n^T
        return {"dense": 4 * 2.0 * d_model * d_model + swiglu_flops(d_model, mlp_hidden),
                "sequence": n_heads * per_head / seq_len}

    @staticmethod
    def state_floats(seq_len: int, d_model: int, n_heads: int, variant: str, **_) -> dict:
        """S, H x f x f (f = d_model / H), and for the Katharopoulos variant the normaliser n = sum phi(k),
        H x f (the improved variant has none)."""
        f = d_model // n_heads
        return {"S": n_heads * f * f} | ({"normaliser": n_heads * f} if variant == "katharopoulos" else {})
