"""TTT's inner loop (Sun et al., 2024, Sections 2.4-2.5) as ops, one entry point each with a `backend`
argument, every backend beside its reference (as flash-linear-attention's fla/ops/ttt):

    linear(xq, xk, xv, lr, token_eta, (W, b), ln)            TTT-Linear over mini-batches
    mlp(xq, xk, xv, lr, token_eta, (W1, b1, W2, b2), ln)     TTT-MLP over mini-batches
    step(params, sums, xq, xk, xv, lr, token_eta, ln)        tokens of a mini-batch begun earlier (decoding)
    linear_prefill(xq, xk, xv, lr, W, b, ln_w, ln_b, ...)    TTT-Linear over a whole sequence, forward only

Inputs are heads-major, xq/xk/xv [B, H, T, f] (N mini-batches of b tokens and a short last one), lr
[B, H, T] the inner learning rate of every token and token_eta [b] the scaling of each position of a
mini-batch; within a mini-batch eta[t, s] = token_eta[t] lr[s] (Equation 6, `eta`). `ln` is the pair
(weight, bias) [H, 1, f] of the inner LayerNorm-and-residual, or None. Each op returns the outputs
z [B, H, T, f] and the weights after the last complete mini-batch (a short last one is what `step` carries
on from).

Backends of `linear` and `mlp` compute the same function (tests/test_ops_ttt.py compares each with `naive`
in float64, outputs and gradients):
  naive   naive.py: token by token, each gradient by autograd (Figure 6): the reference, slow;
  primal  forms.py: a mini-batch at a time, every W_t materialised (Appendix A.2);
  dual    dual_scan.py: the dual form over all mini-batches with hand-written backwards (Appendix A.3);
          TTT-Linear with one mini-batch longer than dual_scan.BATCH_GD_CHUNK runs as chunked batch GD;
  triton  ../ttt_linear.py, ../ttt_mlp.py: the dual form in one Triton program per (sequence, head),
          forward and backward kernels, matmuls in `precision` (ieee or tf32); TTT-Linear's reads 16-bit
          strided activations as they are and builds eta on chip.
Whether a Triton kernel takes given inputs: `kernels.dual_why_not` / `mlp_why_not`; whether it passed its
check on this GPU is the caller's (ttt_bench/models/ttt/kernel_check.py).
"""


import torch

from . import dual_scan, forms, naive

BACKENDS = ("naive", "primal", "dual", "triton")
STEP_BACKENDS = ("primal", "triton")
PREFILL_BACKENDS = ("torch", "triton")


def eta(token_eta: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    """eta[t, s] = token_eta[t] * lr[s]: [..., c, c] from token_eta [c] and lr [..., c]   (Equation 6)."""
    return token_eta[:, None] * lr[..., None, :]


def _run(dual, triton, params, xq, xk, xv, lr, token_eta, ln, backend, precision, checkpoint_every, fused):
    """A learner's op: `dual` its PyTorch dual form (dual_scan), `triton` a call of its Triton kernel on whole
    mini-batches. The complete mini-batches run in `backend`, a last short one (T not a multiple of b) in
    forms' step."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    b = token_eta.shape[0]
    if backend == "naive":
        return naive.naive_ttt(params, xq, xk, xv, lr, token_eta, b, ln)
    B, H, T, f = xq.shape
    N, rest = divmod(T, b)
    outs = []
    if N and backend == "triton":
        whole = lambda v: v[..., : N * b, :]
        Z, params = triton(whole(xq), whole(xk), whole(xv), lr[..., : N * b], token_eta, params, ln,
                           precision or "ieee")
        outs.append(Z)
    elif N:
        mini_batches = lambda v: v[:, :, : N * b].reshape(B, H, N, b, -1)
        XQ, XK, XV = mini_batches(xq), mini_batches(xk), mini_batches(xv)
        E = eta(token_eta, lr[..., : N * b].reshape(B, H, N, b))
        if backend == "primal":
            Z, params = forms.ttt_scan("primal", params, XQ, XK, XV, E, ln, checkpoint_every)
        else:
            norm = ln or (None, None)
            Z, *params = dual(XQ, XK, XV, E, *params, *norm, checkpoint_every=checkpoint_every, fused=fused)
        outs.append(Z.reshape(B, H, N * b, f))
    if rest:  # in float32 at least (a Triton backend reads 16-bit activations as they are)
        last = lambda v: v[..., N * b :, :].to(torch.promote_types(v.dtype, torch.float32))
        z, _ = forms.STEPS["primal" if backend == "primal" else "dual"](
            params, last(xq), last(xk), last(xv), eta(token_eta[:rest], lr[..., N * b :]), ln)
        outs.append(z)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), tuple(params)


def _triton_linear(xq, xk, xv, lr, token_eta, params, ln, precision):
    """../ttt_linear.py's kernel: strided [B, H, T, f] inputs in their dtype, eta built on chip."""
    from .. import ttt_linear_dual  # looked up at each call

    Z, *params = ttt_linear_dual(xq, xk, xv, lr, token_eta, *params, *ln, precision=precision)
    return Z, tuple(params)


def _triton_mlp(xq, xk, xv, lr, token_eta, params, ln, precision):
    """../ttt_mlp.py's kernel: mini-batch-major [B, H, N, b, f] inputs and eta [B, H, N, b, b]."""
    from .. import ttt_mlp_dual

    B, H, T, f = xq.shape
    b = token_eta.shape[0]
    mini_batches = lambda v: v.reshape(B, H, T // b, b, -1)
    E = eta(token_eta, lr.reshape(B, H, T // b, b))
    Z, *params = ttt_mlp_dual(*map(mini_batches, (xq, xk, xv)), E, *params, *ln, precision=precision)
    return Z.reshape(B, H, T, f), tuple(params)


def linear(xq, xk, xv, lr, token_eta, params, ln=None, *, backend: str = "dual", precision: str | None = None,
           checkpoint_every: int = 0, fused: bool = False):
    """TTT-Linear, f(x) = x W + b (+ x + LN(.) with `ln`), over mini-batches: (z, (W, b)).

    params (W [B, H, f, f], b [B, H, 1, f] or None): W_0. checkpoint_every: mini-batches between gradient
    checkpoints through time (primal, dual); fused: torch.compile'd elementwise work (dual)."""
    if backend == "dual" and xq.shape[2] == token_eta.shape[0] > dual_scan.BATCH_GD_CHUNK:
        # b = T, one mini-batch: chunked, O(T c f) instead of the [T, T] dual form's O(T^2 f)
        Z, *params = dual_scan.ttt_linear_batch_gd(xq, xk, xv, token_eta, lr, *params, ln)
        return Z, tuple(params)
    return _run(dual_scan.ttt_linear_dual, _triton_linear, params, xq, xk, xv, lr, token_eta, ln, backend,
                precision, checkpoint_every, fused)


def mlp(xq, xk, xv, lr, token_eta, params, ln=None, *, backend: str = "dual", precision: str | None = None,
        checkpoint_every: int = 0, fused: bool = False):
    """TTT-MLP, f(x) = gelu(x W1 + b1) W2 + b2 (+ x + LN(.) with `ln`), over mini-batches:
    (z, (W1, b1, W2, b2)). params: W1 [B, H, f, m f], b1 [B, H, 1, m f], W2 [B, H, m f, f], b2 [B, H, 1, f]
    (biases may be None), as `linear` otherwise."""
    return _run(dual_scan.ttt_mlp_dual, _triton_mlp, params, xq, xk, xv, lr, token_eta, ln, backend,
                precision, checkpoint_every, fused)


def step(params, sums, xq, xk, xv, lr, token_eta, ln=None, *, backend: str = "primal"):
    """c tokens of one mini-batch begun earlier, any learner (decoding): sums = sum_s lr_s G_s over its
    earlier tokens (None: none yet), token_eta [c] the scaling of these tokens' positions, lr [B, H, c].
    Every G is taken at params = W_{t'}, and W_t = W_{t'} - token_eta[t] (sums + sum_{s <= t} lr_s G_s)
    (Equation 6). Returns (z [B, H, c, f], the sums after the last token).
    backend: primal (forms.primal_step), or triton for one token (../ttt_decode.py, ../ttt_mlp_decode.py;
    their backward a PyTorch recomputation: decode.py)."""
    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend must be one of {STEP_BACKENDS}, got {backend!r}")
    if sums is None:
        sums = tuple(None if p is None else torch.zeros_like(p) for p in params)
    if backend == "triton":  # one token, in the decode kernel of the learner (by its number of weights)
        from .decode import ttt_linear_decode, ttt_mlp_decode

        kernel = ttt_linear_decode if len(params) == 2 else ttt_mlp_decode
        z, *sums = kernel(xq, xk, xv, lr[..., 0], token_eta[0], *params, *sums, *ln)
        return z, tuple(sums)
    return forms.primal_step(params, xq, xk, xv, eta(token_eta, lr), ln,
                             pending=(sums, token_eta[:, None], lr[..., None, :]))


def linear_prefill(xq, xk, xv, lr, W, b, ln_weight, ln_bias, token_eta, *, mini_batch: int = 16,
                   backend: str = "triton", precision: str | None = None, final_state: bool = True):
    """TTT-Linear (LN-and-residual, with bias) over a whole sequence, forward only, token-major as the
    projections lay it out: xq/xk/xv [B, T, H, f] in their own dtype, lr [B, H, T]. Returns (Z [B, T, H, f],
    W, b after the last complete mini-batch). backend: triton (../ttt_linear_prefill.py, 16-bit operands with
    float32 accumulation; `precision` its matmuls') or torch (its reference, `prefill_reference`)."""
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    from ..ttt_linear_prefill import prefill_reference, ttt_linear_prefill

    if backend == "torch":
        Z, *state = prefill_reference(xq, xk, xv, lr, W, b, ln_weight, ln_bias, token_eta,
                                      mini_batch=mini_batch, dtype=torch.promote_types(xq.dtype, W.dtype))
        return (Z.to(xq.dtype), *state)
    return ttt_linear_prefill(xq, xk, xv, lr, W, b, ln_weight, ln_bias, token_eta, mini_batch=mini_batch,
                              precision=precision, final_state=final_state)
