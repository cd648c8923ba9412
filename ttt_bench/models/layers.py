"""Building blocks shared by every model: RMSNorm, rotary embeddings, SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


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


class CausalConv1d(nn.Conv1d):
    """Depthwise temporal convolution over [B, T, C] that only looks back (the parameters of
    nn.Conv1d(C, C, k, groups=C)). `state`: the last k - 1 inputs of the previous call, [B, k - 1, C].

    Computed as k shifted multiply-adds in the token-major layout (`ShiftConv`), which on CPUs is faster
    than F.conv1d and its transposes; tests compare it with F.conv1d."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=True)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None):
        k = self.kernel_size[0] - 1
        x = F.pad(x, (0, 0, k, 0)) if state is None else torch.cat([state, x], dim=1)
        y = ShiftConv.apply(x, self.weight[:, 0].to(x.dtype), self.bias.to(x.dtype))
        return y, x[:, x.shape[1] - k :].clone()


class ShiftConv(torch.autograd.Function):
    """y_t = bias + sum_j weight[:, j] * x_{t + j} for x [B, T + k - 1, C] (left-padded), weight [C, k]."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        k, T = weight.shape[1], x.shape[1] - weight.shape[1] + 1
        y = torch.addcmul(bias, x[:, k - 1 :], weight[:, k - 1])
        for j in range(k - 1):
            y.addcmul_(x[:, j : j + T], weight[:, j])
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        k, T = weight.shape[1], dy.shape[1]
        dx = torch.empty_like(x)
        torch.mul(dy, weight[:, 0], out=dx[:, :T])
        dx[:, T:].zero_()
        for j in range(1, k):
            dx[:, j : j + T].addcmul_(dy, weight[:, j])
        # sum over (B, T) of dy * x shifted, without a [B, T, C] temporary per tap
        dweight = torch.stack([torch.linalg.vecdot(dy, x[:, j : j + T], dim=1).sum(0) for j in range(k)], -1)
        return dx, dweight, dy.sum((0, 1))


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
