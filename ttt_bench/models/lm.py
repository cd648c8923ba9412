"""The language model shared by every method: embedding -> N blocks -> RMSNorm -> tied LM head.

A method is a *block* class (the config's `model.block`, a `_partial_` Hydra target called with
`layer_idx=i`). Every block implements

    forward(x: [B, T, D], cache=None) -> [B, T, D]
    init_cache(batch_size: int, device, dtype, max_len) -> cache

where `cache` is the block's own mutable decoding state (KV cache, TTT weights, SSM state...) and max_len
the most tokens it will see if known (None otherwise): a state that grows with the context (the KV cache)
is allocated to it, a constant-size one ignores it. It also says what it costs, as the static methods
`flops_per_token` and `state_floats` (cost.py).
Calling `forward` with a cache consumes T new tokens and updates the cache in place, so
`prefill(prompt)` then `step(token)` gives the same logits as one full forward pass.
Adding a method means adding a block class and a `conf/model/*.yaml`: the training code never
changes.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from .layers import RMSNorm


class LanguageModel(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        block: Callable[..., nn.Module],
        max_seq_len: int = 1 << 20,
        tie_embeddings: bool = True,
        init_std: float = 0.02,
        norm_eps: float = 1e-6,
        name: str = "lm",
    ):
        super().__init__()
        if min(vocab_size, d_model, n_layers) <= 0:
            raise ValueError(
                f"vocab_size, d_model and n_layers must be positive, got {vocab_size}, {d_model}, {n_layers}"
            )
        self.name = name
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.max_seq_len = max_seq_len
        self.init_std = init_std
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList([block(layer_idx=i) for i in range(n_layers)])
        self.norm = RMSNorm(d_model, eps=norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters(n_layers)

    def reset_parameters(self, n_layers: int) -> None:
        """GPT-2/Llama init: N(0, 0.02) for matrices, residual output projections scaled by 1/sqrt(2L).

        A block with parameters that need their own init (TTT's W0, Mamba's A and dt) defines
        `init_special_parameters()`, called after the default init.
        """
        residual_out = ("o_proj.weight", "w2.weight", "out_proj.weight")
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    self.init_std / math.sqrt(2 * n_layers) if name.endswith(residual_out) else self.init_std
                )
                nn.init.normal_(p, mean=0.0, std=std)
        for block in self.blocks:
            if hasattr(block, "init_special_parameters"):
                block.init_special_parameters()

    def forward(self, input_ids: torch.Tensor, caches: list | None = None) -> torch.Tensor:
        """Logits [B, T, V] for token ids [B, T]. With `caches`, continue from the cached state."""
        x = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i])
        return self.lm_head(self.norm(x))

    def init_caches(self, batch_size: int, device=None, dtype=None, max_len: int | None = None) -> list:
        device = device or self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        return [block.init_cache(batch_size, device=device, dtype=dtype, max_len=max_len)
                for block in self.blocks]

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n
