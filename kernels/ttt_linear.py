"""TTT-Linear in dual form, fused: one Triton program per (sequence, head) runs all N mini-batches.

Per mini-batch of b tokens (Section 2.5, Appendix A.3), with W [f, f] and bias [1, f] held on chip:

    Z1 = XK W + bias,   G = d/dZ1 1/2 ||LN(Z1) - (XV - XK)||^2          (LN-L2 gradient, fused)
    eta[t, s] = token_eta[t] lr[s]                                         (Equation 6, built on chip)
    A  = tril(eta) * (XQ XK^T + 1)                                         (the +1 carries the bias)
    Zb = XQ W + bias - A G,   out = XQ + LN(Zb)
    W <- W - XK^T diag(l) G,   bias <- bias - l^T G,   l = eta[b-1, :]     (the last token's row)

The activations are read where the layer has them: XQ, XK, XV [B, H, T, f] of any strides with the last one 1
(heads-major, or views of the token-major projections [B, T, H, f]) and any float dtype, converted to float32
on chip (in one layout: q, k, v that do not share one are brought to token-major first, as the upstream
gradient is); the outputs Z and the input gradients are written token-major ([B, T, H, f] memory, returned
as [B, H, T, f] views) in the inputs' dtype. lr [B, H, T] (any strides) and token_eta [b] are read as they
are: no [b, b] block per mini-batch is materialised, and the backward reduces d eta to d lr and d token_eta
on chip. Every matmul accumulates in float32 (`precision`: exact float32 FMAs or tf32 tensor cores); W, the
LayerNorms, the gradients and the updates are float32.

The forward kernel stores W and bias at the start of every mini-batch when a backward will follow
(N f^2 floats per sequence and head). The backward kernel walks the mini-batches in reverse, recomputes
the mini-batch's intermediates from those weights, and carries dL/dW, dL/dbias through the recurrence.
"""

import torch
import triton
import triton.language as tl

from .ln import ln_backward, ln_l2_grad, normalize, row_mean
from .ttt_decode import HEAD_SIZES  # noqa: F401  (the same head sizes: f, compiled for sm_80 and sm_90)


@triton.jit
def _tile(ptr, offs_r, offs_c, C: tl.constexpr):
    return tl.load(ptr + offs_r[:, None] * C + offs_c[None, :])


@triton.jit
def _store_tile(ptr, x, offs_r, offs_c, C: tl.constexpr):
    tl.store(ptr + offs_r[:, None] * C + offs_c[None, :], x)


@triton.jit
def _rows(ptr, tok, st, rf):
    """The [b, f] rows of tokens `tok` (from a sequence and head's base pointer, token stride st), float32."""
    return tl.load(ptr + tok[:, None] * st + rf[None, :]).to(tl.float32)


@triton.jit
def _store_rows(ptr, tok, st, rf, x):
    tl.store(ptr + tok[:, None] * st + rf[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _eta(LR, TE, tok, sl_t, rb, causal, BS: tl.constexpr):
    """eta = tril(token_eta[t] lr[s]) of a mini-batch, its lr and token_eta, and l = eta[b-1, :] [b, 1]."""
    lr = tl.load(LR + tok * sl_t).to(tl.float32)
    te = tl.load(TE + rb)
    eta = tl.where(causal, te[:, None] * lr[None, :], 0.0)
    return eta, lr, te, (tl.load(TE + BS - 1) * lr)[:, None]


@triton.jit
def _dual_fwd_kernel(XQ, XK, XV, LR, TE, W0, B0, LNW, LNB, Z, W_LAST, B_LAST, W_STATES, B_STATES,
                     N, H, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sz_b, sz_h, sz_t,
                     sl_b, sl_h, sl_t, BS: tl.constexpr, F: tl.constexpr, STORE_STATES: tl.constexpr,
                     PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B*H*N*f*f is 2^32 at 1.3b, 16 x 32k tokens
    b, h = bh // H, bh % H
    XQ, XK, XV = XQ + b * sq_b + h * sq_h, XK + b * sk_b + h * sk_h, XV + b * sv_b + h * sv_h
    Z, LR = Z + b * sz_b + h * sz_h, LR + b * sl_b + h * sl_h
    rb = tl.arange(0, BS)
    rf = tl.arange(0, F)
    W = _tile(W0 + bh * F * F, rf, rf, F)
    bias = tl.load(B0 + bh * F + rf)[None, :]
    gamma = tl.load(LNW + h * F + rf)[None, :]
    beta = tl.load(LNB + h * F + rf)[None, :]
    causal = rb[:, None] >= rb[None, :]
    for n in range(N):
        tok = n * BS + rb
        xq = _rows(XQ, tok, sq_t, rf)
        xk = _rows(XK, tok, sk_t, rf)
        xv = _rows(XV, tok, sv_t, rf)
        eta, _, _, last = _eta(LR, TE, tok, sl_t, rb, causal, BS)
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
        _store_rows(Z, tok, sz_t, rf, xq + gamma * xhat + beta)

        W -= W_step
        bias -= tl.sum(last * G, axis=0)[None, :]
    _store_tile(W_LAST + bh * F * F, W, rf, rf, F)
    tl.store(B_LAST + bh * F + rf[None, :], bias)


@triton.jit
def _dual_bwd_kernel(XQ, XK, XV, LR, TE, W_STATES, B_STATES, LNW, LNB, DZ, DW_LAST, DB_LAST,
                     DXQ, DXK, DXV, DLR, DTE, DW0, DB0, DLNW, DLNB,
                     N, H, sq_b, sq_h, sq_t, sl_b, sl_h, sl_t, sdx_b, sdx_h, sdx_t,
                     BS: tl.constexpr, F: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B*H*N*f*f is 2^32 at 1.3b, 16 x 32k tokens
    b, h = bh // H, bh % H
    # three layouts (registers: a base pointer and strides each): xq, xk, xv; dZ and the input gradients; lr
    # and its gradient
    q, dx, lr_offset = b * sq_b + h * sq_h, b * sdx_b + h * sdx_h, b * sl_b + h * sl_h
    XQ, XK, XV, LR, DLR = XQ + q, XK + q, XV + q, LR + lr_offset, DLR + lr_offset
    DZ, DXQ, DXK, DXV = DZ + dx, DXQ + dx, DXK + dx, DXV + dx
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
    dte = tl.zeros([BS], dtype=tl.float32)
    for i in range(N):
        n = N - 1 - i
        tok = n * BS + rb
        xq = _rows(XQ, tok, sq_t, rf)
        xk = _rows(XK, tok, sq_t, rf)
        xv = _rows(XV, tok, sq_t, rf)
        eta, _, _, last = _eta(LR, TE, tok, sl_t, rb, causal, BS)
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
        dout = _rows(DZ, tok, sdx_t, rf)
        dgamma += tl.sum(dout * xhat2, axis=0)[None, :]
        dbeta += tl.sum(dout, axis=0)[None, :]
        dzb = ln_backward(dout * gamma, xhat2, std2, F)
        dG -= tl.dot(tl.trans(A), dzb, input_precision=PRECISION)
        # zb = xq W + bias - A G
        dxq = dout + tl.dot(dzb, tl.trans(W), input_precision=PRECISION)
        P = -tl.dot(dzb, tl.trans(G), input_precision=PRECISION)  # dL/dA
        # d eta (its lower triangle; the last row also through l), then eta[t, s] = te[t] lr[s] on chip (lr
        # and te loaded again here rather than kept live across the loop body: registers)
        deta = tl.where(causal, P * S1 + tl.where(is_last_row, dlast[None, :], 0.0), 0.0)
        eta, lr, te, _ = _eta(LR, TE, tok, sl_t, rb, causal, BS)
        tl.store(DLR + tok * sl_t, tl.sum(deta * te[:, None], axis=0).to(DLR.dtype.element_ty))
        dte += tl.sum(deta * lr[None, :], axis=1)
        dS = P * eta
        _store_rows(DXQ, tok, sdx_t, rf, dxq + tl.dot(dS, xk, input_precision=PRECISION))
        dxk += tl.dot(tl.trans(dS), xq, input_precision=PRECISION)
        # xq^T (and xk^T below) read from memory as [f, b] tiles rather than tl.trans of the tiles held in
        # registers: the last spills of the sm_80 backward at f = 64 go
        xq_t = tl.load(XQ + rf[:, None] + tok[None, :] * sq_t).to(tl.float32)
        dW += tl.dot(xq_t, dzb, input_precision=PRECISION)
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
        xk_t = tl.load(XK + rf[:, None] + tok[None, :] * sq_t).to(tl.float32)
        dW += tl.dot(xk_t, dz1, input_precision=PRECISION)
        db += tl.sum(dz1, axis=0)[None, :]
        _store_rows(DXV, tok, sdx_t, rf, -dgy)
        _store_rows(DXK, tok, sdx_t, rf, dxk + dgy + tl.dot(dz1, tl.trans(W), input_precision=PRECISION))
    _store_tile(DW0 + bh * F * F, dW, rf, rf, F)
    tl.store(DB0 + bh * F + rf[None, :], db)
    tl.store(DLNW + bh * F + rf[None, :], dgamma)
    tl.store(DLNB + bh * F + rf[None, :], dbeta)
    tl.store(DTE + bh * BS + rb, dte)


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


def domain_why_not(xq: torch.Tensor, b, ln_weight, mini_batch: int) -> str:
    """Why inputs are outside the domain TTT-Linear's chunk and prefill kernels share ("" when inside): xq of
    float32 or 16-bit floats (read as float32), a bias and LN-and-residual, head size f in HEAD_SIZES (powers
    of 2 >= 16 for tl.dot, compiled and checked for shared memory and spills ahead of time; 96, the 760m
    size, is not a power of 2) and a mini-batch size in MINI_BATCHES."""
    f = xq.shape[-1]
    if xq.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {xq.dtype} (the kernels take float32, bfloat16 or float16)"
    if b is None or ln_weight is None:
        return "no bias or no LayerNorm-and-residual"
    if f not in HEAD_SIZES:
        return f"head size {f} (the kernels take {', '.join(map(str, HEAD_SIZES))})"
    if mini_batch not in MINI_BATCHES:
        return f"mini-batch size {mini_batch} (the kernels take {', '.join(map(str, MINI_BATCHES))})"
    return ""


def why_not(xq: torch.Tensor, b, ln_weight, mini_batch: int) -> str:
    """Why xq [B, H, T, f] and the rest are outside the chunk kernel's domain ("" when inside): the shared
    domain (`domain_why_not`) and whole mini-batches."""
    reason, T = domain_why_not(xq, b, ln_weight, mini_batch), xq.shape[-2]
    return reason or (f"{T} tokens, not whole mini-batches of {mini_batch}" if T % mini_batch else "")


def supported(xq: torch.Tensor, b, ln_weight, mini_batch: int) -> bool:
    """Whether the fused kernel takes these inputs (`why_not`)."""
    return not why_not(xq, b, ln_weight, mini_batch)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _token_major(like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty [B, H, T, f] tensor laid out as [B, T, H, f] (the layer's layout: its reshape back is
    free)."""
    B, H, T, f = like.shape
    return like.new_empty(B, T, H, f, dtype=dtype or like.dtype).transpose(1, 2)


def _one_layout(*xs: torch.Tensor) -> tuple:
    """xs in one layout (the backward kernel reads them with one set of strides): as they are if they share
    it, else each not already token-major copied to it (e.g. v, a view into the fused projection, beside q
    and k from the convs)."""
    xs = tuple(_unit_last_stride(x) for x in xs)
    if all(x.stride() == xs[0].stride() for x in xs):
        return xs
    return tuple(x if x.transpose(1, 2).is_contiguous() else _token_major(x).copy_(x) for x in xs)


def _strides(x: torch.Tensor) -> tuple:
    """(batch, head, token) strides of a [B, H, T, ...] tensor."""
    return x.stride(0), x.stride(1), x.stride(2)


class TTTLinearDual(torch.autograd.Function):
    """Autograd wrapper: forward and backward kernels; gradients to every input, lr and token_eta included."""

    @staticmethod
    def forward(ctx, xq, xk, xv, lr, token_eta, W, b, ln_weight, ln_bias, precision, store: bool):
        B, H, T, F = xq.shape
        BS = token_eta.shape[0]
        N = T // BS
        xq, xk, xv = _one_layout(xq, xk, xv)
        te = token_eta.to(torch.float32).contiguous()
        W, b = W.contiguous(), b.contiguous()
        ln_weight, ln_bias = ln_weight.contiguous(), ln_bias.contiguous()
        Z = _token_major(xq)
        W_last, b_last = torch.empty_like(W), torch.empty_like(b)
        W_states = W.new_empty(B, H, N, F, F) if store else W_last
        b_states = W.new_empty(B, H, N, 1, F) if store else b_last
        _dual_fwd_kernel[(B * H,)](xq, xk, xv, lr, te, W, b, ln_weight, ln_bias, Z, W_last, b_last,
                                   W_states, b_states, N, H, *_strides(xq), *_strides(xk), *_strides(xv),
                                   *_strides(Z), *lr.stride(), BS=BS, F=F, STORE_STATES=store,
                                   PRECISION=precision, **launch_options(F, precision))
        if store:
            ctx.save_for_backward(xq, xk, xv, lr, te, W_states, b_states, ln_weight, ln_bias)
            ctx.precision, ctx.te_dtype = precision, token_eta.dtype
        return Z, W_last, b_last

    @staticmethod
    def backward(ctx, dZ, dW_last, db_last):
        xq, xk, xv, lr, te, W_states, b_states, ln_weight, ln_bias = ctx.saved_tensors
        B, H, T, F = xq.shape
        BS = te.shape[0]
        N = T // BS
        dxq, dxk, dxv = _token_major(xq), _token_major(xq, xk.dtype), _token_major(xq, xv.dtype)
        if dZ is None:
            dZ = torch.zeros_like(dxq)
        elif dZ.stride() != dxq.stride():  # dZ in the input gradients' layout (it comes so from the layer)
            dZ = _token_major(xq, dZ.dtype).copy_(dZ)
        dW_last = W_states.new_zeros(B, H, F, F) if dW_last is None else dW_last.contiguous()
        db_last = W_states.new_zeros(B, H, 1, F) if db_last is None else db_last.contiguous()
        dlr = torch.empty_strided(lr.shape, lr.stride(), dtype=lr.dtype, device=lr.device)
        dte = te.new_empty(B * H, BS)
        dW, db = torch.empty_like(dW_last), torch.empty_like(db_last)
        dlnw, dlnb = W_states.new_empty(B, H, 1, F), W_states.new_empty(B, H, 1, F)
        _dual_bwd_kernel[(B * H,)](xq, xk, xv, lr, te, W_states, b_states, ln_weight, ln_bias,
                                   dZ, dW_last, db_last, dxq, dxk, dxv, dlr, dte, dW, db, dlnw, dlnb,
                                   N, H, *_strides(xq), *lr.stride(), *_strides(dxq), BS=BS, F=F,
                                   PRECISION=ctx.precision, **launch_options(F, ctx.precision, backward=True))
        return (dxq, dxk, dxv, dlr, dte.sum(0).to(ctx.te_dtype), dW, db, dlnw.sum(0), dlnb.sum(0), None, None)


def ttt_linear_dual(xq, xk, xv, lr, token_eta, W, b, ln_weight, ln_bias, precision: str = "ieee"):
    """TTT-Linear's dual form over the N whole mini-batches of xq, xk, xv [B, H, T, f] (T = N b; any strides
    with the last one 1, any float dtype: see the module's docstring), lr [B, H, T], token_eta [b], from W_0
    = W [B, H, f, f], b [B, H, 1, f], the inner LN's ln_weight, ln_bias [H, 1, f]: (Z [B, H, T, f] in xq's
    dtype, laid out token-major, with the +xq residual; W and b after the last mini-batch, float32), the
    function of `ttt.linear(..., backend="dual")` (kernels/ttt/ops.py) on the kernel's domain (`supported`).
    precision: "ieee" (exact float32 matmuls) or "tf32" (tensor cores: matmul inputs rounded to 10 mantissa
    bits, ~1e-3 relative). The TTT layer passes its own choice on CUDA (models/ttt/kernel_check.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    reason = why_not(xq, b, ln_weight, token_eta.shape[0])
    if reason:
        raise ValueError(f"outside the TTT-Linear kernel's domain: {reason}")
    inputs = (xq, xk, xv, lr, token_eta, W, b, ln_weight, ln_bias)
    # the weights of every mini-batch are stored only for a backward (the Function's forward runs under
    # no_grad, where ctx.needs_input_grad still says whether inputs require grad)
    store = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return TTTLinearDual.apply(*inputs, precision, store)
