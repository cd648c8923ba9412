"""Transformer++ (Mamba paper / Llama): pre-RMSNorm blocks, causal SDPA attention with RoPE, SwiGLU."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from .cost import causal_attention_flops, swiglu_flops
from .graphs import StaticCache
from .layers import ResidualBlock, apply_rope, rope_table_size, rope_tables


@dataclass
class KVCache(StaticCache):
    """The keys and values of the tokens seen, written in place into buffers preallocated by
    `Attention.init_cache`: a decoding step copies its own token, not the whole cache (concatenating would
    copy O(T^2) over T steps). Past their capacity the buffers double rather than refuse: a caller that does
    not know the final length (a prompt of any size, the decode tests) still decodes, for about one more copy
    of each token; one that knows it (generate, bench models) passes it, and no step reallocates."""

    keys: torch.Tensor  # [B, H, capacity, head_dim]; the first `length` positions hold the tokens seen
    values: torch.Tensor
    length: int = 0
    # static (CUDA graphs, models/graphs.py): `length` on the device too, [1]; a one-token step then writes
    # at it and attends over the whole capacity, the positions past it masked, so that no shape moves
    position: torch.Tensor | None = None

    def make_static(self) -> None:
        self.position = torch.tensor([self.length], device=self.keys.device)

    def graph_key(self):
        if self.length >= self.keys.shape[2]:
            raise UserError(f"the KV cache is full ({self.keys.shape[2]} tokens) and cannot grow inside a "
                            "CUDA graph: allocate it with max_len, every token it will see")
        return ()

    def advance(self, n: int) -> None:
        self.length += n

    def append_static(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write one token's key and value [B, H, 1, head_dim] at `position`: (keys, values, mask [1,
        capacity]) over the whole capacity, the mask True up to the new token."""
        self.keys.index_copy_(2, self.position, k)
        self.values.index_copy_(2, self.position, v)
        mask = (torch.arange(self.keys.shape[2], device=k.device) <= self.position)[None]
        self.position += 1
        self.length += 1
        return self.keys, self.values, mask

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the keys and values [B, H, T, head_dim] of T new tokens after the cached ones; returns those
        of every token seen, views of the buffers."""
        end = self.length + k.shape[2]
        if end > self.keys.shape[2]:
            self._grow(max(end, 2 * self.keys.shape[2]))
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        if self.position is not None:
            self.position.fill_(end)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, capacity: int) -> None:
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


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
        static = cache is not None and cache.position is not None and T == 1
        rows = cache.keys.shape[2] if static else start + T  # the positions the table must cover
        cos, sin = rope_tables(rope_table_size(rows), self.head_dim, self.rope_theta, q.dtype, x.device)
        cos, sin = (cos[cache.position], sin[cache.position]) if static else (cos[start:], sin[start:])
        cos, sin = cos[:T], sin[:T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if static:  # the whole capacity, the positions not yet written masked
            k, v, mask = cache.append_static(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, D))
        if cache is not None:
            k, v = cache.append(k, v)
        if T == 1:  # one query attends to every key there is: no mask
            y = F.scaled_dot_product_attention(q, k, v)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new queries attend to every cached key and causally among themselves
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))

    def init_cache(self, batch_size: int, device=None, dtype=None, max_len: int | None = None) -> KVCache:
        """A cache with room for max_len tokens (none allocated before the first call if not given)."""
        empty = lambda: torch.empty(batch_size, self.n_heads, max_len or 0, self.head_dim, device=device,
                                    dtype=dtype)
        return KVCache(keys=empty(), values=empty())


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

    @staticmethod
    def flops_per_token(seq_len: int, d_model: int, mlp_hidden: int, **_) -> dict:
        """The Q, K, V, O projections and the MLP; causal attention across time (cost.py)."""
        return {"dense": 4 * 2.0 * d_model * d_model + swiglu_flops(d_model, mlp_hidden),
                "sequence": causal_attention_flops(d_model, seq_len)}

    @staticmethod
    def state_floats(seq_len: int, d_model: int, **_) -> dict:
        """The KV cache, 2 x seq_len x d_model (keys and values of every token seen), growing with the
        context."""
        return {"kv_cache": 2 * seq_len * d_model}
