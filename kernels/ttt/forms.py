"""Primal and dual forms of mini-batch TTT (Sections 2.4-2.5, Appendix A).

A sequence is split into mini-batches of b tokens (b=1: online GD, b=T: batch GD). Every token's gradient
G_s is taken at W_{t'}, the weights at the end of the previous mini-batch, and within the mini-batch

    W_t = W_{t'} - sum_{s <= t} eta[t, s] G_s                                     (Equation 6)
    z_t = f(theta_Q x_t; W_t)                                                     (Equation 5)

with eta[t, s] = token_eta[t] * lr[s]: the learned inner learning rate of token s times the scaling of
position t in its mini-batch (layer.py builds eta). A step processes one mini-batch, or a shorter chunk of
one: `primal_step` materialises every G_t and W_t, `dual_step` only uses matmuls and masks. Both take
`pending = (sums, token_eta, lr)` to continue a mini-batch begun earlier (decoding), where `sums` is
sum_s lr[s] G_s over its earlier tokens, so that W_t = W_{t'} - token_eta[t] * (sums + ...).

`scan` runs a step over the N mini-batches of [B, H, N, b, .] tensors, with gradient checkpointing
through time. These are the reference forms; dual_scan.py is the fast dual form over all mini-batches.
"""

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from . import learner
from .learner import Params


def dual_step(params: Params, xq, xk, xv, eta, ln=None, pending=None):
    """One chunk in dual form (Appendix A.3). xq/xk/xv [B, H, c, f], eta [B, H, c, c].

    Returns (z [B, H, c, f], state): the weights at the end of the chunk, or with `pending` the new
    gradient sums (the caller turns them into weights when the mini-batch completes).
    """
    xs, gs = learner.grads(params, xk, xv, ln)
    eta = eta.tril()  # the mask: token t only sees s <= t
    last = eta[..., -1:, :].transpose(-1, -2)  # eta[c-1, s] as a column [B, H, c, 1]
    x, state = xq, []
    for k in range(learner.n_layers(params)):
        W, b, X, G = params[2 * k], params[2 * k + 1], xs[k], gs[k]
        # Zbar^k = Xbar^k W^k - (eta * mask(Xbar^k X^k^T)) G^k (Fact 1, Equation 8 for one layer); the bias
        # is a feature that is always 1, so b_t = b - sum_s eta[t, s] g_s.
        z = x @ W - (eta * (x @ X.transpose(-1, -2))) @ G
        if b is not None:
            z = z + b - eta @ G
        if pending is None:  # W_b = W - sum_s eta[c, s] x_s g_s^T, with matmuls (Section 2.5)
            state += [
                W - (last * X).transpose(-1, -2) @ G,
                None if b is None else b - (last * G).sum(-2, True),
            ]
        else:
            sums, token_eta, lr = pending
            lr = lr.transpose(-1, -2)
            z = z - token_eta * (x @ sums[2 * k] + (0 if b is None else sums[2 * k + 1]))
            state += [
                sums[2 * k] + (lr * X).transpose(-1, -2) @ G,
                None if b is None else sums[2 * k + 1] + (lr * G).sum(-2, True),
            ]
        x = learner.gelu(z) if k < learner.n_layers(params) - 1 else z
    return (xq + learner.layer_norm(x, *ln) if ln is not None else x), tuple(state)


def token_weights(params: Params, xs: list, gs: list, eta, pending=None) -> tuple[tuple, tuple]:
    """The primal form's W_t for every token of a chunk (Equation 6): W^k [B, H, c, d_in, d_out] and
    b^k [B, H, c, d_out]; with `pending`, also the running gradient sums after every token."""
    weights, sums_t = [], []
    for k in range(learner.n_layers(params)):
        W, b = params[2 * k], params[2 * k + 1]
        G_W = xs[k].unsqueeze(-1) * gs[k].unsqueeze(-2)  # G_t = x_t g_t^T, one d_in x d_out matrix per token
        G_b = gs[k]
        if pending is None:
            W_t = W.unsqueeze(-3) - torch.einsum("...ts,...sio->...tio", eta.tril(), G_W)
            b_t = None if b is None else b - eta.tril() @ G_b
        else:  # cumsum of lr_s G_s on top of the earlier tokens' sums
            sums, token_eta, lr = pending
            lr = lr.transpose(-1, -2)
            S_W = sums[2 * k].unsqueeze(-3) + torch.cumsum(lr.unsqueeze(-1) * G_W, dim=-3)
            S_b = None if b is None else sums[2 * k + 1] + torch.cumsum(lr * G_b, dim=-2)
            W_t = W.unsqueeze(-3) - token_eta.unsqueeze(-1) * S_W
            b_t = None if b is None else b - token_eta * S_b
            sums_t += [S_W, S_b]
        weights += [W_t, b_t]
    return tuple(weights), tuple(sums_t)


def last_token(per_token: tuple) -> tuple:
    """The last token's entry of per-token weights (or sums), shaped like the weights of a step."""
    return tuple(
        None if p is None else p[..., -1, :, :] if i % 2 == 0 else p[..., -1:, :]
        for i, p in enumerate(per_token)
    )


def primal_step(params: Params, xq, xk, xv, eta, ln=None, pending=None):
    """One chunk in primal form (Appendix A.2): same inputs and outputs as `dual_step`."""
    xs, gs = learner.grads(params, xk, xv, ln)
    W_t, sums_t = token_weights(params, xs, gs, eta, pending)
    z = learner.predict(W_t, xq, ln, per_token=True)
    return z, last_token(W_t if pending is None else sums_t)


STEPS = {"dual": dual_step, "primal": primal_step}


def scan(step, params: Params, inputs: tuple, checkpoint_every: int = 0):
    """Run `step(params, *inputs[:, :, n]) -> (out_n, params)` over the N mini-batches of inputs
    [B, H, N, ...]; returns (outputs stacked on axis 2, final params)."""

    def run(params, *inputs):
        outs = []
        for xs in zip(*(x.unbind(2) for x in inputs), strict=True):  # unbind: one backward for all slices
            out, params = step(params, *xs)
            outs.append(out)
        return torch.stack(outs, 2), params

    return in_groups(run, params, inputs, checkpoint_every)


def in_groups(run, params: Params, inputs: tuple, checkpoint_every: int = 0):
    """`run(params, *group) -> (out, params)` over groups of mini-batches of inputs [B, H, N, ...], with
    gradient checkpointing through time (Appendix C): with checkpoint_every = k > 0 (and autograd on), only
    the weights at every k-th mini-batch boundary are kept for backward, and each group of k mini-batches is
    recomputed during backward. Without, one group of all N."""
    ckpt = checkpoint_every > 0 and torch.is_grad_enabled()
    if not ckpt:
        return run(params, *inputs)
    outs = []
    for group in zip(*(x.split(checkpoint_every, 2) for x in inputs), strict=True):
        out, params = checkpoint(run, params, *group, use_reentrant=False)
        outs.append(out)
    return torch.cat(outs, 2), params


def ttt_scan(form: str, params: Params, XQ, XK, XV, eta, ln=None, checkpoint_every: int = 0):
    """Any learner, either form: XQ/XK/XV [B, H, N, b, f], eta [B, H, N, b, b] -> (Z, final params)."""
    return scan(partial(STEPS[form], ln=ln), params, (XQ, XK, XV, eta), checkpoint_every)


def losses_step(params: Params, xk, xv, eta, params0: Params, ln=None):
    """Figure 5 diagnostics for one mini-batch: l(W_0; x_t), l(W_{t-1}; x_t), l(W_t; x_t) per token,
    [B, H, c, 3], and the weights at its end."""
    xs, gs = learner.grads(params, xk, xv, ln)
    W_t, _ = token_weights(params, xs, gs, eta)
    W_prev = tuple(  # W_{t-1}: the chunk's initial weights, then W_t shifted by one token
        None
        if p is None
        else torch.cat([p.unsqueeze(-3), q[..., :-1, :, :]], -3)
        if i % 2 == 0
        else torch.cat([p, q[..., :-1, :]], -2)
        for i, (p, q) in enumerate(zip(params, W_t, strict=True))
    )
    out = torch.stack(
        [
            learner.loss(params0, xk, xv, ln),
            learner.loss(W_prev, xk, xv, ln, per_token=True),
            learner.loss(W_t, xk, xv, ln, per_token=True),
        ],
        -1,
    )
    return out, last_token(W_t)


def chunk_flops(layers: list[tuple[int, int]], c: int, form: str, bias: bool) -> float:
    """Inner-loop FLOPs of one head for a chunk of c tokens in `form` (dual or primal), f's layers
    [(in, out)]: gradients at W_{t'}, then the dual form's outputs and end-of-mini-batch weights, or the
    primal form's per-token weights. The layer's flops_per_token and the kernels' floors (speed.py) count
    with it."""
    flops = sum(2.0 * c * i * o for i, o in layers)  # forward of f on the training view
    flops += sum(2.0 * c * i * o for i, o in layers[1:])  # backward through the upper layers
    for i, o in layers:
        if form == "dual":
            # x W and W - X^T G for the next mini-batch, then x X^T, (eta * x X^T) G and [eta G]
            flops += 4.0 * c * i * o + 2.0 * c * c * i + 2.0 * c * c * o * (2 if bias else 1)
        else:
            # W_t = W - eta G_t for every token (c x c by c x (i o)), [b_t], then f(x_t; W_t)
            flops += 2.0 * c * c * i * o + (2.0 * c * c * o if bias else 0.0) + 2.0 * c * i * o
    return flops
