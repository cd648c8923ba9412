"""The dual form over all N mini-batches, fast: TTT-Linear and TTT-MLP (Section 2.5, Appendix A).

`forms.dual_step` over `forms.scan` is the reference (autograd through every op); this computes the same
function arranged for speed, each learner an autograd Function with a hand-written backward:
- everything that does not depend on the weights (the masked eta * (XQ XK^T + 1), eta's last row, the
  labels) is computed for all mini-batches in one batched op before the scan, the output LayerNorm after;
  for TTT-Linear also Zbar = XQ W - A G (from the per-mini-batch XQ W and G) and, in the backward, every
  part of the LN-L2 gradient's backward that does not depend on the carried gradient of W. TTT-Linear's
  Function (`LinearDual`) covers these batched parts too, with their gradients batched and accumulated in
  place (with fused=True, the layer's `fused` option, compiled by torch.compile: `fusion.fuse`);
  TTT-MLP's (`MLPDualScan`, the loop alone) leaves them to autograd;
- the bias of the first layer is the row of W for a feature that is always 1;
- the scan runs mini-batch-major ([N, B, H, ...]) so that every mini-batch it reads or writes is
  contiguous; Z comes back token-major (laid out [B, N, b, H, f], as the layer's projections), where the
  gradients of the per-head LayerNorm parameters are cheap sums over leading axes;
- per mini-batch, a few ops writing into preallocated buffers (`out=`, in-place `baddbmm_`): on CPUs a
  weight-sized temporary costs more than the matmul that fills it;
- the backward walks the mini-batches in reverse with the gradient of the weights; it keeps only every
  SEGMENT-th weights (N W's would take far more memory than the inputs) and gets the others from them:
  TTT-Linear undoes each mini-batch's update in place, TTT-MLP recomputes a segment at a time with the
  forward's own ops (and keeps every mini-batch's other state).

Mini-batch n starts from the weights W_n; with E = tril(eta) and e its last row (as a column):

    TTT-Linear  G = LN-L2 gradient at XK W,   Zbar = XQ W - (E * (XQ XK^T + 1)) G          (Equation 8)
                W_{n+1} = W - XK^T diag(e) G  (W with its bias row)
    TTT-MLP     G2 = LN-L2 gradient at Z2 = gelu(XK W1) W2 + b2,  G1 = (G2 W2^T) * gelu'(XK W1)
                Zbar1 = XQ W1 - (E * (XQ XK^T + 1)) G1,  X2bar = gelu(Zbar1)
                Zbar = X2bar W2 + b2 - (E * (X2bar X2^T + 1)) G2                     (Appendix A.3)
                W1 -= XK^T diag(e) G1,  W2 -= X2^T diag(e) G2,  b2 -= e^T G2
"""

from typing import NamedTuple

import torch

from ..fusion import fuse
from . import learner
from .forms import in_groups

SEGMENT = 16
gelu_backward = torch.ops.aten.gelu_backward  # gelu_backward(d, x) = d * gelu'(x), tanh approximation


def ttt_linear_dual(
    XQ, XK, XV, eta, W, b, ln_weight, ln_bias, *, checkpoint_every: int = 0, outputs: bool = True,
    fused: bool = False,
):
    """TTT-Linear in dual form over N mini-batches: the functional core.

    XQ, XK, XV: [B, H, N, b, f] test, training and label views; eta: [B, H, N, b, b] with
    eta[..., t, s] = token_eta[t] * lr[s] (applied below its diagonal only); W: [B, H, f, f] and
    b: [B, H, 1, f] (or None) the initial weights; ln_weight, ln_bias: [H, 1, f], or None for the plain
    linear learner f(x) = xW + b without LN and residual.
    Returns Z [B, H, N, b, f] (the layer output before post-norm, with the +XQ residual when LN is on),
    and W_last, b_last: the weights after the last mini-batch. outputs=False computes only the weights
    (Z is None; Figure 8 right times the W's alone), without gradients. fused=True runs the batched
    elementwise parts around the loop compiled by torch.compile (`fuse`).
    """
    f, bias = XQ.shape[-1], b is not None
    W = W if b is None else torch.cat([W, b], -2)
    if not outputs:
        with torch.no_grad():
            Xq, Xk, label, _, XKe, w2, _ = LinearDual.inputs(XQ, XK, XV, eta, ln_weight, ln_bias, bias)
            W = LinearDual.final_weights(W, Xq, Xk, label, XKe, w2)
        Z = None
    else:

        def run(weights, XQ, XK, XV, eta):
            training = torch.is_grad_enabled()
            Z, W = LinearDual.apply(XQ, XK, XV, eta, *weights, ln_weight, ln_bias, bias, training, fused)
            return Z, (W,)

        Z, (W,) = in_groups(run, (W,), (XQ, XK, XV, eta), checkpoint_every)
    return (Z, W, None) if b is None else (Z, W[..., :f, :], W[..., f:, :])


def ttt_mlp_dual(XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, *, checkpoint_every: int = 0,
                 fused: bool = False):
    """TTT-MLP in dual form over N mini-batches: as `ttt_linear_dual` with the weights of both layers,
    W1 [B, H, f, 4f], b1 [B, H, 1, 4f], W2 [B, H, 4f, f], b2 [B, H, 1, f] (the biases may be None).
    fused: each mini-batch's state (`MLPDualScan.state`, about 15 ops) compiled by torch.compile, fewer
    launches a mini-batch (issue 49). Returns Z and the weights after the last mini-batch (W1, b1, W2, b2)."""
    f = XQ.shape[-1]
    W1 = W1 if b1 is None else torch.cat([W1, b1], -2)
    Z, (W1, W2, b2) = _mlp_dual((W1, W2, b2), XQ, XK, XV, eta, b1 is not None, ln_weight, ln_bias,
                                checkpoint_every, fused)
    return Z, W1[..., :f, :], None if b1 is None else W1[..., f:, :], W2, b2


def _mlp_dual(weights, XQ, XK, XV, eta, bias, ln_weight, ln_bias, checkpoint_every: int, fused: bool):
    """The parts of TTT-MLP's dual form that do not depend on the weights, through autograd, around
    `MLPDualScan`, with gradient checkpointing through time (forms.in_groups)."""
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
        XKe = E[..., -1:, :].transpose(-1, -2) * Xk  # diag(e) XK: the update is W1 - XKe^T G1
        A = E * (Xq @ Xk.transpose(-1, -2))  # with the bias: E * (XQ XK^T + 1)
        Zbar, weights = MLPDualScan.run(Xq, Xk, label, A, XKe, E, w2, torch.is_grad_enabled(), fused,
                                        *weights)
        Z = Zbar.permute(1, 0, 3, 2, 4).contiguous().permute(0, 3, 1, 2, 4)  # [B, H, N, b, f], token-major
        return (XQ + learner.layer_norm(Z, ln_w, ln_b) if ln else Z), tuple(weights)

    return in_groups(run, weights, (XQ, XK, XV, eta), checkpoint_every)


class LinearDual(torch.autograd.Function):
    """TTT-Linear, all of it with a hand-written backward: (XQ, XK, XV, eta, W, ln_w, ln_b) -> (Z, W_N).

    Batched over all mini-batches, laid out mini-batch-major ([N, B, H, ...], contiguous): the inputs with
    a column of ones when there is a bias ([x, 1], W with its bias row), E = tril(eta), XKe = diag(e) XK,
    A = E * (XQ XK^T), the label (ln_b - (XV - XK)) ln_w (the z-independent part of the LN-L2 gradient),
    Zbar = ZQ - A G (Equation 8) and the output XQ + LN(Zbar), written token-major as the layer reads it.
    Only the recurrence of W runs mini-batch by mini-batch (`forward_loop`): ZQ_n = XQ_n W_n, G_n the
    LN-L2 gradient at XK_n W_n, W_{n+1} = W_n - XKe_n^T G_n, a handful of ops writing into preallocated
    buffers. The backward walks the mini-batches in reverse carrying dW (`backward_loop`); the gradients
    of the batched parts are batched again, accumulated in place into the loop's.
    """

    @staticmethod
    def inputs(XQ, XK, XV, eta, ln_w, ln_b, bias: bool):
        """The batched inputs of the loop, mini-batch-major: Xq, Xk (with the ones), the label, E, XKe, w2
        = ln_w^2, and with LN XK - XV (for the gradient of ln_w)."""
        Xq, Xk = (_mini_batch_major(x, bias) for x in (XQ, XK))
        f = XV.shape[-1]
        if ln_w is None:
            label, kv = XV.movedim(2, 0).contiguous(), None
        else:  # f_res learns xv - xk: the label's part of the LN-L2 gradient is (ln_b - (xv - xk)) ln_w
            kv = Xk[..., :f] - XV.movedim(2, 0)  # laid out as Xk (contiguous)
            label = torch.add(kv, ln_b).mul_(ln_w)
        E = eta.movedim(2, 0).tril()  # the mask: token t only sees s <= t
        XKe = E[..., -1, :].unsqueeze(-1) * Xk  # diag(e) XK: the update is W - XKe^T G
        return Xq, Xk, label, E, XKe, None if ln_w is None else ln_w * ln_w, kv

    @staticmethod
    def forward(ctx, XQ, XK, XV, eta, W, ln_w, ln_b, bias: bool, training: bool, fused: bool):
        Xq, Xk, label, E, XKe, w2, kv = fuse(LinearDual.inputs, fused)(XQ, XK, XV, eta, ln_w, ln_b, bias)
        M = _nbh(Xq) @ _nbh(Xk).mT  # XQ XK^T (+ 1 with the bias), [N B H, b, b]
        A = _nbh(E) * M
        ZQ, ZK, G, W, segments = LinearDual.forward_loop(Xq, Xk, label, XKe, w2, W, training)
        Zbar = _nbh(ZQ).baddbmm_(A, _nbh(G), alpha=-1).view_as(ZQ)  # ZQ - A G, in place
        Z, Zhat, mean, rstd = fuse(LinearDual.output, fused)(Zbar, XQ, ln_w, ln_b)
        if training:
            ctx.fused = fused
            ctx.save_for_backward(Xq, Xk, kv, label, E, XKe, M, A, w2, ZK, G, segments, Zbar, Zhat, mean,
                                  rstd, ln_w, ln_b)
        return Z, W

    @staticmethod
    def output(Zbar, XQ, ln_w, ln_b):
        """Z = XQ + LN(Zbar) (Z = Zbar without LN), the LN per head with ln_w, ln_b [H, 1, f], written
        token-major; and LN's Zhat, mean, rstd."""
        if ln_w is None:
            return _token_major_out(torch.add, Zbar, 0), None, None, None  # a copy
        Zhat, mean, rstd = torch.native_layer_norm(Zbar, Zbar.shape[-1:], None, None, learner.LN_EPS)
        return _token_major_out(torch.addcmul, ln_b, ln_w, Zhat).add_(XQ), Zhat, mean, rstd

    @staticmethod
    def output_backward(dZ, Zbar, Zhat, mean, rstd, ln_w):
        """Through Z = XQ + ln_w Zhat + ln_b: dZbar (mini-batch-major) and the gradients of ln_w, ln_b."""
        dZbar = torch.empty_like(Zbar).copy_(dZ.movedim(2, 0))
        if ln_w is None:
            return dZbar, None, None
        dln_w, dln_b = _head_sum(dZbar * Zhat), _head_sum(dZbar)
        return learner.ln_backward(dZbar.mul_(ln_w), Zbar, mean, rstd), dln_w, dln_b

    @staticmethod
    def backward(ctx, dZ, dW):
        Xq, Xk, kv, label, E, XKe, M, A, w2, ZK, G, segments, Zbar, Zhat, mean, rstd, ln_w, ln_b = (
            ctx.saved_tensors)
        f = G.shape[-1]
        dZbar, dln_w, dln_b = fuse(LinearDual.output_backward, ctx.fused)(dZ, Zbar, Zhat, mean, rstd, ln_w)
        # Zbar = ZQ - A G
        dA = _neg_bmm(_nbh(dZbar), _nbh(G).mT)
        dG = _neg_bmm(A.mT, _nbh(dZbar)).view_as(G)
        ln_l2 = learner.LNL2GradBackward(ZK, G, w2, label, fused=ctx.fused)
        dXq, dXk, minus_dXKe, dW = LinearDual.backward_loop(Xq, Xk, XKe, G, segments, dZbar, dG, dW, ln_l2)
        stats = (ZK, ln_l2.z_hat, ln_l2.mean, ln_l2.rstd) if ln_w is not None else ()  # LN's, at ZK
        del ln_l2  # the rest
        # XKe = diag(e) XK, A = E * M, M = XQ XK^T
        dE = (dA * M).view_as(E)
        dM = dA.mul_(_nbh(E))
        _nbh(dXq).baddbmm_(dM, _nbh(Xk)[..., :f])
        _nbh(dXk).baddbmm_(dM.mT, _nbh(Xq)[..., :f])
        dXQ, dXK, dXV, de, dln_w_label, dln_b_label = fuse(LinearDual.input_gradients, ctx.fused)(
            dZ, dXq, dXk, Xk, E[..., -1, :, None], minus_dXKe, dG, kv, ln_w, ln_b, *stats)
        dE[..., -1, :] += de
        deta = dE.tril_().movedim(0, 2)
        if ln_w is not None:
            dln_w, dln_b = dln_w + dln_w_label, dln_b + dln_b_label
        return dXQ, dXK, dXV, deta, dW, dln_w, dln_b, None, None, None

    @staticmethod
    def input_gradients(dZ, dXq, dXk, Xk, e, minus_dXKe, dG, kv, ln_w, ln_b, ZK=None, z_hat=None, mean=None,
                        rstd=None):
        """The gradients of XQ, XK, XV in the inputs' token-major layout and of e, from those of Xq and Xk
        through the loop and A (dXq, dXk), of XKe = diag(e) Xk (negated) and of G (dG): through the label c
        of G (the LN-L2 gradient at ZK, LN's statistics z_hat, mean, rstd given: dc = J dG, as
        `learner.LNL2GradBackward`), c = (ln_b - (XV - XK)) ln_w, and the residual. With LN also the
        gradients of ln_w, ln_b through the label and w2 = ln_w^2."""
        de = -torch.linalg.vecdot(minus_dXKe, Xk)
        minus_dXKe = minus_dXKe[..., : dXk.shape[-1]]  # not the ones column's
        if ln_w is None:  # Z = Zbar, G = ZK - XV
            dXQ = _token_major_out(torch.add, dXq, 0)  # a copy
            dXK = _token_major_out(torch.addcmul, dXk, e, minus_dXKe, value=-1)
            return dXQ, dXK, _token_major_out(torch.neg, dG), de, None, None
        dXQ = _token_major_out(torch.add, dXq, dZ.movedim(2, 0))  # and the residual's
        dlabel = learner.ln_backward(dG, ZK, mean, rstd)
        dXK = _token_major_out(torch.addcmul, dXk, dlabel, ln_w)
        dXK.addcmul_(e.movedim(0, 2), minus_dXKe.movedim(0, 2), value=-1)
        dXV = _token_major_out(torch.mul, dlabel, -ln_w)
        dlabel_sum = _head_sum(dlabel)
        dln_w = _head_sum(dlabel * kv) + dlabel_sum * ln_b + 2 * ln_w * _head_sum(dlabel * z_hat)
        return dXQ, dXK, dXV, de, dln_w, dlabel_sum * ln_w

    @staticmethod
    def forward_loop(XQ, XK, label, XKe, w2, W, training: bool):
        """ZQ_n = XQ_n W_n and G_n (the LN-L2 gradient at ZK_n = XK_n W_n) for every n, the weights after
        the last mini-batch, and when training the weights after every SEGMENT mini-batches (and after the
        last)."""
        N, f = XK.shape[0], label.shape[-1]
        ZQ, ZK, G = (XK.new_empty(XK.shape[:-1] + (f,)) for _ in range(3))
        W = _contiguous_copy(W)
        segments = _segment_buffer(W, N) if training else None
        w = _bh(W)  # updated in place
        # lower case: each mini-batch's [B H, r, c] view of a tensor, all made at once (_t: transposed)
        xq, xk, xke_t, zq, zk, g = map(_per_mini_batch, (XQ, XK, XKe.mT, ZQ, ZK, G))
        zk4, label4, g4 = ZK.unbind(0), label.unbind(0), G.unbind(0)
        for n in range(N):
            torch.bmm(xk[n], w, out=zk[n])
            torch.bmm(xq[n], w, out=zq[n])
            g4[n].copy_(learner.ln_l2_grad(zk4[n], w2, label4[n]))
            w.baddbmm_(xke_t[n], g[n], alpha=-1)  # W_{n+1} = W_n - XK^T diag(e) G, in place
            if training and (n % SEGMENT == SEGMENT - 1 or n == N - 1):
                segments[n // SEGMENT] = W
        return ZQ, ZK, G, W, segments

    @staticmethod
    def final_weights(W, XQ, XK, label, XKe, w2):
        """Only the weights after the last mini-batch (no outputs, no gradients)."""
        W = _contiguous_copy(W)
        for n in range(XK.shape[0]):
            _minus_product(W, XKe[n].mT, learner.ln_l2_grad(XK[n] @ W, w2, label[n]))
        return W

    @staticmethod
    def backward_loop(XQ, XK, XKe, G, segments, dZQ, dG, dW, ln_l2):
        """The reverse walk: from dZQ_n and dG_n (through Zbar) and the gradient of the last weights, the
        gradients of XQ and XK (not of their ones column), XKe (negated) and the first weights. Per
        mini-batch only what depends on the carried dW: dG_n -= XKe_n dW (in place: dG becomes G's gradient
        through both paths), the LN-L2 gradient's backward (`ln_l2`, learner.LNL2GradBackward), and the
        products with W_n; what needs only dG (the label's gradient) is batched after. W_n comes from the
        kept weights after its segment, each mini-batch's update undone in place (at most SEGMENT float
        roundings away from the forward's)."""
        N, f = XK.shape[0], G.shape[-1]
        dW = torch.zeros_like(segments[0]) if dW is None else _contiguous_copy(dW)
        minus_dXKe = torch.empty_like(XKe)
        dXQ, dXK = (x.new_empty(x.shape[:-1] + (f,)) for x in (XQ, XK))  # without the ones column
        ln_l2_n = ln_l2.rows()
        W_t = dW.new_empty(dW.shape[:-2] + (f, f))  # W_n^T without its bias row: dZ W^T reads it contiguous
        # lower case: each mini-batch's [B H, r, c] view of a tensor, all made at once (_t: transposed)
        g, dg, xke, dzq, dxke, dxq, dxk = map(_per_mini_batch, (G, dG, XKe, dZQ, minus_dXKe, dXQ, dXK))
        dg4, xke_f = dG.unbind(0), _per_mini_batch(XKe[..., :f])
        xq_t, xk_t, g_t = map(_per_mini_batch, (XQ.mT, XK.mT, G.mT))
        dw, dw_t, w_t = _bh(dW), _bh(dW).mT, _bh(W_t)
        for first in reversed(range(0, N, SEGMENT)):
            W_t.copy_(segments[first // SEGMENT][..., :f, :].mT)  # the weights after the segment
            for n in reversed(range(first, min(first + SEGMENT, N))):
                w_t.baddbmm_(g_t[n], xke_f[n])  # W_n^T = W_{n+1}^T + G_n^T XKe_n: the update undone
                # W_{n+1} = W_n - XKe_n^T G_n: dXKe_n = -G_n dW^T (returned negated),
                # and G_n's gradient through both paths: dG_n - XKe_n dW
                torch.bmm(g[n], dw_t, out=dxke[n])
                dg[n].baddbmm_(xke[n], dw, alpha=-1)
                dzk = _bh(ln_l2_n[n].dz(dg4[n]))
                # ZQ_n = XQ_n W_n, ZK_n = XK_n W_n
                dw.baddbmm_(xq_t[n], dzq[n]).baddbmm_(xk_t[n], dzk)
                torch.bmm(dzq[n], w_t, out=dxq[n])
                torch.bmm(dzk, w_t, out=dxk[n])
        return dXQ, dXK, minus_dXKe, dW


def _per_mini_batch(t: torch.Tensor) -> tuple:
    """[N, B, H, r, c] as N views [B * H, r, c], made at once (the loops index them)."""
    return t.flatten(1, 2).unbind(0)


def _mini_batch_major(x: torch.Tensor, ones: bool) -> torch.Tensor:
    """[B, H, N, b, d] (any layout) copied to a contiguous [N, B, H, b, d (+ 1)], with a column of ones."""
    out = x.new_empty((x.shape[2], x.shape[0], x.shape[1], x.shape[3], x.shape[4] + ones))
    out[..., : x.shape[-1]] = x.movedim(2, 0)
    if ones:
        out[..., -1] = 1
    return out


def _token_major_out(op, *args, **kwargs) -> torch.Tensor:
    """op(*args) of [N, B, H, b, f] operands, written token-major (laid out [B, N, b, H, f], as the layer's
    projections give and read them), as [B, H, N, b, f]: with out= into such a buffer, or under
    torch.compile (where an out= into a strided view breaks the graph) laid out so."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs).permute(1, 0, 3, 2, 4).contiguous().permute(0, 3, 1, 2, 4)
    N, B, H, b, f = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, torch.Tensor)))
    out = args[0].new_empty(B, N, b, H, f).permute(0, 3, 1, 2, 4)
    op(*args, **kwargs, out=out.movedim(2, 0))
    return out


def _neg_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """-(a @ b) for batches of matrices, the sign in the product (baddbmm with beta 0 ignores its input)."""
    return torch.baddbmm(a.new_zeros(()).expand(a.shape[0], a.shape[1], b.shape[2]), a, b, beta=0, alpha=-1)


def _nbh(t: torch.Tensor) -> torch.Tensor:
    """[N, B, H, r, c] (contiguous) as [N B H, r, c], a view, for batched matmuls over all mini-batches."""
    return t.flatten(0, 2)


def _head_sum(t: torch.Tensor) -> torch.Tensor:
    """[N, B, H, b, f] summed to a per-head [H, 1, f], contiguous axes first (fast)."""
    return t.sum((0, 1)).sum(-2, keepdim=True)


def _bh(t: torch.Tensor) -> torch.Tensor:
    """[B, H, r, c] (contiguous) as [B * H, r, c], a view, for bmm and its out=."""
    return t.flatten(0, 1)


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy to update in place."""
    return t.clone(memory_format=torch.contiguous_format)


def _segment_buffer(w: torch.Tensor, N: int) -> torch.Tensor:
    """A buffer for one weights per SEGMENT mini-batches."""
    return w.new_empty(((N + SEGMENT - 1) // SEGMENT,) + w.shape)


def _minus_product(W, x, y, out=None):
    """W - x y per (sequence, head): into `out`, or without it in place (a weight-sized temporary costs
    more than the matmul)."""
    if out is None:
        _bh(W).baddbmm_(_bh(x), _bh(y), alpha=-1)
    else:
        torch.baddbmm(_bh(W), _bh(x), _bh(y), alpha=-1, out=_bh(out))


def _strided_like(t: torch.Tensor, stride) -> torch.Tensor:
    """t copied into the layout `stride` (the label's gradient as the label came in, token-major from the
    layer: the sums for its LN parameters stay cheap)."""
    return t.new_empty_strided(t.shape, stride).copy_(t)


class MLPState(NamedTuple):
    """A TTT-MLP mini-batch: what its output, its weights' update and its backward need."""

    z1: torch.Tensor  # XK W1
    x2: torch.Tensor  # gelu(Z1)
    dgelu1: torch.Tensor  # gelu'(Z1)
    z2: torch.Tensor  # X2 W2 + b2
    g2: torch.Tensor  # the LN-L2 gradient at Z2
    h: torch.Tensor  # G2 W2^T
    g1: torch.Tensor  # H * gelu'(Z1)
    zbar1: torch.Tensor  # XQ W1 - A1 G1
    xbar2: torch.Tensor  # gelu(Zbar1)
    m2: torch.Tensor  # Xbar2 X2^T
    a2: torch.Tensor  # E * (M2 + 1)


class MLPDualScan(torch.autograd.Function):
    """TTT-MLP: weights (W1, W2, b2), W1 [B, H, d, 4f] with b1 as its last row, b2 possibly None. Inputs,
    mini-batch-major: XQ, XK [N, B, H, b, d]; label [N, B, H, b, f]; A [N, B, H, b, b] = E * (XQ XK^T);
    XKe [N, B, H, b, d] = diag(e) XK; E = tril(eta); w2 [H, 1, f] = ln_w^2 (None without LN).

    A mini-batch's output depends on its weights through GELU, so all of it runs in the loop. Weights and
    their gradients are updated in place (a weight-sized temporary costs more than the matmul that fills
    it). The forward keeps every mini-batch's state (`MLPState`, about 25x its inputs; the layer's
    checkpoint_every bounds it) but only every SEGMENT-th weights (each 4f wide): the backward recomputes a
    segment's weights from the kept states before walking it in reverse.
    """

    @classmethod
    def run(cls, *inputs):
        Zbar, *weights = cls.apply(*inputs)
        return Zbar, weights

    @staticmethod
    def forward(ctx, XQ, XK, label, A, XKe, E, w2, training: bool, fused: bool, *weights):
        ctx.label_stride = label.stride()  # see _strided_like
        XQ, XK, label, A, XKe, E = (t.contiguous() for t in (XQ, XK, label, A, XKe, E))
        N = XK.shape[0]
        weights = tuple(None if w is None else _contiguous_copy(w) for w in weights)
        segments = tuple(None if w is None or not training else _segment_buffer(w, N) for w in weights)
        Zbar, states = torch.empty_like(label), []
        for n in range(N):
            if training and n % SEGMENT == 0:
                for segment, w in zip(segments, weights, strict=True):
                    if w is not None:
                        segment[n // SEGMENT] = w
            state = fuse(MLPDualScan.state, fused)(weights, XQ[n], XK[n], label[n], A[n], E[n], w2)
            MLPDualScan.output(weights, state, out=Zbar[n])
            MLPDualScan.update(weights, state, XKe[n], E[n])  # in place
            if training:
                states.extend(state)
        if training:
            ctx.save_for_backward(XQ, XK, label, A, XKe, E, w2, *segments, *states)
        return Zbar, *weights

    @staticmethod
    def state(weights, xq, xk, label, a1, E, w2) -> MLPState:
        """Everything of a mini-batch but its output Zbar2 = Xbar2 W2 + b2 - A2 G2."""
        W1, W2, b2 = weights
        z1 = xk @ W1
        x2, dgelu1 = learner.gelu_and_grad(z1)
        z2 = x2 @ W2 if b2 is None else x2 @ W2 + b2
        g2 = learner.ln_l2_grad(z2, w2, label)
        h = g2 @ W2.transpose(-1, -2)
        g1 = h * dgelu1  # G1 = (G2 W2^T) * gelu'(Z1)
        zbar1 = _bh(xq @ W1).baddbmm_(_bh(a1), _bh(g1), alpha=-1).view_as(z1)  # XQ W1 - A1 G1
        xbar2 = learner.gelu(zbar1)
        m2 = xbar2 @ x2.transpose(-1, -2)
        a2 = E * (m2 if b2 is None else m2 + 1)
        return MLPState(z1, x2, dgelu1, z2, g2, h, g1, zbar1, xbar2, m2, a2)

    @staticmethod
    def output(weights, state: MLPState, out):
        _, W2, b2 = weights
        torch.bmm(_bh(state.xbar2), _bh(W2), out=_bh(out)).baddbmm_(_bh(state.a2), _bh(state.g2), alpha=-1)
        if b2 is not None:
            out += b2

    @staticmethod
    def update(weights, state: MLPState, xke, E, out=None):
        """The weights after the mini-batch, W1 - XKe^T G1, W2 - X2^T diag(e) G2, b2 - e^T G2: into
        `out`, or in place."""
        W1, W2, b2 = weights
        eg2 = E[..., -1:, :].transpose(-1, -2) * state.g2  # diag(e) G2
        _minus_product(W1, xke.mT, state.g1, out and out[0])
        _minus_product(W2, state.x2.transpose(-1, -2), eg2, out and out[1])
        if b2 is not None:
            torch.sub(b2, eg2.sum(-2, keepdim=True), out=b2 if out is None else out[2])

    @staticmethod
    def backward(ctx, dZbar, *dweights):
        XQ, XK, label, A, XKe, E, w2, *saved = ctx.saved_tensors
        N, k = XK.shape[0], len(MLPState._fields)
        segments, saved = saved[: len(dweights)], saved[len(dweights) :]
        states = [MLPState(*saved[i : i + k]) for i in range(0, len(saved), k)]
        dZbar = torch.zeros_like(label) if dZbar is None else dZbar.contiguous()
        dweights = tuple(  # the gradients of the next mini-batch's weights, carried in place
            None if s is None else torch.zeros_like(s[0]) if d is None else _contiguous_copy(d)
            for s, d in zip(segments, dweights, strict=True)
        )
        dXQ, dXK, dA, dXKe, dE, dlabel = map(torch.empty_like, (XQ, XK, A, XKe, E, label))
        dw2 = None if w2 is None else torch.zeros_like(dZbar[0])  # summed over mini-batches, then tokens
        Ws = tuple(None if s is None else s.new_empty((SEGMENT,) + s.shape[1:]) for s in segments)
        at = lambda i: tuple(None if W is None else W[i] for W in Ws)  # the weights of the i-th in a segment
        for first in reversed(range(0, N, SEGMENT)):  # recompute the segment's weights
            last = min(first + SEGMENT, N)
            for W, s in zip(Ws, segments, strict=True):
                if W is not None:
                    W[0] = s[first // SEGMENT]
            for n in range(first, last - 1):
                MLPDualScan.update(at(n - first), states[n], XKe[n], E[n], out=at(n - first + 1))
            for n in reversed(range(first, last)):
                inputs = (XQ[n], XK[n], label[n], A[n], XKe[n], E[n], w2)
                dw2_n = MLPDualScan.step_backward(at(n - first), states[n], inputs, dZbar[n], dweights,
                                                  out=(dXQ[n], dXK[n], dA[n], dXKe[n], dE[n], dlabel[n]))
                if dw2 is not None:
                    dw2 += dw2_n
        dw2 = None if w2 is None else dw2.sum((0, 2)).unsqueeze(1)
        return dXQ, dXK, _strided_like(dlabel, ctx.label_stride), dA, dXKe, dE, dw2, None, None, *dweights

    @staticmethod
    def step_backward(weights, state: MLPState, inputs, dzbar2, dweights, out):
        """One mini-batch in reverse: writes the gradients of its inputs into `out` and turns `dweights`
        (the next mini-batch's weights' gradients) into its own, in place; returns the terms of dw2."""
        (W1, W2, b2), (dW1, dW2, db2) = weights, dweights
        xq, xk, label, a1, xke, E, w2 = inputs
        z1, x2, dgelu1, z2, g2, h, g1, zbar1, xbar2, m2, a2 = state
        dxq, dxk, da1, dxke, dE, dlabel = out
        T = lambda t: t.transpose(-1, -2)
        e = T(E[..., -1:, :])
        # the weights' updates: W1 -= XKe^T G1, W2 -= X2^T diag(e) G2, b2 -= e^T G2
        torch.bmm(_bh(g1), _bh(dW1).mT, out=_bh(dxke)).neg_()
        dg1 = (xke @ dW1).neg_()
        deg2 = (x2 @ dW2).neg_() if db2 is None else (x2 @ dW2).neg_().sub_(db2)
        dx2 = ((e * g2) @ T(dW2)).neg_()
        dg2 = e * deg2
        dE.zero_()
        dE[..., -1, :] = (deg2 * g2).sum(-1)
        # the output: Zbar2 = Xbar2 W2 + b2 - A2 G2, A2 = E * (Xbar2 X2^T + 1)
        dxbar2 = dzbar2 @ T(W2)
        da2 = (dzbar2 @ T(g2)).neg_()
        _bh(dg2).baddbmm_(_bh(a2).mT, _bh(dzbar2), alpha=-1)
        dE.addcmul_(da2, m2 if b2 is None else m2 + 1)
        dm2 = da2 * E
        _bh(dxbar2).baddbmm_(_bh(dm2), _bh(x2))
        _bh(dx2).baddbmm_(_bh(dm2).mT, _bh(xbar2))
        # Zbar1 = XQ W1 - A1 G1, Xbar2 = gelu(Zbar1)
        dzbar1 = gelu_backward(dxbar2, zbar1, approximate="tanh")
        torch.bmm(_bh(dzbar1), _bh(W1).mT, out=_bh(dxq))
        torch.bmm(_bh(dzbar1), _bh(g1).mT, out=_bh(da1)).neg_()
        _bh(dg1).baddbmm_(_bh(a1).mT, _bh(dzbar1), alpha=-1)
        # G1 = H * gelu'(Z1), H = G2 W2^T
        dh = dg1 * dgelu1
        dz1 = dg1.mul_(h).mul_(learner.gelu_grad2(z1))
        _bh(dg2).baddbmm_(_bh(dh), _bh(W2))
        # G2 = LN-L2 gradient at Z2 = X2 W2 + b2, X2 = gelu(Z1), Z1 = XK W1
        ln_l2 = learner.LNL2GradBackward(z2, g2, w2, label)
        dc = ln_l2.dc(dg2)
        dz2 = ln_l2.dz(dg2, dc=dc)
        dlabel.copy_(dc)
        _bh(dx2).baddbmm_(_bh(dz2), _bh(W2).mT)
        dz1.addcmul_(dx2, dgelu1)
        torch.bmm(_bh(dz1), _bh(W1).mT, out=_bh(dxk))
        # this mini-batch's weights' gradients, in place
        for x, dz in ((xbar2, dzbar2), (dh, g2), (x2, dz2)):
            _bh(dW2).baddbmm_(_bh(x).mT, _bh(dz))
        if db2 is not None:
            db2 += dzbar2.sum(-2, keepdim=True) + dz2.sum(-2, keepdim=True)
        _bh(dW1).baddbmm_(_bh(xq).mT, _bh(dzbar1)).baddbmm_(_bh(xk).mT, _bh(dz1))
        return ln_l2.dw2_terms(dc)


BATCH_GD_CHUNK = 64


def ttt_linear_batch_gd(XQ, XK, XV, token_eta, lr, W, b, ln=None, chunk: int = BATCH_GD_CHUNK,
                        outputs: bool = True):
    """One mini-batch of TTT-Linear that is the whole sequence (batch GD, b = T: Theorem 1's rows of
    Table 1), in O(T c f) rather than the dual form's O(T^2 f). Every gradient is taken at W_0, and
    eta[t, s] = token_eta[t] lr[s] factors, so Equation 8 with its mask is chunked causal linear attention:

        z_t = x_t W_0 + b - token_eta[t] (x_t S_t + s_t),
        S_t = sum_{s <= t} lr_s x_s^T g_s,  s_t = sum_{s <= t} lr_s g_s

    within a chunk of c tokens the masked products, across chunks the running sums. The same function as
    `forms.dual_step` with b = T (tests/test_ttt_forms.py), autograd for the backward.
    XQ, XK, XV [B, H, T, f]; token_eta [T]; lr [B, H, T]; W [B, H, f, f]; b [B, H, 1, f] or None; ln: the
    LN's (weight, bias) [H, 1, f] or None. Returns Z [B, H, T, f] (with the +XQ residual under LN) and the
    weights after the mini-batch (W_T, b_T); outputs=False computes only the weights (Z is None).
    """
    B, H, T, f = XQ.shape
    (X,), (G,) = learner.grads((W, b), XK, XV, ln)
    G = lr[..., None] * G  # lr_s g_s
    Wb, Xq = W, XQ
    if b is not None:  # the bias is the weight of a feature that is always 1
        ones = XQ.new_ones(B, H, T, 1)
        Wb, Xq, X = torch.cat([W, b], -2), torch.cat([XQ, ones], -1), torch.cat([X, ones], -1)
    c = chunk if T % chunk == 0 else T
    n, F = T // c, Xq.shape[-1]
    Xq_c, X_c, G_c = Xq.reshape(B, H, n, c, F), X.reshape(B, H, n, c, F), G.reshape(B, H, n, c, f)
    kv = X_c.mT @ G_c  # each chunk's sum_s x_s^T lr_s g_s, [B, H, n, F, f]
    W_T = Wb - token_eta[-1] * kv.sum(2)
    Z = None
    if outputs:
        before = kv.cumsum(2) - kv  # the sums over the chunks before
        inner = (Xq_c @ X_c.mT).tril() @ G_c  # within the chunk, s <= t
        Z = (Xq_c @ Wb.unsqueeze(2) - token_eta.view(n, c, 1) * (Xq_c @ before + inner)).view(B, H, T, f)
        Z = XQ + learner.layer_norm(Z, *ln) if ln is not None else Z
    return (Z, W_T, None) if b is None else (Z, W_T[..., :f, :], W_T[..., f:, :])
