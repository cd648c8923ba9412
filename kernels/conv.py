"""The short causal depthwise convolution of the TTT layers (Figure 16's convs) as an op with a `backend`:

    causal_conv1d(x, weight, bias)    y_t = bias + sum_j weight[:, j] x_{t + j - (k - 1)}, x [B, T, C]

  torch  `DepthwiseConv`: conv2d on channels-last views, a hand-written kernel gradient (any device);
  cuda   causal-conv1d's CUDA kernel (`causal_conv1d_fn`, the `cuda` extra), on CUDA inputs, 2-4 taps;
  auto   cuda where it imports and the input is on CUDA, else torch.
tests/test_layers.py compares torch with F.conv1d (outputs, gradients), cuda with torch on a GPU.
"""

import functools

import torch
import torch.nn.functional as F

from .fusion import fuse

BACKENDS = ("auto", "torch", "cuda")
MAX_CUDA_WIDTH = 4  # causal-conv1d's kernels take 2 to 4 taps


@functools.cache
def _causal_conv1d_fn():
    """causal-conv1d's `causal_conv1d_fn`, or None where it does not import."""
    try:  # imported lazily: it needs CUDA
        from causal_conv1d import causal_conv1d_fn
    except (ImportError, OSError, RuntimeError):
        return None
    return causal_conv1d_fn


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, backend: str = "auto",
                  fused: bool = False) -> torch.Tensor:
    """The causal depthwise convolution of token-major x [B, T, C] with weight [C, k] (zeros before the first
    token): y [B, T, C]. fused: torch.compile the torch backend's kernel gradient (fusion.py)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cuda = x.is_cuda and weight.shape[1] <= MAX_CUDA_WIDTH and _causal_conv1d_fn() is not None
    if backend == "cuda" and not cuda:
        raise RuntimeError("the cuda backend needs a CUDA input, a kernel of at most 4 taps and "
                           "causal-conv1d (pip install -e '.[cuda]')")
    if backend != "torch" and cuda:  # its channel-last layout: [B, C, T] with the channels contiguous
        return _causal_conv1d_fn()(x.contiguous().transpose(1, 2), weight, bias).transpose(1, 2)
    return depthwise_conv(x, weight, bias, pad=weight.shape[1] - 1, fused=fused)


def depthwise_conv(x, weight, bias, pad: int, fused: bool = False) -> torch.Tensor:
    """`DepthwiseConv`: pad = k - 1 for the causal convolution of x; pad = 0 where x begins with the k - 1
    inputs before the first output (decoding with a state)."""
    return DepthwiseConv.apply(x, weight, bias, pad, fused)


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
