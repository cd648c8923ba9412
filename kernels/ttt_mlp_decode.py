"""TTT-MLP decoding, one token, primal form: one Triton program per (sequence, head).

TTT-Linear's decode kernel (kernels/ttt_decode.py) for the inner model of kernels/ttt_mlp.py,
f(x) = x + LN(gelu(x W1 + b1) W2 + b2) with hidden width m = 4f and GELU's tanh approximation. The decoding
cache holds the weights W_{t'} = (W1, b1, W2, b2) at the end of the last complete mini-batch and, one per
weight, the running sums S = sum_s lr_s G_s over the earlier tokens of the current mini-batch (layer.py's
TTTCache). For the token at position t of its mini-batch, with token scaling te = token_eta[t] and its inner
learning rate lr:

    z1 = xk W1 + b1,   x2 = gelu(z1),   z2 = x2 W2 + b2                 (the gradient at W_{t'})
    g2 = d/dz2 1/2 ||LN(z2) - (xv - xk)||^2                              (LN-L2 gradient, fused)
    g1 = (g2 W2^T) * gelu'(z1)
    S_W1 += lr xk^T g1,   S_b1 += lr g1,   S_W2 += lr x2^T g2,   S_b2 += lr g2
    W_t = W_{t'} - te S                                                   (each weight; Equation 6)
    zbar1 = xq W1_t + b1_t,   zbar2 = gelu(zbar1) W2_t + b2_t,   z = xq + LN(zbar2)

W_t is never written to memory, only formed in registers: xq W1_t = xq W1 - te (xq S_W1) (xq W1 taken with
xk W1, when W1's tile is read) and gelu(zbar1) W2_t from W2's tile minus te S_W2's, b_t = b - te S_b. The
kernel reads the weights and S and writes z and the new S; when the mini-batch completes, the caller makes
W_b = W_{t'} - te S (as layer.py's `_continue` after `forms.primal_step`).

Inputs of any float dtype are read as they are and computed in float32; z comes back in xq's dtype, the
sums in float32 (or float64 if given so). Registers: the whole [f, m] and [m, f] tiles of W1, W2 and the
sums, m f = 4 f^2 float32 each (64 KB at f = 64), spread over the warps; W2's is held from the gradient to
the output, beside one of the sums' at a time (`launch_options`: no spills at f = 16, 32, 64).
"""

import torch
import triton
import triton.language as tl

from .ln import ln_l2_grad, normalize

# HEAD_SIZES: the dual-form kernel's, compiled for sm_80 and sm_90 here too (test_kernel_ttt_mlp_decode.py)
from .ttt_mlp import EXPANSION, HEAD_SIZES, _gelu, _gelu_and_grad, model_why_not  # noqa: F401


@triton.jit
def _load(ptr, offs):
    return tl.load(ptr + offs).to(tl.float32)


@triton.jit
def _store(ptr, offs, x):
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty))


@triton.jit
def _mlp_decode_kernel(XQ, XK, XV, LR, TE, W1, B1, W2, B2, SW1, SB1, SW2, SB2, LNW, LNB,
                       Z, SW1_OUT, SB1_OUT, SW2_OUT, SB2_OUT, H, F: tl.constexpr, M: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets, as the other kernels' (B*H*f*m elements)
    h = bh % H
    tile, row1, row = bh * F * M, bh * M, bh * F  # W1, W2 and the sums [f, m] / [m, f]; b1 [m]; the rest [f]
    rf = tl.arange(0, F)
    rm = tl.arange(0, M)
    # int32 offsets within a program's tiles, added to its base pointers: int64 offsets for every element
    # take registers (at f = 64 with 8 warps they spilled)
    mat1 = rf[:, None] * M + rm[None, :]  # W1, S_W1 [f, m]
    mat2 = rm[:, None] * F + rf[None, :]  # W2, S_W2 [m, f]
    xq = _load(XQ + row, rf)
    xk = _load(XK + row, rf)
    lr = _load(LR, bh)
    te = _load(TE, 0)
    gamma = _load(LNW + h * F, rf)[None, :]
    beta = _load(LNB + h * F, rf)[None, :]

    # the gradient at W_{t'}, and xq W1 while W1 is at hand
    W1_ = _load(W1 + tile, mat1)
    b1 = _load(B1 + row1, rm)
    x2, dgelu1 = _gelu_and_grad(tl.sum(xk[:, None] * W1_, axis=0) + b1)
    xq_W1 = tl.sum(xq[:, None] * W1_, axis=0)
    W2_ = _load(W2 + tile, mat2)
    b2 = _load(B2 + row, rf)[None, :]
    z2 = tl.sum(x2[:, None] * W2_, axis=0)[None, :] + b2
    g2, _, _, _, _ = ln_l2_grad(z2, (_load(XV + row, rf) - xk)[None, :], gamma, beta, F)  # [1, f]
    g1 = tl.sum(W2_ * g2, axis=1) * dgelu1  # [m]

    # the new sums, and the output through W_t = W_{t'} - te S
    sw1 = _load(SW1 + tile, mat1) + lr * xk[:, None] * g1[None, :]
    sb1 = _load(SB1 + row1, rm) + lr * g1
    _store(SW1_OUT + tile, mat1, sw1)
    _store(SB1_OUT + row1, rm, sb1)
    xbar2 = _gelu(xq_W1 + b1 - te * (tl.sum(xq[:, None] * sw1, axis=0) + sb1))
    sw2 = _load(SW2 + tile, mat2) + lr * x2[:, None] * g2
    sb2 = _load(SB2 + row, rf)[None, :] + lr * g2
    _store(SW2_OUT + tile, mat2, sw2)
    _store(SB2_OUT + row, rf[None, :], sb2)
    zbar2 = tl.sum(xbar2[:, None] * (W2_ - te * sw2), axis=0)[None, :] + b2 - te * sb2
    xhat, _ = normalize(zbar2, F)
    _store(Z + row, rf[None, :], xq[None, :] + gamma * xhat + beta)


# num_warps by head size, from the ahead-of-time compile (tests/test_kernel_ttt_mlp_decode.py compiles the
# launcher's). Registers a thread on sm_80 / sm_90 at 2, 4, 8, 16 warps:
#   f = 16: 117/96, 94/80, 64/64, 59/59                 no spills
#   f = 32: 255/255, 167/164, 128/126, 102/98           no spills
#   f = 64: 4 warps spill 8.9 KB a thread, 8 warps 255/255 without spills, 16 warps (at most 128 registers
#           at 512 threads) spill 112-172 bytes
# Shared memory: 1-4 KB (the [m] and [f] vectors between layouts). Chosen: no spills and under the cap of 255
# registers where it can be had (2 warps at f = 32 reach it), then the fewest waves of the 1.3b model's 512
# (sequence, head) programs at batch 16 on 108 (sm_80) and 132 (sm_90) SMs (kernels/aot.py's blocks_per_sm:
# one wave at f = 16 with 4 warps, 5-6 programs an SM, two with 8; two at f = 32 with 4, 3 programs an SM),
# then the most warps. f = 64: 8 warps, the only launch without spills (one program an SM).
_WARPS = {16: 4, 32: 4, 64: 8}


def launch_options(f: int) -> dict:
    """The launch options (num_warps, num_stages) of the decode kernel at head size f."""
    return {"num_warps": _WARPS[f], "num_stages": 1}


def why_not(xq: torch.Tensor, W1, b1, b2, ln_weight) -> str:
    """Why inputs are outside the decode kernel's domain ("" when inside): one token, and the inner model
    TTT-MLP's kernels take (ttt_mlp.model_why_not: floating point, both biases and LN-and-residual, hidden
    width 4 f, head size f in HEAD_SIZES)."""
    c = xq.shape[-2]
    one_token = "" if c == 1 else f"{c} tokens (the decode kernel takes one)"
    return model_why_not(xq, W1, b1, b2, ln_weight) or one_token


def supported(xq: torch.Tensor, W1, b1, b2, ln_weight) -> bool:
    """Whether the decode kernel takes these inputs (`why_not`)."""
    return not why_not(xq, W1, b1, b2, ln_weight)


def decode_step(xq, xk, xv, lr, te, W1, b1, W2, b2, S_W1, S_b1, S_W2, S_b2, ln_weight, ln_bias,
                in_place: bool = False):
    """One decoding token of TTT-MLP, forward only (under grad mode with an input that requires grad it
    raises). xq/xk/xv [B, H, 1, f], lr [B, H] (the token's inner lr), te: 0-dim token scaling of its
    position, W1/S_W1 [B, H, f, 4f], b1/S_b1 [B, H, 1, 4f], W2/S_W2 [B, H, 4f, f], b2/S_b2 [B, H, 1, f] (the
    cache's weights W_{t'} and gradient sums), ln_weight/ln_bias [H, 1, f]. Returns (z [B, H, 1, f] incl. the
    +xq residual, in xq's dtype, and the new S_W1, S_b1, S_W2, S_b2), as `forms.primal_step` with
    pending = (sums, te, lr) for one token. in_place: the new sums written over the float32 contiguous ones
    (each program reads its tiles before it writes them), so that a decoding state stays where it is."""
    inputs = (xq, xk, xv, lr, te, W1, b1, W2, b2, S_W1, S_b1, S_W2, S_b2, ln_weight, ln_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise RuntimeError("the TTT-MLP decode kernel is forward only: call it under torch.no_grad()")
    reason = why_not(xq, W1, b1, b2, ln_weight)
    if reason:
        raise ValueError(f"outside the TTT-MLP decode kernel's domain: {reason}")
    B, H, _, F = xq.shape
    M = EXPANSION * F
    shapes = {"xk": (xk, (B, H, 1, F)), "xv": (xv, (B, H, 1, F)), "lr": (lr, (B, H)), "te": (te, ()),
              "W1": (W1, (B, H, F, M)), "b1": (b1, (B, H, 1, M)), "W2": (W2, (B, H, M, F)),
              "b2": (b2, (B, H, 1, F)), "S_W1": (S_W1, (B, H, F, M)), "S_b1": (S_b1, (B, H, 1, M)),
              "S_W2": (S_W2, (B, H, M, F)), "S_b2": (S_b2, (B, H, 1, F)), "ln_weight": (ln_weight, (H, 1, F)),
              "ln_bias": (ln_bias, (H, 1, F))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    inputs = [t.contiguous() for t in inputs]
    z = torch.empty_like(inputs[0])
    dtypes = [torch.promote_types(s.dtype, torch.float32) for s in inputs[9:13]]
    sums = [s if in_place and s.dtype == d else torch.empty_like(s, dtype=d)
            for s, d in zip(inputs[9:13], dtypes, strict=True)]
    if B * H:
        _mlp_decode_kernel[(B * H,)](*inputs, z, *sums, H, F=F, M=M, **launch_options(F))
    return z, *sums
