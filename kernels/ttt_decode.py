"""TTT-Linear decoding, one token, primal form: one Triton program per (sequence, head).

The decoding cache holds W_{t'} (weights at the end of the last complete mini-batch) and the running sums
S = sum_s lr_s G_s over the tokens of the current mini-batch (layer.py's TTTCache). For the token at position
t of its mini-batch, with token scaling te = token_eta[t]:

    G = d/dz 1/2 ||LN(xk W + b) - (xv - xk)||^2          (gradient at W_{t'}, LN-L2 fused)
    S_W += lr xk^T G,   S_b += lr G
    z = xq + LN(xq (W - te S_W) + b - te S_b)

W_t is never written to memory: the kernel reads W, b, S and writes z and the new S.
"""

import torch
import triton
import triton.language as tl

from .ln import ln_l2_grad, normalize


@triton.jit
def _decode_kernel(XQ, XK, XV, LR, TE, W, B, SW, SB, LNW, LNB, Z, SW_OUT, SB_OUT, H, F: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets, as the chunk kernels' (B*H*f*f elements)
    h = bh % H
    rf = tl.arange(0, F)
    mat = bh * F * F + rf[:, None] * F + rf[None, :]
    vec = bh * F + rf[None, :]
    W_t = tl.load(W + mat)
    b = tl.load(B + vec)
    gamma = tl.load(LNW + h * F + rf)[None, :]
    beta = tl.load(LNB + h * F + rf)[None, :]
    xk_col = tl.load(XK + bh * F + rf)[:, None]
    xq_col = tl.load(XQ + bh * F + rf)[:, None]
    lr = tl.load(LR + bh)
    te = tl.load(TE)

    z1 = tl.sum(xk_col * W_t, axis=0)[None, :] + b
    G, _, _, _, _ = ln_l2_grad(z1, tl.load(XV + vec) - tl.load(XK + vec), gamma, beta, F)
    sw = tl.load(SW + mat) + lr * xk_col * G
    sb = tl.load(SB + vec) + lr * G
    tl.store(SW_OUT + mat, sw)
    tl.store(SB_OUT + vec, sb)
    z = tl.sum(xq_col * (W_t - te * sw), axis=0)[None, :] + b - te * sb
    xhat, _ = normalize(z, F)
    tl.store(Z + vec, tl.load(XQ + vec) + gamma * xhat + beta)


HEAD_SIZES = (16, 32, 64, 128)  # f: what tests/test_kernels_aot.py compiles for sm_80 and sm_90


def launch_options(f: int) -> dict:
    """num_warps, num_stages at head size f: 8 warps at f = 128, where 4 spill the [f, f] tiles
    (python -m ttt_bench.kernels.aot; docs/speed.md)."""
    return {"num_warps": 8 if f >= 128 else 4, "num_stages": 1}


def why_not(xq: torch.Tensor, b, ln_weight) -> str:
    """Why inputs are outside the decode kernel's domain ("" when inside): float32, a bias, LN-and-residual,
    head size in HEAD_SIZES (tl.arange needs a power of 2; 96, the 760m size, is not)."""
    f = xq.shape[-1]
    if xq.dtype != torch.float32:
        return f"dtype {xq.dtype} (the kernels take float32)"
    if b is None or ln_weight is None:
        return "no bias or no LayerNorm-and-residual"
    if f not in HEAD_SIZES:
        return f"head size {f} (the kernels take {', '.join(map(str, HEAD_SIZES))})"
    return ""


def supported(xq: torch.Tensor, b, ln_weight) -> bool:
    """Whether the decode kernel takes these inputs (`why_not`)."""
    return not why_not(xq, b, ln_weight)


def decode_step(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias, in_place: bool = False):
    """One decoding token of TTT-Linear, forward only (no autograd: the TTT layer's
    kernels/ttt/decode.py gives it a PyTorch backward). xq/xk/xv [B, H, 1, f], lr [B, H] (the token's
    inner lr), te: 0-dim token scaling of its position, W/sums_W [B, H, f, f], b/sums_b [B, H, 1, f],
    ln_weight/ln_bias [H, 1, f]. Returns (z [B, H, 1, f] incl. the +xq residual, new sums_W, new sums_b);
    in_place: the new sums written over sums_W and sums_b where they are contiguous (each program reads its
    tile before it writes it), so that a decoding state stays where it is (CUDA graphs)."""
    B, H, _, F = xq.shape
    c = [t.contiguous() for t in (xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias)]
    z = torch.empty_like(c[0])
    sw, sb = (c[7], c[8]) if in_place else (torch.empty_like(c[7]), torch.empty_like(c[8]))
    _decode_kernel[(B * H,)](*c, z, sw, sb, H, F=F, **launch_options(F))
    return z, sw, sb
