"""Row-wise LayerNorm pieces shared by the TTT-Linear kernels (Triton device functions).

Every function acts on a [R, F] block, one token per row, with the per-head LN weight and bias as [1, F].
"""

import triton
import triton.language as tl

# the TTT layer's inner LayerNorm epsilon (learner.LN_EPS). A global a kernel reads must be a tl.constexpr
# instance: compiled Triton rejects the annotated form `LN_EPS: tl.constexpr = 1e-6` (the CPU interpreter
# does not check it; tests/test_kernels_aot.py does).
LN_EPS = tl.constexpr(1e-6)


@triton.jit
def row_mean(x, F: tl.constexpr):
    return tl.sum(x, axis=1)[:, None] / F


@triton.jit
def normalize(z, F: tl.constexpr):
    """(z - mean) / std and std = sqrt(var + eps), per row."""
    centered = z - row_mean(z, F)
    std = tl.sqrt(row_mean(centered * centered, F) + LN_EPS)
    return centered / std, std


@triton.jit
def ln_backward(dxhat, xhat, std, F: tl.constexpr):
    """d/dz from d/dxhat through xhat = (z - mean) / std (the standard LayerNorm backward)."""
    return (dxhat - row_mean(dxhat, F) - xhat * row_mean(dxhat * xhat, F)) / std


@triton.jit
def ln_l2_grad(z, target, gamma, beta, F: tl.constexpr):
    """G = d/dz 1/2 ||LN(z) - target||^2 and the intermediates its backward needs.

    With xhat = normalize(z), gy = gamma xhat + beta - target and gx = gamma gy, G = ln_backward(gx).
    """
    xhat, std = normalize(z, F)
    gy = gamma * xhat + beta - target
    gx = gamma * gy
    return ln_backward(gx, xhat, std, F), xhat, std, gy, gx
