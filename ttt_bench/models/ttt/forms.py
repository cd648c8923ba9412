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
through time; `ttt_linear_dual` is the TTT-Linear core a fused kernel can replace.
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


def ttt_linear_dual(XQ, XK, XV, eta, W, b, ln_weight, ln_bias, *, checkpoint_every: int = 0):
    """TTT-Linear in dual form over N mini-batches: the functional core.

    XQ, XK, XV: [B, H, N, b, f] test, training and label views; eta: [B, H, N, b, b] with
    eta[..., t, s] = token_eta[t] * lr[s] (applied below its diagonal only); W: [B, H, f, f] and
    b: [B, H, 1, f] (or None) the initial weights; ln_weight, ln_bias: [H, 1, f], or None for the plain
    linear learner f(x) = xW + b without LN and residual.
    Returns Z [B, H, N, b, f] (the layer output before post-norm, with the +XQ residual when LN is on),
    and W_last, b_last: the weights after the last mini-batch.

    The same computation as `dual_step` over `scan`, arranged for speed: everything that does not depend
    on W (the masked eta * (XQ XK^T + 1), eta's last row, the labels) is computed for all N mini-batches
    in one batched op before the scan, and the output LayerNorm after it; the bias is the row of W for a
    feature that is always 1, so each mini-batch is two matmuls with W and one with G. The scan runs
    mini-batch-major ([N, B, H, ...]) so that every mini-batch it reads or writes is contiguous; Z comes
    back token-major (laid out [B, N, b, H, f], as the layer's projections), where the per-head LayerNorm
    parameters' gradients are cheap sums over leading axes.
    """
    B, H, N, c, f = XQ.shape
    ln = ln_weight is not None
    ln_w, ln_b = (ln_weight.unsqueeze(-2), ln_bias.unsqueeze(-2)) if ln else (None, None)  # [H, 1, 1, f]
    w2 = ln_weight * ln_weight if ln else None  # [H, 1, f]

    def run(W, XQ, XK, XV, eta):
        # f_res learns xv - xk; the label's part of the LN-L2 gradient is (ln_b - label) ln_w
        label = (ln_b - (XV - XK)) * ln_w if ln else XV  # in the inputs' (token-major) layout
        Xq, Xk, label, eta = (t.movedim(2, 0) for t in (XQ, XK, label, eta))  # [N, B, H, ...]
        if b is not None:  # x -> [x, 1]
            Xq, Xk = (torch.cat([x, torch.ones_like(x[..., :1])], -1) for x in (Xq, Xk))
        eta = eta.tril()  # the mask: token t only sees s <= t
        A = eta * (Xq @ Xk.transpose(-1, -2))  # with the bias: eta * mask(XQ XK^T + 1)
        XK_last = (eta[..., -1:, :].transpose(-1, -2) * Xk).transpose(-1, -2)  # eta[b, s] x_s as columns
        Zbar, W = LinearDualScan.apply(W, Xq, Xk, label, A, XK_last, w2, torch.is_grad_enabled())
        Z = Zbar.permute(1, 0, 3, 2, 4).contiguous().permute(0, 3, 1, 2, 4)  # [B, H, N, b, f], token-major
        return (XQ + learner.layer_norm(Z, ln_w, ln_b) if ln else Z), W

    W = W if b is None else torch.cat([W, b], -2)  # the bias is the row of W for a feature that is always 1
    Z, W = in_groups(run, W, (XQ, XK, XV, eta), checkpoint_every)
    return (Z, W, None) if b is None else (Z, W[..., :f, :], W[..., f:, :])


class LinearDualScan(torch.autograd.Function):
    """TTT-Linear's dual form over N mini-batches given its W-independent parts, with a hand-written backward.

    Inputs, mini-batch-major (see `ttt_linear_dual`; the bias, if any, is folded into W and a feature 1 of
    XQ, XK): W [B, H, d, f]; XQ, XK [N, B, H, b, d]; label [N, B, H, b, f]: with LN, (ln_b - (xv - xk)) ln_w,
    else xv; A [N, B, H, b, b] = tril(eta) * (XQ XK^T); XK_last [N, B, H, d, b] = XK^T diag(eta[b]);
    w2 [H, 1, f]: ln_w^2 (None without LN). Mini-batch n starts from W_n:

        G_n = LN-L2 gradient at XK_n W_n (Appendix A.3),    Zbar_n = XQ_n W_n - A_n G_n    (Equation 8)
        W_{n+1} = W_n - XK_last_n G_n

    Returns (Zbar [N, B, H, b, f], W_N). The backward walks the mini-batches in reverse with the gradient of
    W. It keeps the G_n and only every SEGMENT-th W_n (N W's would take d/b times the memory of the
    inputs), and recomputes the others a segment at a time with the forward's own update, so they are
    bitwise the forward's.
    """

    SEGMENT = 16

    @staticmethod
    def forward(ctx, W, XQ, XK, label, A, XK_last, w2, training: bool):
        label_in = label  # saved as it came: its gradient takes its layout (see backward)
        XQ, XK, label, A, XK_last = (t.contiguous() for t in (XQ, XK, label, A, XK_last))
        Zbar = torch.empty_like(label)
        G = torch.empty_like(label) if training else None
        W_segments = []
        for n in range(XK.shape[0]):
            if training and n % LinearDualScan.SEGMENT == 0:
                W_segments.append(W)
            g = learner.ln_l2_grad(XK[n] @ W, w2, label[n])
            torch.sub(XQ[n] @ W, A[n] @ g, out=Zbar[n])
            W = LinearDualScan.update(W, XK_last[n], g)
            if training:
                G[n] = g
        if training:
            ctx.save_for_backward(XQ, XK, label_in, A, XK_last, w2, G, *W_segments)
        return Zbar, W

    @staticmethod
    def update(W, xk_last, g):
        return W - xk_last @ g  # W_{n+1} = W_n - sum_s eta[b, s] x_s g_s^T

    @staticmethod
    def backward(ctx, dZbar, dW):
        XQ, XK, label, A, XK_last, w2, G, *W_segments = ctx.saved_tensors
        dW = torch.zeros_like(W_segments[0]) if dW is None else dW
        dZbar = torch.zeros_like(G) if dZbar is None else dZbar.contiguous()
        # Zbar_n = XQ_n W_n - A_n G_n: the parts that do not need W_n, for all n at once
        dA, dG = (dZbar @ G.transpose(-1, -2)).neg_(), (A.transpose(-1, -2) @ dZbar).neg_()
        dXQ, dXK, dXK_last = (torch.empty_like(t) for t in (XQ, XK, XK_last))
        # laid out as the label came in (token-major from the layer): its parameters' sums stay cheap
        dlabel, label = torch.empty_like(label), label.contiguous()
        dw2 = None if w2 is None else torch.zeros_like(G[0])  # summed over mini-batches, then tokens
        N, S = XK.shape[0], LinearDualScan.SEGMENT
        for first in reversed(range(0, N, S)):
            Ws = [W_segments[first // S]]
            for n in range(first, min(first + S, N) - 1):
                Ws.append(LinearDualScan.update(Ws[-1], XK_last[n], G[n]))
            for n in reversed(range(first, min(first + S, N))):  # dW: the gradient of W_{n+1}
                g, xk_last, W = G[n], XK_last[n], Ws[n - first]
                torch.matmul(dW, g.transpose(-1, -2), out=dXK_last[n]).neg_()
                dg = dG[n] - xk_last.transpose(-1, -2) @ dW
                dzk, dlabel[n], dw2_n = learner.ln_l2_grad_backward(XK[n] @ W, w2, label[n], g, dg)
                if dw2 is not None:
                    dw2 += dw2_n
                torch.matmul(dZbar[n], W.transpose(-1, -2), out=dXQ[n])
                torch.matmul(dzk, W.transpose(-1, -2), out=dXK[n])
                dW = dW + XQ[n].transpose(-1, -2) @ dZbar[n] + XK[n].transpose(-1, -2) @ dzk
        dw2 = None if w2 is None else dw2.sum((0, 2)).unsqueeze(1)
        return dW, dXQ, dXK, dlabel, dA, dXK_last, dw2, None


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
