"""The ViT backbone of the MTTT experiments (Section 5; the ViT of Beyer et al., 2022, as in the authors'
code):

    tokens [B, n, p*p*C] -> linear embedding + learned position embedding
    -> depth x [ x + mixer(LN(x));  x + MLP(LN(x)) ]     (pre-LN blocks, GELU MLP)
    -> LN -> mean over tokens -> tanh(pre-logit dense) -> head (zero-initialised) -> logits

The image is tokenised by the data (patches of p x p pixels, p = 1: pixels); the linear embedding of a
flattened patch is the patch convolution (kernel = stride = p) of the authors. Position embeddings are
learned (the authors' pixel benchmark; the patch benchmark's fixed sin-cos would be the one prior the pixel
one drops).
The mixer is any of mixers.py, built from a Hydra partial: `mixer(d_model=..., n_heads=...)`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .mixers import MTTTLayer


class Block(nn.Module):
    def __init__(self, d_model: int, mlp_hidden: int, mixer: nn.Module):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.mixer = mixer
        self.fc1, self.fc2 = nn.Linear(d_model, mlp_hidden), nn.Linear(mlp_hidden, d_model)
        for lin in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.normal_(lin.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViTClassifier(nn.Module):
    """`mixer`: a callable (d_model, n_heads) -> module. `token_dim`, `num_tokens`, `num_classes` come from
    the data (ImageDataModule)."""

    def __init__(
        self,
        mixer,
        d_model: int,
        n_layers: int,
        n_heads: int,
        mlp_hidden: int,
        token_dim: int,
        num_tokens: int,
        num_classes: int,
        name: str = "vit",
        **_,
    ):
        super().__init__()
        self.embed = nn.Linear(token_dim, d_model)
        nn.init.xavier_uniform_(self.embed.weight)
        nn.init.zeros_(self.embed.bias)
        self.pos = nn.Parameter(torch.randn(1, num_tokens, d_model) / d_model**0.5)
        self.pos._no_weight_decay = True  # not a kernel: no weight decay, as the authors'
        self.blocks = nn.ModuleList(
            Block(d_model, mlp_hidden, mixer(d_model=d_model, n_heads=n_heads)) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.pre_logits = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        x = self.norm(x).mean(1)
        return self.head(torch.tanh(self.pre_logits(x)))

    def ttt_layers(self) -> list[MTTTLayer]:
        return [b.mixer for b in self.blocks if isinstance(b.mixer, MTTTLayer)]

    def inner_losses(self) -> torch.Tensor | None:
        """[layers, T + 1] inner losses of the last forward (see MTTTLayer), None without TTT layers."""
        layers = self.ttt_layers()
        if not layers or any(m.inner_losses is None for m in layers):
            return None
        return torch.stack([m.inner_losses for m in layers])

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (the frozen W_0 of MTTT-Linear is a buffer, not counted); `non_embedding` drops the
        position embedding, which grows with the number of tokens (the authors report it apart)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos.numel() if non_embedding else n
