"""Building blocks shared by every model: RMSNorm, rotary embeddings, SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fusion import fuse


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, head_dim] by the Llama 'rotate half' convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE rotating adjacent pairs (x_2i, x_2i+1), the convention of the authors' JAX (EasyLM) code: each
    pair is a complex number, multiplied by its rotation in `freqs` (layers.rope_freqs), in float32 or
    float64."""
    real = x.to(torch.promote_types(x.dtype, torch.float32))
    real = real if real.stride(-1) == 1 else real.contiguous()
    pairs = torch.view_as_complex(real.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * freqs.to(pairs.dtype)).flatten(-2).type_as(x)


DIRECT_MAX_TOKENS = 32  # up to B * T tokens (decoding), CausalConv1d takes k products: conv2d costs ~60 us


class CausalConv1d(nn.Conv1d):
    """Depthwise temporal convolution over [B, T, C] that only looks back (the parameters of
    nn.Conv1d(C, C, k, groups=C)). `state`: the last k - 1 inputs of the previous call, [B, k - 1, C].
    Returns the output [B, T, C] and the state for the next call. Runs `DepthwiseConv` (conv2d on a
    channels-last view), or for a few tokens (decoding) each output's window of inputs times the kernel.
    Tests compare both with F.conv1d."""

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
            y = DepthwiseConv.apply(x, weight, bias, k - 1, self.fused)
            return y, recent[:, recent.shape[1] - (k - 1) :]
        full = torch.cat([history, x], 1)
        if T == 0:
            return x, full.clone()
        if B * T > DIRECT_MAX_TOKENS:
            y = DepthwiseConv.apply(full, weight, bias, 0, self.fused)
        else:  # each output: its window of k inputs times the kernel
            y = torch.linalg.vecdot(full.unfold(1, k, 1), weight)
            y = y if bias is None else y + bias
        return y, full[:, T:].clone()


def _as_image(x: torch.Tensor) -> torch.Tensor:
    """Token-major [B, T, C] as [B, C, T, 1] for conv2d: a view, channels-last when x is contiguous."""
    return x.unsqueeze(2).permute(0, 3, 1, 2)


def _as_tokens(y: torch.Tensor) -> torch.Tensor:
    """conv2d's [B, C, T, 1] back to token-major [B, T, C], a view."""
    return y[..., 0].transpose(1, 2)


class DepthwiseConv(torch.autograd.Function):
    """y_t = bias + sum_j weight[:, j] * x_{t + j - pad} for x [B, T_in, C] (token-major), weight [C, k]:
    with pad = k - 1 (zeros on the left) the causal convolution of x; with pad = 0, x holds the k - 1
    inputs before the first output.

    The token-major layout is the channels-last layout of a [B, C, T, 1] image, so conv2d runs on views
    (oneDNN's depthwise kernel on CPUs, 8x faster than k shifted multiply-adds) for the output and for the
    input's gradient (the same convolution of dy with the kernel flipped). The weight's gradient is k
    products summed over batch and time (`kernel_grad`): conv2d's own is 4x slower in this layout.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, pad: int, fused: bool = False):
        C, k = weight.shape
        ctx.save_for_backward(x, weight)
        ctx.pad, ctx.fused = pad, fused
        y = F.conv2d(_as_image(x.contiguous()), weight[:, None, :, None], bias, padding=(pad, 0), groups=C)
        return _as_tokens(y)[:, : x.shape[1] + pad - k + 1]

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        (C, k), pad, T_in = weight.shape, ctx.pad, x.shape[1]
        dy = dy.contiguous()
        # dx_s = sum_j weight_j dy_{s + pad - j}: dy convolved with the flipped kernel, k - 1 zeros each side.
        # Under autocast (bf16-mixed) the forward's conv2d ran in bf16 and dy is bf16: so does this one (the
        # backward runs outside autocast); autograd casts each gradient to its input's dtype.
        flipped = weight.flip(1)[:, None, :, None].to(dy.dtype)
        dx = _as_tokens(F.conv2d(_as_image(dy), flipped, padding=(k - 1, 0), groups=C))[:, pad : pad + T_in]
        dweight = fuse(kernel_grad, ctx.fused)(dy, x, pad, k)
        dbias = dy.sum((0, 1), dtype=weight.dtype) if ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None


def kernel_grad(dy: torch.Tensor, x: torch.Tensor, pad: int, k: int) -> torch.Tensor:
    """The gradient [C, k] of the kernel of y_t = sum_j weight_j x_{t + j - pad}: the sum over (B, t) of
    dy_t x_{t + j - pad}, x padded with zeros on the left so that every tap sums over the same tokens (one
    loop for all of them under torch.compile)."""
    T = dy.shape[1]
    x = F.pad(x, (0, 0, pad, 0))
    return torch.stack([(dy * x[:, j : j + T]).sum((0, 1)) for j in range(k)], -1)


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
