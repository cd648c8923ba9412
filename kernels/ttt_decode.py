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
    bh = tl.program_id(0)
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


def reference(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
    """The same step in PyTorch, through the TTT layer's primal form (used for the backward)."""
    from ttt_bench.models.ttt.forms import primal_step

    eta = (te * lr)[..., None, None]
    pending = ((sums_W, sums_b), te.view(1, 1), lr[..., None, None])
    return primal_step((W, b), xq, xk, xv, eta, (ln_weight, ln_bias), pending=pending)


def supported(xq: torch.Tensor, b, ln_weight) -> bool:
    f = xq.shape[-1]
    return xq.dtype == torch.float32 and b is not None and ln_weight is not None and f & (f - 1) == 0


class TTTLinearDecode(torch.autograd.Function):
    """Forward: the kernel. Backward (rarely needed when decoding): PyTorch recomputation of `reference`."""

    @staticmethod
    def forward(ctx, xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
        B, H, _, F = xq.shape
        inputs = (xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias)
        c = [t.contiguous() for t in inputs]
        z, sw, sb = torch.empty_like(c[0]), torch.empty_like(c[7]), torch.empty_like(c[8])
        _decode_kernel[(B * H,)](*c, z, sw, sb, H, F=F)
        ctx.save_for_backward(*inputs)
        return z, sw, sb

    @staticmethod
    def backward(ctx, dz, dsw, dsb):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            z, (sw, sb) = reference(*inputs)
            outs = [(o, g) for o, g in ((z, dz), (sw, dsw), (sb, dsb)) if g is not None]
            return torch.autograd.grad([o for o, _ in outs], inputs, [g for _, g in outs], allow_unused=True)


def ttt_linear_decode(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
    """One decoding token of TTT-Linear. xq/xk/xv [B, H, 1, f], lr [B, H] (the token's inner lr), te: 0-dim
    token scaling of its position, W/sums_W [B, H, f, f], b/sums_b [B, H, 1, f], ln_weight/ln_bias [H, 1, f].
    Returns (z [B, H, 1, f] incl. the +xq residual, new sums_W, new sums_b), as `reference`."""
    return TTTLinearDecode.apply(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias)
