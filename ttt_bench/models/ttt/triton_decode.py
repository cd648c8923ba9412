"""The Triton decode kernel of TTT-Linear (kernels/ttt_decode.py) as the TTT layer calls it: the kernel for
the forward, and for the backward (rarely needed when decoding) a PyTorch recomputation of the same step
through the layer's primal form (`decode_reference`)."""

import torch

from ... import kernels
from .forms import primal_step


def decode_reference(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
    """The decode kernel's step in PyTorch, through the TTT layer's primal form: (z, (sums_W, sums_b))."""
    eta = (te * lr)[..., None, None]
    pending = ((sums_W, sums_b), te.view(1, 1), lr[..., None, None])
    return primal_step((W, b), xq, xk, xv, eta, (ln_weight, ln_bias), pending=pending)


class TTTLinearDecode(torch.autograd.Function):
    """Forward: the kernel. Backward: PyTorch recomputation of `decode_reference`."""

    @staticmethod
    def forward(ctx, xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
        inputs = (xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias)
        ctx.save_for_backward(*inputs)
        return kernels.decode_step(*inputs)

    @staticmethod
    def backward(ctx, dz, dsw, dsb):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            z, (sw, sb) = decode_reference(*inputs)
            outs = [(o, g) for o, g in ((z, dz), (sw, dsw), (sb, dsb)) if g is not None]
            return torch.autograd.grad([o for o, _ in outs], inputs, [g for _, g in outs], allow_unused=True)


def ttt_linear_decode(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
    """One decoding token of TTT-Linear on the kernel's domain (`kernels.decode_supported`). xq/xk/xv
    [B, H, 1, f], lr [B, H] (the token's inner lr), te: 0-dim token scaling of its position, W/sums_W
    [B, H, f, f], b/sums_b [B, H, 1, f], ln_weight/ln_bias [H, 1, f]. Returns (z [B, H, 1, f] incl. the +xq
    residual, new sums_W, new sums_b), as `decode_reference`."""
    return TTTLinearDecode.apply(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias)
