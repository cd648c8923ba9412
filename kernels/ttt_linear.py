"""TTT-Linear in dual form, fused: one Triton program per (sequence, head) runs all N mini-batches.

Per mini-batch of b tokens (Section 2.5, Appendix A.3), with W [f, f] and bias [1, f] held on chip:

    Z1 = XK W + bias,   G = d/dZ1 1/2 ||LN(Z1) - (XV - XK)||^2          (LN-L2 gradient, fused)
    A  = tril(eta) * (XQ XK^T + 1)                                         (the +1 carries the bias)
    Zb = XQ W + bias - A G,   out = XQ + LN(Zb)
    W <- W - XK^T diag(l) G,   bias <- bias - l^T G,   l = eta[b-1, :]     (the last token's row)

The forward kernel stores W and bias at the start of every mini-batch when a backward will follow
(N f^2 floats per sequence and head). The backward kernel walks the mini-batches in reverse, recomputes
the mini-batch's intermediates from those weights, and carries dL/dW, dL/dbias through the recurrence.
"""

import torch
import triton
import triton.language as tl

from .ln import ln_backward, ln_l2_grad, normalize, row_mean
from .ttt_decode import HEAD_SIZES  # noqa: F401  (the same head sizes: f, compiled for sm_80 and sm_90)
from .ttt_decode import why_not as decode_why_not


@triton.jit
def _tile(ptr, offs_r, offs_c, C: tl.constexpr):
    return tl.load(ptr + offs_r[:, None] * C + offs_c[None, :])


@triton.jit
def _store_tile(ptr, x, offs_r, offs_c, C: tl.constexpr):
    tl.store(ptr + offs_r[:, None] * C + offs_c[None, :], x)


@triton.jit
def _dual_fwd_kernel(XQ, XK, XV, ETA, W0, B0, LNW, LNB, Z, W_LAST, B_LAST, W_STATES, B_STATES,
                     N, H, BS: tl.constexpr, F: tl.constexpr, STORE_STATES: tl.constexpr,
                     PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B*H*N*f*f is 2^32 at 1.3b, 16 x 32k tokens
    h = bh % H
    rb = tl.arange(0, BS)
    rf = tl.arange(0, F)
    W = _tile(W0 + bh * F * F, rf, rf, F)
    bias = tl.load(B0 + bh * F + rf)[None, :]
    gamma = tl.load(LNW + h * F + rf)[None, :]
    beta = tl.load(LNB + h * F + rf)[None, :]
    causal = rb[:, None] >= rb[None, :]
    for n in range(N):
        tok = (bh * N + n) * BS * F
        xq = _tile(XQ + tok, rb, rf, F)
        xk = _tile(XK + tok, rb, rf, F)
        xv = _tile(XV + tok, rb, rf, F)
        eta_ptr = ETA + (bh * N + n) * BS * BS
        eta = tl.where(causal, _tile(eta_ptr, rb, rb, BS), 0.0)
        last = tl.load(eta_ptr + (BS - 1) * BS + rb)[:, None]
        if STORE_STATES:
            _store_tile(W_STATES + (bh * N + n) * F * F, W, rf, rf, F)
            tl.store(B_STATES + (bh * N + n) * F + rf[None, :], bias)

        z1 = tl.dot(xk, W, input_precision=PRECISION) + bias
        G, _, _, _, _ = ln_l2_grad(z1, xv - xk, gamma, beta, F)
        # The update is computed before the [b, f] matmuls and applied after them: Triton gives every chained
        # tl.dot the warp layout of the last one in the loop, and for an [f, f] result that is one warp per
        # row block, which replicates the [b, f] tiles (b = 16 rows) in every warp: registers spill.
        W_step = tl.dot(tl.trans(xk * last), G, input_precision=PRECISION)
        A = eta * (tl.dot(xq, tl.trans(xk), input_precision=PRECISION) + 1.0)
        zb = tl.dot(xq, W, input_precision=PRECISION) + bias - tl.dot(A, G, input_precision=PRECISION)
        xhat, _ = normalize(zb, F)
        _store_tile(Z + tok, xq + gamma * xhat + beta, rb, rf, F)

        W -= W_step
        bias -= tl.sum(last * G, axis=0)[None, :]
    _store_tile(W_LAST + bh * F * F, W, rf, rf, F)
    tl.store(B_LAST + bh * F + rf[None, :], bias)


@triton.jit
def _dual_bwd_kernel(XQ, XK, XV, ETA, W_STATES, B_STATES, LNW, LNB, DZ, DW_LAST, DB_LAST,
                     DXQ, DXK, DXV, DETA, DW0, DB0, DLNW, DLNB,
                     N, H, BS: tl.constexpr, F: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B*H*N*f*f is 2^32 at 1.3b, 16 x 32k tokens
    h = bh % H
    rb = tl.arange(0, BS)
    rf = tl.arange(0, F)
    gamma = tl.load(LNW + h * F + rf)[None, :]
    beta = tl.load(LNB + h * F + rf)[None, :]
    causal = rb[:, None] >= rb[None, :]
    is_last_row = rb[:, None] == BS - 1
    dW = _tile(DW_LAST + bh * F * F, rf, rf, F)  # dL/d(weights after the mini-batch), carried backwards
    db = tl.load(DB_LAST + bh * F + rf)[None, :]
    dgamma = tl.zeros([1, F], dtype=tl.float32)
    dbeta = tl.zeros([1, F], dtype=tl.float32)
    for i in range(N):
        n = N - 1 - i
        tok = (bh * N + n) * BS * F
        xq = _tile(XQ + tok, rb, rf, F)
        xk = _tile(XK + tok, rb, rf, F)
        xv = _tile(XV + tok, rb, rf, F)
        eta_ptr = ETA + (bh * N + n) * BS * BS
        eta = tl.where(causal, _tile(eta_ptr, rb, rb, BS), 0.0)
        last = tl.load(eta_ptr + (BS - 1) * BS + rb)[:, None]
        W = _tile(W_STATES + (bh * N + n) * F * F, rf, rf, F)
        bias = tl.load(B_STATES + (bh * N + n) * F + rf)[None, :]

        # recompute the forward of this mini-batch
        z1 = tl.dot(xk, W, input_precision=PRECISION) + bias
        G, xhat1, std1, gy, gx = ln_l2_grad(z1, xv - xk, gamma, beta, F)
        gx_xhat1 = row_mean(gx * xhat1, F)  # gx = gamma gy: not kept, made again where needed
        S1 = tl.dot(xq, tl.trans(xk), input_precision=PRECISION) + 1.0
        A = eta * S1
        zb = tl.dot(xq, W, input_precision=PRECISION) + bias - tl.dot(A, G, input_precision=PRECISION)
        xhat2, std2 = normalize(zb, F)

        # The order below keeps few tiles live at once (registers: tests/test_kernels_aot.py): every use of
        # the carried dW comes first, each output is stored once complete, dW and db are accumulated in place,
        # and the last tl.dot of the loop has a [b, f] result (see the forward kernel).
        # W' = W - xk^T diag(last) G,  bias' = bias - last^T G: the terms through the carried dW, db
        u = tl.dot(xk, dW, input_precision=PRECISION) + db
        dxk = -tl.dot(last * G, tl.trans(dW), input_precision=PRECISION)
        dlast = -tl.sum(u * G, axis=1)
        dG = -last * u
        # out = xq + LN(zb)
        dout = _tile(DZ + tok, rb, rf, F)
        dgamma += tl.sum(dout * xhat2, axis=0)[None, :]
        dbeta += tl.sum(dout, axis=0)[None, :]
        dzb = ln_backward(dout * gamma, xhat2, std2, F)
        dG -= tl.dot(tl.trans(A), dzb, input_precision=PRECISION)
        # zb = xq W + bias - A G
        dxq = dout + tl.dot(dzb, tl.trans(W), input_precision=PRECISION)
        P = -tl.dot(dzb, tl.trans(G), input_precision=PRECISION)  # dL/dA
        deta = P * S1 + tl.where(is_last_row, dlast[None, :], 0.0)
        _store_tile(DETA + (bh * N + n) * BS * BS, tl.where(causal, deta, 0.0), rb, rb, BS)
        dS = P * eta
        _store_tile(DXQ + tok, dxq + tl.dot(dS, xk, input_precision=PRECISION), rb, rf, F)
        dxk += tl.dot(tl.trans(dS), xq, input_precision=PRECISION)
        # xq^T (and xk^T below) read from memory as [f, b] tiles rather than tl.trans of the tiles held in
        # registers: the last spills of the sm_80 backward at f = 64 go
        dW += tl.dot(tl.load(XQ + tok + rf[:, None] + rb[None, :] * F), dzb, input_precision=PRECISION)
        db += tl.sum(dzb, axis=0)[None, :]

        # G = ln_backward(gx, xhat1, std1): through gx, xhat1 (also inside gy) and std1
        dGs = dG / std1
        dgx = ln_backward(dG, xhat1, std1, F)
        dxhat = -gx_xhat1 * dGs - row_mean(dGs * xhat1, F) * (gamma * gy)
        dstd = -tl.sum(dG * G, axis=1)[:, None] / std1
        dgy = dgx * gamma
        dgamma += tl.sum(dgx * gy + dgy * xhat1, axis=0)[None, :]
        dbeta += tl.sum(dgy, axis=0)[None, :]
        dxhat += dgy * gamma
        dz1 = ln_backward(dxhat, xhat1, std1, F) + dstd * xhat1 / F
        # z1 = xk W + bias, target = xv - xk
        dW += tl.dot(tl.load(XK + tok + rf[:, None] + rb[None, :] * F), dz1, input_precision=PRECISION)
        db += tl.sum(dz1, axis=0)[None, :]
        _store_tile(DXV + tok, -dgy, rb, rf, F)
        _store_tile(DXK + tok, dxk + dgy + tl.dot(dz1, tl.trans(W), input_precision=PRECISION), rb, rf, F)
    _store_tile(DW0 + bh * F * F, dW, rf, rf, F)
    tl.store(DB0 + bh * F + rf[None, :], db)
    tl.store(DLNW + bh * F + rf[None, :], dgamma)
    tl.store(DLNB + bh * F + rf[None, :], dbeta)


PRECISIONS = ("ieee", "tf32")  # tl.dot input precision: exact float32 (FMAs), or tf32 tensor cores
# b: every paper configuration's. At b = 64 (f = 64) the backward needs 213 KB of shared memory on sm_80 and
# 337 KB on sm_90, above both limits; other sizes are not compiled ahead of time, so not taken.
MINI_BATCHES = (16,)

# num_warps, num_stages of the (forward, backward) kernel by precision and head size, chosen from the
# ahead-of-time compile (python -m ttt_bench.kernels.aot; docs/speed.md): every one fits the shared memory of
# an A100 (163 KB) and an H100 (227 KB), and tf32, the layer's precision on CUDA, spills no register up to
# f = 64. 8 warps from f = 64: with 4, each thread holds twice the [f, f] tiles and tf32 spills. ieee (FMA
# matmuls that hold whole rows and columns in registers) spills from f = 32 or 64 whatever the launch. At
# f = 128 both precisions spill, and the backward takes 16 warps and 1 stage to fit in shared memory (with 8
# warps and 3 stages tf32 needs 178 KB on sm_80, ieee 307 KB; with 1 stage ieee needs 161 KB).
_LAUNCH = {
    "tf32": {16: ((4, 3), (4, 3)), 32: ((4, 3), (4, 3)), 64: ((8, 3), (8, 3)), 128: ((8, 3), (16, 1))},
    "ieee": {16: ((4, 1), (4, 1)), 32: ((8, 1), (4, 1)), 64: ((8, 1), (16, 1)), 128: ((16, 1), (16, 1))},
}


def launch_options(f: int, precision: str, backward: bool = False) -> dict:
    """The launch options (num_warps, num_stages) of the forward or backward kernel at head size f."""
    warps, stages = _LAUNCH[precision][f][backward]
    return {"num_warps": warps, "num_stages": stages}


def why_not(XQ: torch.Tensor, b, ln_weight) -> str:
    """Why inputs are outside the fused kernel's domain ("" when inside): the decode kernel's domain (float32,
    LN-and-residual, a bias, head size in HEAD_SIZES: powers of 2 >= 16 for tl.dot, compiled and checked for
    shared memory and spills ahead of time; 96, the 760m size, is not a power of 2), and a mini-batch size in
    MINI_BATCHES."""
    bs = XQ.shape[-2]
    if bs not in MINI_BATCHES:
        return f"mini-batch size {bs} (the kernels take {', '.join(map(str, MINI_BATCHES))})"
    return decode_why_not(XQ, b, ln_weight)


def supported(XQ: torch.Tensor, b, ln_weight) -> bool:
    """Whether the fused kernel takes these inputs (`why_not`)."""
    return not why_not(XQ, b, ln_weight)


class TTTLinearDual(torch.autograd.Function):
    """Autograd wrapper: forward and backward kernels; gradients to every input (eta included)."""

    @staticmethod
    def forward(ctx, XQ, XK, XV, eta, W, b, ln_weight, ln_bias, precision):
        B, H, N, BS, F = XQ.shape
        XQ, XK, XV, eta, W, b = (t.contiguous() for t in (XQ, XK, XV, eta, W, b))
        ln_weight, ln_bias = ln_weight.contiguous(), ln_bias.contiguous()
        Z = torch.empty_like(XQ)
        W_last, b_last = torch.empty_like(W), torch.empty_like(b)
        store = any(ctx.needs_input_grad[:8])
        W_states = XQ.new_empty(B, H, N, F, F) if store else W_last
        b_states = XQ.new_empty(B, H, N, 1, F) if store else b_last
        _dual_fwd_kernel[(B * H,)](XQ, XK, XV, eta, W, b, ln_weight, ln_bias, Z, W_last, b_last,
                                   W_states, b_states, N, H, BS=BS, F=F, STORE_STATES=store,
                                   PRECISION=precision, **launch_options(F, precision))
        if store:
            ctx.save_for_backward(XQ, XK, XV, eta, W_states, b_states, ln_weight, ln_bias)
            ctx.precision = precision
        return Z, W_last, b_last

    @staticmethod
    def backward(ctx, dZ, dW_last, db_last):
        XQ, XK, XV, eta, W_states, b_states, ln_weight, ln_bias = ctx.saved_tensors
        B, H, N, BS, F = XQ.shape
        dZ = torch.zeros_like(XQ) if dZ is None else dZ.contiguous()
        dW_last = XQ.new_zeros(B, H, F, F) if dW_last is None else dW_last.contiguous()
        db_last = XQ.new_zeros(B, H, 1, F) if db_last is None else db_last.contiguous()
        dXQ, dXK, dXV, deta = (torch.empty_like(t) for t in (XQ, XK, XV, eta))
        dW, db = torch.empty_like(dW_last), torch.empty_like(db_last)
        dlnw, dlnb = XQ.new_empty(B, H, 1, F), XQ.new_empty(B, H, 1, F)
        _dual_bwd_kernel[(B * H,)](XQ, XK, XV, eta, W_states, b_states, ln_weight, ln_bias,
                                   dZ, dW_last, db_last, dXQ, dXK, dXV, deta, dW, db, dlnw, dlnb,
                                   N, H, BS=BS, F=F, PRECISION=ctx.precision,
                                   **launch_options(F, ctx.precision, backward=True))
        return dXQ, dXK, dXV, deta, dW, db, dlnw.sum(0), dlnb.sum(0), None


def ttt_linear_dual(XQ, XK, XV, eta, W, b, ln_weight, ln_bias, precision: str = "ieee"):
    """Drop-in for `ttt_bench.kernels.ttt.dual_scan.ttt_linear_dual` (same shapes and outputs) on the kernel's
    domain (`supported`). precision: "ieee" (exact float32 matmuls) or "tf32" (tensor cores: matmul inputs
    rounded to 10 mantissa bits, ~1e-3 relative). The TTT layer passes its own choice on CUDA
    (models/ttt/kernel_check.py: PRECISION)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return TTTLinearDual.apply(XQ, XK, XV, eta, W, b, ln_weight, ln_bias, precision)
