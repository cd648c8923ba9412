"""Building blocks shared by every model: RMSNorm, rotary embeddings, SwiGLU MLP."""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import conv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # in float32 at least, whatever the dtype of x
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(dtype), x.shape[-1:], self.weight.to(dtype), self.eps).type_as(x)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Rotary embedding angles (Su et al.) p theta^(-2j/d) for integer `positions` [T]: [T, head_dim / 2],
    float64."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    )
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos/sin tables of the 'rotate half' convention, [T, head_dim]."""
    angles = rope_angles(positions, head_dim, theta).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_freqs(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The rotations as unit complex numbers exp(i angle), [T, head_dim / 2] (complex128)."""
    angles = rope_angles(positions, head_dim, theta)
    return torch.polar(torch.ones_like(angles), angles)


def rope_table_size(n: int) -> int:
    """Rows of a RoPE table that covers positions 0..n-1: a power of two from 2048, so that a growing context
    makes a few tables, not one a step."""
    return max(2048, 1 << (n - 1).bit_length())


@functools.cache  # never evicted: a captured CUDA graph may read a table (a few tables, powers of two)
def rope_tables(n: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device):
    """rope_cos_sin of positions 0..n-1, [n, head_dim] each, made once per (n, head_dim, theta, dtype,
    device): a step reads its rows (a slice, or an index on the device under CUDA graphs) instead of
    launching the dozen small kernels that compute them. Outside inference mode, so that training can use a
    table first made while decoding."""
    with torch.inference_mode(False):
        return rope_cos_sin(torch.arange(n, device=device), head_dim, theta, dtype)


@functools.cache
def rope_freq_table(n: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """rope_freqs of positions 0..n-1 (the TTT layer's positions within a mini-batch), made once, as
    rope_tables."""
    with torch.inference_mode(False):
        return rope_freqs(torch.arange(n, device=device), head_dim, theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, head_dim] by the Llama 'rotate half' convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE rotating adjacent pairs (x_2i, x_2i+1), the convention of the authors' JAX (EasyLM) code: each
    pair is a complex number, multiplied by its rotation in `freqs` (layers.rope_freqs), in float32 or
    float64."""
    real = x.to(torch.promote_types(x.dtype, torch.float32))
    # a complex view needs pairs contiguous and every other stride even (a view into a fused projection of
    # odd width is copied)
    strided = real.stride(-1) != 1 or any(st % 2 for st in real.stride()[:-1])
    real = real.contiguous() if strided else real
    pairs = torch.view_as_complex(real.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * freqs.to(pairs.dtype)).flatten(-2).type_as(x)


DIRECT_MAX_TOKENS = 32  # up to B * T tokens (decoding), CausalConv1d takes k products: conv2d costs ~60 us


class CausalConv1d(nn.Conv1d):
    """Depthwise temporal convolution over [B, T, C] that only looks back (the parameters of
    nn.Conv1d(C, C, k, groups=C)). `state`: the last k - 1 inputs of the previous call, [B, k - 1, C].
    Returns the output [B, T, C] and the state for the next call. Runs the op `conv.causal_conv1d`
    (kernels/conv.py: causal-conv1d's CUDA kernel where it is installed, else conv2d on a channels-last view),
    or for a few tokens (decoding) each output's window of inputs times the kernel. Tests compare every path
    with F.conv1d."""

    def __init__(self, channels: int, kernel_size: int, bias: bool = True, fused: bool = False):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=bias)
        self.fused = fused  # the kernel's gradient compiled by torch.compile (fusion.py)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None):
        B, T, C = x.shape
        k = self.kernel_size[0]
        history = x.new_zeros(B, k - 1, C) if state is None else state  # the k - 1 inputs before x
        weight, bias = self.weight[:, 0].to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        if state is None and B * T > DIRECT_MAX_TOKENS:  # the convolution pads the zeros: no copy of x
            recent = torch.cat([history, x[:, max(0, T - k + 1) :]], 1)
            y = conv.causal_conv1d(x, weight, bias, fused=self.fused)
            return y, recent[:, recent.shape[1] - (k - 1) :]
        full = torch.cat([history, x], 1)
        if T == 0:
            return x, full.clone()
        if B * T > DIRECT_MAX_TOKENS:
            y = conv.depthwise_conv(full, weight, bias, pad=0, fused=self.fused)
        else:  # each output: its window of k inputs times the kernel
            y = torch.linalg.vecdot(full.unfold(1, k, 1), weight)
            y = y if bias is None else y + bias
        # the next state: a view of `full` for a few tokens (decoding: no copy), else its own memory
        return y, full[:, T:] if T < k else full[:, T:].clone()


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

    def init_cache(self, batch_size: int, device=None, dtype=None, max_len: int | None = None):
        return self.attn.init_cache(batch_size, device, dtype, max_len)
