"""The Triton decode kernels (one token, primal form: ../ttt_decode.py for TTT-Linear, ../ttt_mlp_decode.py
for TTT-MLP) as `ops.step` calls them: the kernel for the forward, and for the backward (rarely needed when
decoding) a PyTorch recomputation of the same step through the primal form (`decode_reference`)."""

import torch

from .forms import primal_step


def decode_reference(xq, xk, xv, lr, te, *state):
    """A decode kernel's step in PyTorch, through the primal form: state = (*weights, *sums, ln_weight,
    ln_bias), the weights W_{t'} of either learner and their gradient sums. Returns (z, sums)."""
    n = (len(state) - 2) // 2
    params, sums, ln = state[:n], state[n : 2 * n], state[2 * n :]
    eta = (te * lr)[..., None, None]
    pending = (sums, te.view(1, 1), lr[..., None, None])
    return primal_step(params, xq, xk, xv, eta, ln, pending=pending)


class KernelDecode(torch.autograd.Function):
    """Forward: `kernel`. Backward: PyTorch recomputation of `decode_reference`."""

    @staticmethod
    def forward(ctx, kernel, *inputs):
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, dz, *dsums):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            z, sums = decode_reference(*inputs)
            outs = [(o, g) for o, g in ((z, dz), *zip(sums, dsums, strict=True)) if g is not None]
            grads = torch.autograd.grad([o for o, _ in outs], inputs, [g for _, g in outs], allow_unused=True)
        return (None, *grads)


def _decode(kernel, *inputs):
    """`kernel` through KernelDecode where autograd records, else the kernel alone with the new sums written
    over the old (decoding's state stays where it is: CUDA graphs, ttt_bench/models/graphs.py)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return KernelDecode.apply(kernel, *inputs)
    return kernel(*inputs, in_place=True)


def ttt_linear_decode(xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias):
    """One decoding token of TTT-Linear on the kernel's domain (`kernels.decode_why_not`). xq/xk/xv
    [B, H, 1, f], lr [B, H] (the token's inner lr), te: 0-dim token scaling of its position, W/sums_W
    [B, H, f, f], b/sums_b [B, H, 1, f], ln_weight/ln_bias [H, 1, f]. Returns (z [B, H, 1, f] incl. the +xq
    residual, new sums_W, new sums_b), as `decode_reference`."""
    from ..ttt_decode import decode_step

    return _decode(decode_step, xq, xk, xv, lr, te, W, b, sums_W, sums_b, ln_weight, ln_bias)


def ttt_mlp_decode(xq, xk, xv, lr, te, W1, b1, W2, b2, S_W1, S_b1, S_W2, S_b2, ln_weight, ln_bias):
    """One decoding token of TTT-MLP on the kernel's domain (`kernels.mlp_decode_why_not`): as
    `ttt_linear_decode` with both layers' weights W1 [B, H, f, 4f], b1 [B, H, 1, 4f], W2 [B, H, 4f, f],
    b2 [B, H, 1, f] and their sums. Returns (z, new S_W1, S_b1, S_W2, S_b2)."""
    from ..ttt_mlp_decode import decode_step

    return _decode(decode_step, xq, xk, xv, lr, te, W1, b1, W2, b2, S_W1, S_b1, S_W2, S_b2, ln_weight,
                   ln_bias)
