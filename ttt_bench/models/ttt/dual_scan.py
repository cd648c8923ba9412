"""The dual form over all N mini-batches, fast: TTT-Linear and TTT-MLP (Section 2.5, Appendix A).

`forms.dual_step` over `forms.scan` is the reference (autograd through every op); this computes the same
function arranged for speed, each learner an autograd Function with a hand-written backward:
- everything that does not depend on the weights (the masked eta * (XQ XK^T + 1), eta's last row, the
  labels) is computed for all mini-batches in one batched op before the scan, the output LayerNorm after;
- the bias of the first layer is the row of W for a feature that is always 1;
- the scan runs mini-batch-major ([N, B, H, ...]) so that every mini-batch it reads or writes is
  contiguous; Z comes back token-major (laid out [B, N, b, H, f], as the layer's projections), where the
  gradients of the per-head LayerNorm parameters are cheap sums over leading axes;
- the backward walks the mini-batches in reverse with the gradient of the weights; it keeps only every
  SEGMENT-th weights and recomputes the others a segment at a time with the forward's own ops, so they are
  bitwise the forward's (N W's would take far more memory than the inputs).

Mini-batch n starts from the weights W_n; with E = tril(eta) and e its last row (as a column):

    TTT-Linear  G = LN-L2 gradient at XK W,   Zbar = XQ W - (E * (XQ XK^T + 1)) G          (Equation 8)
                W_{n+1} = W - XK^T diag(e) G  (W with its bias row)
    TTT-MLP     G2 = LN-L2 gradient at Z2 = gelu(XK W1) W2 + b2,  G1 = (G2 W2^T) * gelu'(XK W1)
                Zbar1 = XQ W1 - (E * (XQ XK^T + 1)) G1,  X2bar = gelu(Zbar1)
                Zbar = X2bar W2 + b2 - (E * (X2bar X2^T + 1)) G2                     (Appendix A.3)
                W1 -= XK^T diag(e) G1,  W2 -= X2^T diag(e) G2,  b2 -= e^T G2
"""

import torch

from . import learner
from .forms import in_groups

SEGMENT = 16
gelu_backward = torch.ops.aten.gelu_backward  # gelu_backward(d, x) = d * gelu'(x), tanh approximation


def ttt_linear_dual(
    XQ, XK, XV, eta, W, b, ln_weight, ln_bias, *, checkpoint_every: int = 0, outputs: bool = True
):
    """TTT-Linear in dual form over N mini-batches: the functional core.

    XQ, XK, XV: [B, H, N, b, f] test, training and label views; eta: [B, H, N, b, b] with
    eta[..., t, s] = token_eta[t] * lr[s] (applied below its diagonal only); W: [B, H, f, f] and
    b: [B, H, 1, f] (or None) the initial weights; ln_weight, ln_bias: [H, 1, f], or None for the plain
    linear learner f(x) = xW + b without LN and residual.
    Returns Z [B, H, N, b, f] (the layer output before post-norm, with the +XQ residual when LN is on),
    and W_last, b_last: the weights after the last mini-batch. outputs=False computes only the weights
    (Z is None; Figure 8 right times the W's alone), without gradients.
    """
    f = XQ.shape[-1]
    W = W if b is None else torch.cat([W, b], -2)
    ln, bias = (ln_weight, ln_bias), b is not None
    Z, (W,) = _dual(LinearDualScan, (W,), XQ, XK, XV, eta, bias, *ln, checkpoint_every, outputs)
    return (Z, W, None) if b is None else (Z, W[..., :f, :], W[..., f:, :])


def ttt_mlp_dual(XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, *, checkpoint_every: int = 0):
    """TTT-MLP in dual form over N mini-batches: as `ttt_linear_dual` with the weights of both layers,
    W1 [B, H, f, 4f], b1 [B, H, 1, 4f], W2 [B, H, 4f, f], b2 [B, H, 1, f] (the biases may be None).
    Returns Z and the weights after the last mini-batch (W1, b1, W2, b2)."""
    f = XQ.shape[-1]
    W1 = W1 if b1 is None else torch.cat([W1, b1], -2)
    Z, (W1, W2, b2) = _dual(
        MLPDualScan, (W1, W2, b2), XQ, XK, XV, eta, b1 is not None, ln_weight, ln_bias, checkpoint_every
    )
    return Z, W1[..., :f, :], None if b1 is None else W1[..., f:, :], W2, b2


def _dual(scan, weights, XQ, XK, XV, eta, bias, ln_weight, ln_bias, checkpoint_every: int, outputs=True):
    """The parts of the dual form that do not depend on the weights, around `scan` (an autograd Function),
    with gradient checkpointing through time (forms.in_groups)."""
    ln = ln_weight is not None
    ln_w, ln_b = (ln_weight.unsqueeze(-2), ln_bias.unsqueeze(-2)) if ln else (None, None)  # [H, 1, 1, f]
    w2 = ln_weight * ln_weight if ln else None  # [H, 1, f]

    def run(weights, XQ, XK, XV, eta):
        # f_res learns xv - xk; the label's part of the LN-L2 gradient is (ln_b - label) ln_w
        label = (ln_b - (XV - XK)) * ln_w if ln else XV  # in the inputs' (token-major) layout
        Xq, Xk, label, eta = (t.movedim(2, 0) for t in (XQ, XK, label, eta))  # [N, B, H, ...]
        if bias:  # x -> [x, 1]
            Xq, Xk = (torch.cat([x, torch.ones_like(x[..., :1])], -1) for x in (Xq, Xk))
        E = eta.tril()  # the mask: token t only sees s <= t
        XK_last = (E[..., -1:, :].transpose(-1, -2) * Xk).transpose(-1, -2)  # XK^T diag(e)
        if not outputs:
            return None, tuple(scan.final_weights(weights, Xq, Xk, label, XK_last, E, w2))
        A = E * (Xq @ Xk.transpose(-1, -2))  # with the bias: E * (XQ XK^T + 1)
        Zbar, *weights = scan.apply(Xq, Xk, label, A, XK_last, E, w2, torch.is_grad_enabled(), *weights)
        Z = Zbar.permute(1, 0, 3, 2, 4).contiguous().permute(0, 3, 1, 2, 4)  # [B, H, N, b, f], token-major
        return (XQ + learner.layer_norm(Z, ln_w, ln_b) if ln else Z), tuple(weights)

    return in_groups(run, weights, (XQ, XK, XV, eta), checkpoint_every)


class DualScan(torch.autograd.Function):
    """What both learners' scans share. Inputs, mini-batch-major: XQ, XK [N, B, H, b, d] (d = f + 1 with
    the bias feature); label [N, B, H, b, f]: with LN, (ln_b - (xv - xk)) ln_w, else xv; A [N, B, H, b, b]
    = E * (XQ XK^T); XK_last [N, B, H, d, b] = XK^T diag(e); E [N, B, H, b, b]; w2 [H, 1, f] = ln_w^2
    (None without LN); then the initial weights. A subclass defines, for one mini-batch, `state` (what
    its output, the update and the backward need), `output`, `update` (the weights after it) and
    `step_backward`; and may keep part of each state from the forward for the backward (`keep`,
    `recompute`).
    """

    @classmethod
    def forward(cls, ctx, XQ, XK, label, A, XK_last, E, w2, training: bool, *weights):
        label_in = label  # as it came: its gradient takes its layout (see backward)
        XQ, XK, label, A, XK_last, E = (t.contiguous() for t in (XQ, XK, label, A, XK_last, E))
        Zbar = torch.empty_like(label)
        segments, kept = [], None
        for n in range(XK.shape[0]):
            if training and n % SEGMENT == 0:
                segments += weights
            inputs = (XQ[n], XK[n], label[n], A[n], XK_last[n], E[n], w2)
            state = cls.state(weights, *inputs)
            Zbar[n] = cls.output(weights, state, *inputs)
            if training and (keep := cls.keep(state)) is not None:
                kept = keep.new_empty(XK.shape[:1] + keep.shape) if kept is None else kept
                kept[n] = keep
            weights = cls.update(weights, state, *inputs)
        if training:
            ctx.n_weights = len(weights)
            ctx.save_for_backward(XQ, XK, label_in, A, XK_last, E, w2, kept, *segments)
        return Zbar, *weights

    @staticmethod
    def keep(state):
        """What the forward keeps of a mini-batch's state for the backward (None: nothing)."""
        return None

    @classmethod
    def recompute(cls, weights, kept, *inputs):
        """The backward's state of a mini-batch, from its weights and what the forward kept."""
        return cls.state(weights, *inputs)

    @classmethod
    def final_weights(cls, weights, XQ, XK, label, XK_last, E, w2):
        """Only the weights after the last mini-batch: the forward's steps without the outputs (nor A)."""
        for n in range(XK.shape[0]):
            inputs = (XQ[n], XK[n], label[n], None, XK_last[n], E[n], w2)
            weights = cls.update(weights, cls.state(weights, *inputs), *inputs)
        return weights

    @classmethod
    def backward(cls, ctx, dZbar, *dweights):
        XQ, XK, label, A, XK_last, E, w2, kept, *segments = ctx.saved_tensors
        k = ctx.n_weights
        dZbar = torch.zeros_like(label) if dZbar is None else dZbar.contiguous()
        dweights = tuple(
            None if w is None else torch.zeros_like(w) if d is None else d
            for w, d in zip(segments[:k], dweights, strict=True)
        )
        # laid out as the label came in (token-major from the layer): its parameters' sums stay cheap
        dlabel, label = torch.empty_like(label), label.contiguous()
        grads = [torch.empty_like(t) if t is not None else None
                 for t in (XQ, XK, A, XK_last, E if cls.uses_E else None)]
        dw2 = None if w2 is None else torch.zeros_like(dZbar[0])  # summed over mini-batches, then tokens
        N = XK.shape[0]
        for first in reversed(range(0, N, SEGMENT)):  # recompute the segment's weights and states
            weights, steps = tuple(segments[first // SEGMENT * k :][:k]), []
            for n in range(first, min(first + SEGMENT, N)):
                inputs = (XQ[n], XK[n], label[n], A[n], XK_last[n], E[n], w2)
                state = cls.recompute(weights, None if kept is None else kept[n], *inputs)
                steps.append((weights, state, inputs))
                weights = cls.update(weights, state, *inputs)
            for n in reversed(range(first, min(first + SEGMENT, N))):
                weights, state, inputs = steps.pop()
                dweights, dinputs, dlabel[n], dw2_n = cls.step_backward(
                    weights, state, inputs, dZbar[n], dweights
                )
                for g, d in zip(grads, dinputs, strict=True):
                    if g is not None:
                        g[n] = d
                if dw2 is not None:
                    dw2 += dw2_n
        dXQ, dXK, dA, dXK_last, dE = grads
        dw2 = None if w2 is None else dw2.sum((0, 2)).unsqueeze(1)
        return dXQ, dXK, dlabel, dA, dXK_last, dE, dw2, None, *dweights


class LinearDualScan(DualScan):
    """TTT-Linear: weights (W,), W [B, H, d, f] with the bias as its last row. The forward keeps every G
    (as small as an input), so the backward recomputes only the W's."""

    uses_E = False

    @staticmethod
    def state(weights, xq, xk, label, a, xk_last, E, w2):
        return learner.ln_l2_grad(xk @ weights[0], w2, label)  # G

    @staticmethod
    def output(weights, g, xq, xk, label, a, xk_last, E, w2):
        return xq @ weights[0] - a @ g

    @staticmethod
    def keep(g):
        return g

    @classmethod
    def recompute(cls, weights, g, *inputs):
        return g

    @staticmethod
    def update(weights, g, xq, xk, label, a, xk_last, E, w2):
        return (weights[0] - xk_last @ g,)

    @staticmethod
    def step_backward(weights, g, inputs, dzbar, dweights):
        (W,), (dW,) = weights, dweights  # dW: the gradient of the next mini-batch's W
        xq, xk, label, a, xk_last, E, w2 = inputs
        dxk_last = (dW @ g.transpose(-1, -2)).neg_()
        dg = (a.transpose(-1, -2) @ dzbar).neg_().sub_(xk_last.transpose(-1, -2) @ dW)
        dzk, dlabel, dw2 = learner.ln_l2_grad_backward(xk @ W, w2, label, g, dg)
        dxq, dxk = dzbar @ W.transpose(-1, -2), dzk @ W.transpose(-1, -2)
        da = (dzbar @ g.transpose(-1, -2)).neg_()
        dW = dW + xq.transpose(-1, -2) @ dzbar + xk.transpose(-1, -2) @ dzk
        return (dW,), (dxq, dxk, da, dxk_last, None), dlabel, dw2


class MLPDualScan(DualScan):
    """TTT-MLP: weights (W1, W2, b2), W1 [B, H, d, 4f] with b1 as its last row, b2 possibly None. Its
    states are 4f wide: the forward keeps none, the backward recomputes them a segment at a time."""

    uses_E = True

    @staticmethod
    def output(weights, state, *inputs):
        (_, W2, b2), (*_, g2, _, _, _, xbar2, _, a2) = weights, state
        zbar2 = xbar2 @ W2 - a2 @ g2
        return zbar2 if b2 is None else zbar2 + b2

    @staticmethod
    def state(weights, xq, xk, label, a1, xk_last, E, w2):
        """Everything of a mini-batch but its output Zbar2 = Xbar2 W2 + b2 - A2 G2."""
        W1, W2, b2 = weights
        z1 = xk @ W1
        x2 = learner.gelu(z1)
        z2 = x2 @ W2 if b2 is None else x2 @ W2 + b2
        g2 = learner.ln_l2_grad(z2, w2, label)
        h = g2 @ W2.transpose(-1, -2)
        g1 = gelu_backward(h, z1, approximate="tanh")  # G1 = (G2 W2^T) * gelu'(Z1)
        zbar1 = xq @ W1 - a1 @ g1
        xbar2 = learner.gelu(zbar1)
        m2 = xbar2 @ x2.transpose(-1, -2)
        a2 = E * (m2 if b2 is None else m2 + 1)
        return z1, x2, z2, g2, h, g1, zbar1, xbar2, m2, a2

    @staticmethod
    def update(weights, state, xq, xk, label, a1, xk_last, E, w2):
        (W1, W2, b2), (_, x2, _, g2, _, g1, *_) = weights, state
        eg2 = E[..., -1:, :].transpose(-1, -2) * g2  # diag(e) G2
        return (
            W1 - xk_last @ g1,
            W2 - x2.transpose(-1, -2) @ eg2,
            None if b2 is None else b2 - eg2.sum(-2, keepdim=True),
        )

    @staticmethod
    def step_backward(weights, state, inputs, dzbar2, dweights):
        (W1, W2, b2), (dW1, dW2, db2) = weights, dweights  # d*: gradients of the next mini-batch's
        xq, xk, label, a1, xk_last, E, w2 = inputs
        z1, x2, z2, g2, h, g1, zbar1, xbar2, m2, a2 = state
        T = lambda t: t.transpose(-1, -2)
        e = T(E[..., -1:, :])
        # the weights' updates: W1 -= XK_last G1, W2 -= X2^T diag(e) G2, b2 -= e^T G2
        dxk_last = (dW1 @ T(g1)).neg_()
        dg1 = (T(xk_last) @ dW1).neg_()
        deg2 = (x2 @ dW2).neg_() if db2 is None else (x2 @ dW2).neg_().sub_(db2)
        dx2 = ((e * g2) @ T(dW2)).neg_()
        dg2 = e * deg2
        dE = torch.zeros_like(E)
        dE[..., -1, :] = (deg2 * g2).sum(-1)
        # the output: Zbar2 = Xbar2 W2 + b2 - A2 G2, A2 = E * (Xbar2 X2^T + 1)
        dxbar2 = dzbar2 @ T(W2)
        dW2 = dW2 + T(xbar2) @ dzbar2
        db2 = None if b2 is None else db2 + dzbar2.sum(-2, keepdim=True)
        da2 = (dzbar2 @ T(g2)).neg_()
        dg2 -= T(a2) @ dzbar2
        dE += da2 * (m2 if b2 is None else m2 + 1)
        dm2 = da2 * E
        dxbar2 += dm2 @ x2
        dx2 += T(dm2) @ xbar2
        # Zbar1 = XQ W1 - A1 G1, Xbar2 = gelu(Zbar1)
        dzbar1 = gelu_backward(dxbar2, zbar1, approximate="tanh")
        dxq = dzbar1 @ T(W1)
        dW1 = dW1 + T(xq) @ dzbar1
        da1 = (dzbar1 @ T(g1)).neg_()
        dg1 -= T(a1) @ dzbar1
        # G1 = H * gelu'(Z1), H = G2 W2^T
        dh = gelu_backward(dg1, z1, approximate="tanh")
        dz1 = dg1 * h * learner.gelu_grad2(z1)
        dg2 += dh @ W2
        dW2 += T(dh) @ g2
        # G2 = LN-L2 gradient at Z2 = X2 W2 + b2, X2 = gelu(Z1), Z1 = XK W1
        dz2, dlabel, dw2 = learner.ln_l2_grad_backward(z2, w2, label, g2, dg2)
        dx2 += dz2 @ T(W2)
        dW2 += T(x2) @ dz2
        db2 = None if b2 is None else db2 + dz2.sum(-2, keepdim=True)
        dz1 += gelu_backward(dx2, z1, approximate="tanh")
        dxk = dz1 @ T(W1)
        dW1 += T(xk) @ dz1
        return (dW1, dW2, db2), (dxq, dxk, da1, dxk_last, dE), dlabel, dw2
