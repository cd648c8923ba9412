"""TTT-Linear prefill (forward only, no autograd): one small Triton program per (sequence, head).

The same function as the dual-form chunk kernel (kernels/ttt_linear.py) and the PyTorch dual form
(`dual_scan.ttt_linear_dual` over the complete mini-batches, `forms.dual_step` on a last short one), with the
LN-and-residual inner model f(x) = x + LN(x W + b). Per mini-batch of b tokens, from W, bias held on chip:

    Z1 = XK W + bias,   G = d/dZ1 1/2 ||LN(Z1) - (XV - XK)||^2             (LN-L2 gradient, fused)
    eta[t, s] = te[t] lr[s] for s <= t, else 0                              (built here, never stored)
    Zb = XQ W + bias - (eta * (XQ XK^T + 1)) G,   out = XQ + LN(Zb)
    W <- W - te[b-1] XK^T diag(lr) G,   bias <- bias - te[b-1] lr^T G

lr [B, H, T] is every token's inner learning rate (TTTLayer.inner_lr) and te [b] the token scaling of the
positions in a mini-batch (TTTLayer.token_eta(0, b): 1/i plus the learnable offset, clamped at 0), so that
eta is exactly ttt.eta(te, lr) of every mini-batch (kernels/ttt/ops.py).

What it does differently from the chunk kernel, for speed (issue 48: that kernel runs one 8-warp program of
184-192 registers a thread per SM):
- few warps per program (1 or 2 where the registers allow, `launch_options`), so that several programs share
  an SM and the 512 (sequence, head) programs of the 1.3b model at batch 16 run in one wave;
- inputs read in their own dtype (bfloat16, float16 or float32) straight from the projections' token-major
  layout [B, T, H, f] (any strides, the last 1), the output written in that dtype and layout: no transposes,
  no float32 copies of the activations;
- the matmul operands in the inputs' 16-bit dtype (tensor cores, float32 accumulation), or tf32 / exact
  float32 for float32 inputs; W, bias and every LayerNorm, gradient and update in float32;
- eta made from lr and te in registers instead of a [b, b] block read per mini-batch.
T need not be a multiple of b: a last short mini-batch is computed with masked loads and stores, and, as in
the layer, W and bias come back as they are after the last complete mini-batch.
"""

import torch
import triton
import triton.language as tl

from .ln import LN_EPS
from .ttt_linear import MINI_BATCHES, domain_why_not  # noqa: F401  (b = 16, the paper's; compiled for it)

# the tl.dot operands: the inputs' 16-bit dtype, or for float32 inputs tf32 tensor cores or exact float32
PRECISIONS = ("bf16", "fp16", "tf32", "ieee")
WARPS = (1, 2, 4)  # the candidates of the ahead-of-time report (python -m ttt_bench.kernels.aot)

# (num_warps, num_stages) by operand width ("16": bf16 and fp16, "32": tf32 and ieee) and head size f, chosen
# from the ahead-of-time compile (python -m ttt_bench.kernels.aot, the "prefill" rows;
# tests/test_kernels_aot.py checks them). A mini-batch step is a chain of small matmuls and row reductions,
# latency-bound: what counts is that every (sequence, head) program runs at once, each on an SM sub-partition
# of its own (the 1.3b model at batch 16 has 512 programs, 125m 192: one wave needs 4, resp. 2, programs an
# SM on 132 SMs), with no register spill (local memory in the recurrence), with few warps (a row reduction
# across warps is a trip through shared memory and a barrier; a [b, f] matmul split across warps replicates
# its A operand). Two stages: Triton copies the next mini-batch's tiles to shared memory (cp.async) while
# this one computes.
# - 16-bit, f = 16 and 32: 1 warp. No spill on sm_80 or sm_90 (118-244 registers), 8-16 programs an SM.
# - 16-bit, f = 64 (125m, 350m, 1.3b): 2 warps. 1 warp spills 0.7-1.2 KB a thread (W alone is 128 of its 255
#   registers, its bf16 copy for the matmuls 64 more); 2 warps split the f columns, keep everything in 255
#   registers and fit 4 programs an SM: the 512 programs of 1.3b in one wave on 132 SMs (two on an A100's
#   108). 4 warps do not spill either but fit 2 programs an SM (2 waves).
# - 16-bit, f = 128: 8 warps (no spill on sm_80, 24 bytes on sm_90; 1, 2, 4 warps spill 0.1 to 18 KB).
# - 32-bit operands (float32 inputs) take twice the registers for every tile: f = 16 1 warp, f = 32 2 warps
#   (no spill), f = 64 8 warps (no spill; 4 warps spill 8 to 44 bytes on sm_90, with 1 or 2 stages), f = 128
#   8 warps (sm_90 spills 56 bytes; not a paper size). One program an SM from f = 64: the float32 path is
#   the general one, bf16 the fast one.
# scripts/gpu_speed.sh times num_warps 1, 2, 4 on a GPU to confirm (or overturn) the 16-bit choices.
_LAUNCH = {"16": {16: (1, 2), 32: (1, 2), 64: (2, 2), 128: (8, 2)},
           "32": {16: (1, 2), 32: (2, 2), 64: (8, 2), 128: (8, 2)}}


def launch_options(f: int, precision: str = "bf16") -> dict:
    """The default launch options (num_warps, num_stages) at head size f for the matmul `precision`."""
    warps, stages = _LAUNCH["16" if precision in ("bf16", "fp16") else "32"][f]
    return {"num_warps": warps, "num_stages": stages}


@triton.jit
def _mm(a, b, acc, DOT: tl.constexpr):
    """a @ b + acc with float32 accumulation, the operands in DOT (bf16, fp16, tf32 or ieee)."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT)


@triton.jit
def _normalize(z, F: tl.constexpr):
    """(z - mean) * rstd and rstd = 1 / sqrt(var + eps) per row: ln.normalize with one reciprocal a row
    instead of a division an element."""
    centered = z - tl.sum(z, axis=1)[:, None] / F
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / F + LN_EPS)
    return centered * rstd, rstd


@triton.jit
def _ln_l2_grad(z, target, gamma, beta, scale, F: tl.constexpr):
    """scale * G with G = d/dz 1/2 ||gamma LN(z) + beta - target||^2 (ln.ln_l2_grad, the gradient only) and
    scale a column [R, 1] (a factor per row)."""
    xhat, rstd = _normalize(z, F)
    gx = gamma * (gamma * xhat + beta - target)
    mean_gx = tl.sum(gx, axis=1)[:, None] / F
    mean_gx_xhat = tl.sum(gx * xhat, axis=1)[:, None] / F
    return (gx - mean_gx - xhat * mean_gx_xhat) * (rstd * scale)


@triton.jit
def _mini_batch(XQ, XK, XV, Z, LR, rb, rf, sq_t, sk_t, sv_t, sz_t, sl_t, rows, W, bias, gamma, beta, te,
                te_last, causal, BS: tl.constexpr, F: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """The mini-batch of the b tokens from XQ, XK, XV, Z, LR (pointers to its first token): writes its
    outputs, returns the weights after it (W, bias). With MASKED only its first `rows` tokens exist (the loads
    padded with 0, so lr and eta are 0 there)."""
    q_ptr = XQ + rb[:, None] * sq_t + rf[None, :]
    k_ptr = XK + rb[:, None] * sk_t + rf[None, :]
    v_ptr = XV + rb[:, None] * sv_t + rf[None, :]
    if MASKED:
        valid = rb < rows
        xq = tl.load(q_ptr, mask=valid[:, None], other=0.0)
        xk = tl.load(k_ptr, mask=valid[:, None], other=0.0)
        xv = tl.load(v_ptr, mask=valid[:, None], other=0.0)
        lr = tl.load(LR + rb * sl_t, mask=valid, other=0.0).to(tl.float32)
    else:
        xq = tl.load(q_ptr)
        xk = tl.load(k_ptr)
        xv = tl.load(v_ptr)
        lr = tl.load(LR + rb * sl_t).to(tl.float32)
    # The order keeps few tiles live at once: both products with W (one rounded copy of it) first, then the
    # gradient, the update accumulated into W in place (no [f, f] step tile, the old W dead), and the output
    # last. A [b, f] matmul must be the loop's last: Triton gives every chained tl.dot the warp layout of the
    # last one, and for an [f, f] result that is one warp per row block, which replicates the [b, f] tiles
    # (b = 16 rows) in every warp; for a [b, f] result the warps split the f columns.
    acc = bias + tl.zeros([BS, F], dtype=tl.float32)
    z1 = _mm(xk, W, acc, DOT)
    zq = _mm(xq, W, acc, DOT)
    # XK^T read as an [f, b] tile of its own (an L1 hit), here, rather than transposed in registers: the last
    # spills of 2 warps at f = 64 go
    kT_ptr = XK + rb[None, :] * sk_t + rf[:, None]
    if MASKED:
        xkT = tl.load(kT_ptr, mask=valid[None, :], other=0.0)
    else:
        xkT = tl.load(kT_ptr)
    S = _mm(xq, xkT, tl.zeros([BS, BS], dtype=tl.float32), DOT) + 1.0
    A = tl.where(causal, S * te[:, None], 0.0)
    Gl = _ln_l2_grad(z1, xv.to(tl.float32) - xk.to(tl.float32), gamma, beta, lr[:, None], F)  # lr[s] G_s
    # W -= te[b-1] XK^T diag(lr) G, bias -= te[b-1] lr^T G: eta's last row, its te[b-1] on XK^T (one operand
    # Gl for both matmuls)
    W = _mm(xkT * -te_last, Gl, W, DOT)
    bias -= te_last * tl.sum(Gl, axis=0)[None, :]
    # Zb = XQ W + bias - A G with A = tril(eta) * (XQ XK^T + 1), eta[t, s] = te[t] lr[s] (lr in Gl)
    xhat, _ = _normalize(_mm(-A, Gl, zq, DOT), F)
    out = (xq.to(tl.float32) + gamma * xhat + beta).to(Z.dtype.element_ty)
    z_ptr = Z + rb[:, None] * sz_t + rf[None, :]
    if MASKED:
        tl.store(z_ptr, out, mask=valid[:, None])
    else:
        tl.store(z_ptr, out)
    return W, bias


@triton.jit
def _prefill_kernel(XQ, XK, XV, LR, TE, W0, B0, LNW, LNB, Z, W_OUT, B_OUT,
                    T, H,
                    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sz_b, sz_t, sz_h,
                    sl_b, sl_h, sl_t, sw_b, sw_h, sb_b, sb_h,
                    BS: tl.constexpr, F: tl.constexpr, DOT: tl.constexpr, STORE_STATE: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B*T*H*f is 2^31 at 1.3b, 16 x 64k tokens
    b = bh // H
    h = bh % H
    rb = tl.arange(0, BS)
    rf = tl.arange(0, F)
    # the sequence's and head's first token; a [b, f] tile is its rows t * stride, the f features contiguous
    XQ += b * sq_b + h * sq_h
    XK += b * sk_b + h * sk_h
    XV += b * sv_b + h * sv_h
    Z += b * sz_b + h * sz_h
    LR += b * sl_b + h * sl_h
    W = tl.load(W0 + b * sw_b + h * sw_h + rf[:, None] * F + rf[None, :]).to(tl.float32)
    bias = tl.load(B0 + b * sb_b + h * sb_h + rf).to(tl.float32)[None, :]
    gamma = tl.load(LNW + h * F + rf).to(tl.float32)[None, :]
    beta = tl.load(LNB + h * F + rf).to(tl.float32)[None, :]
    te = tl.load(TE + rb).to(tl.float32)
    te_last = tl.load(TE + BS - 1).to(tl.float32)
    causal = rb[:, None] >= rb[None, :]
    N = T // BS
    for _ in range(N):
        W, bias = _mini_batch(XQ, XK, XV, Z, LR, rb, rf, sq_t, sk_t, sv_t, sz_t, sl_t, BS, W, bias, gamma,
                              beta, te, te_last, causal, BS, F, DOT, False)
        # to the next mini-batch: 64-bit pointers moved by 32-bit steps (no t * stride offset, which passes
        # 2^31 at long contexts)
        XQ += BS * sq_t
        XK += BS * sk_t
        XV += BS * sv_t
        Z += BS * sz_t
        LR += BS * sl_t
    if STORE_STATE:  # the weights after the last complete mini-batch (a cache's W_{t'})
        tl.store(W_OUT + bh * F * F + rf[:, None] * F + rf[None, :], W)
        tl.store(B_OUT + bh * F + rf[None, :], bias)
    rest = T - N * BS
    if rest > 0:  # a last, short mini-batch: its outputs only
        _mini_batch(XQ, XK, XV, Z, LR, rb, rf, sq_t, sk_t, sv_t, sz_t, sl_t, rest, W, bias, gamma, beta, te,
                    te_last, causal, BS, F, DOT, True)


def default_precision(dtype: torch.dtype) -> str:
    """The matmul operands' precision for inputs of `dtype`: their own 16-bit dtype, tf32 for float32."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32")


def why_not(XQ: torch.Tensor, b, ln_weight, mini_batch: int = 16) -> str:
    """Why inputs are outside the prefill kernel's domain ("" when inside): the one it shares with the chunk
    kernel (`ttt_linear.domain_why_not`: bfloat16, float16 or float32, LN-and-residual with a bias, head size
    in HEAD_SIZES, mini-batch size in MINI_BATCHES); a short last mini-batch is its own."""
    return domain_why_not(XQ, b, ln_weight, mini_batch)


def _per_head(t: torch.Tensor, B: int, H: int, rows: int, f: int) -> torch.Tensor:
    """W [B, H, f, f] / [H, f, f] or b [B, H, 1, f] / [H, 1, f] / [H, f] as [B, H, rows, f], a view (a batch
    stride of 0 for shared weights) with its last two dimensions contiguous."""
    t = t.reshape(*t.shape[:-2], rows, f) if rows == 1 and t.dim() <= 3 else t
    t = t.expand(B, H, rows, f)
    if t.stride(-1) != 1 or (rows > 1 and t.stride(-2) != f):
        t = t.contiguous()
    return t


def ttt_linear_prefill(XQ, XK, XV, lr, W, b, ln_weight, ln_bias, token_eta=None, *, mini_batch: int = 16,
                       precision: str | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, final_state: bool = True, out=None):
    """TTT-Linear (LN-and-residual inner model, with bias) over a whole sequence, forward only.

    XQ, XK, XV: [B, T, H, f] in bfloat16, float16 or float32 (one dtype), token-major as the projections
    lay them out; any strides with the last one 1 (views into a fused projection work as they are).
    lr: [B, H, T] or [B, H, N, b] inner learning rates (any strides and float dtype; TTTLayer.inner_lr).
    W: [B, H, f, f] or [H, f, f]; b: [B, H, 1, f] or [H, 1, f], the initial weights (float32 in the layer).
    ln_weight, ln_bias: [H, 1, f] or [H, f]. token_eta: [b] (TTTLayer.token_eta(0, b)); None: 1/i.
    precision: the matmul operands' (`PRECISIONS`; default `default_precision`); num_warps, num_stages:
    default `launch_options(f)`. out: optional [B, T, H, f] output in XQ's dtype.
    Returns Z [B, T, H, f] (XQ + LN(...), in XQ's dtype and layout) and, with final_state, W_last
    [B, H, f, f] and b_last [B, H, 1, f] in float32 after the last complete mini-batch (else None, None).
    """
    B, T, H, F = XQ.shape
    reason = why_not(XQ, b, ln_weight, mini_batch)
    if reason:
        raise ValueError(f"outside the prefill kernel's domain: {reason}")
    if XK.shape != XQ.shape or XV.shape != XQ.shape or XK.dtype != XQ.dtype or XV.dtype != XQ.dtype:
        raise ValueError("XQ, XK and XV must have one shape and dtype")
    precision = precision or default_precision(XQ.dtype)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    XQ, XK, XV = (x if x.stride(-1) == 1 else x.contiguous() for x in (XQ, XK, XV))
    lr = lr.reshape(B, H, T)
    if token_eta is None:
        token_eta = 1.0 / torch.arange(1, mini_batch + 1, device=XQ.device, dtype=torch.float32)
    te = token_eta.to(device=XQ.device, dtype=torch.float32).reshape(mini_batch).contiguous()
    W0, b0 = _per_head(W, B, H, F, F), _per_head(b, B, H, 1, F)
    lnw, lnb = (t.reshape(H, F).contiguous() for t in (ln_weight, ln_bias))
    Z = torch.empty_like(XQ, memory_format=torch.contiguous_format) if out is None else out
    if Z.shape != XQ.shape or Z.dtype != XQ.dtype or Z.stride(-1) != 1:
        raise ValueError("out must be [B, T, H, f] in XQ's dtype with a last stride of 1")
    if final_state:
        W_last = XQ.new_empty(B, H, F, F, dtype=torch.float32)
        b_last = XQ.new_empty(B, H, 1, F, dtype=torch.float32)
    else:
        W_last = b_last = Z  # never written (STORE_STATE=False)
    launch = launch_options(F, precision)
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    if B * H:
        _prefill_kernel[(B * H,)](
            XQ, XK, XV, lr, te, W0, b0, lnw, lnb, Z, W_last, b_last, T, H,
            XQ.stride(0), XQ.stride(1), XQ.stride(2), XK.stride(0), XK.stride(1), XK.stride(2),
            XV.stride(0), XV.stride(1), XV.stride(2), Z.stride(0), Z.stride(1), Z.stride(2),
            lr.stride(0), lr.stride(1), lr.stride(2), W0.stride(0), W0.stride(1), b0.stride(0), b0.stride(1),
            BS=mini_batch, F=F, DOT=precision, STORE_STATE=final_state, **launch)
    return (Z, W_last, b_last) if final_state else (Z, None, None)


def prefill_reference(XQ, XK, XV, lr, W, b, ln_weight, ln_bias, token_eta=None, *, mini_batch: int = 16,
                      dtype=torch.float64):
    """The kernel's function in PyTorch (float64 by default), mini-batch by mini-batch in dual form, with the
    same arguments and outputs as `ttt_linear_prefill` (Z [B, T, H, f] in `dtype`, W_last, b_last after the
    last complete mini-batch). Torch only, for the GPU check (kernels/speed.py) where the rest of
    ttt_bench may not be installed; tests/test_kernel_prefill.py ties it to dual_scan.ttt_linear_dual."""
    B, T, H, F = XQ.shape
    c = lambda x: x.to(dtype)
    xq, xk, xv = (c(x).transpose(1, 2) for x in (XQ, XK, XV))  # [B, H, T, f]
    lr = c(lr).reshape(B, H, T)
    te = (1.0 / torch.arange(1, mini_batch + 1, device=XQ.device) if token_eta is None else token_eta)
    te = c(te).reshape(mini_batch)
    W = c(W).expand(B, H, F, F)
    bias = c(b).reshape(-1, H, 1, F).expand(B, H, 1, F)
    gamma, beta = c(ln_weight).reshape(H, 1, F), c(ln_bias).reshape(H, 1, F)
    eps = LN_EPS.value

    def normalize(z):
        centered = z - z.mean(-1, keepdim=True)
        std = (centered.square().mean(-1, keepdim=True) + eps).sqrt()
        return centered / std, std

    outs = []
    for start in range(0, T, mini_batch):
        n = min(mini_batch, T - start)
        q, k, v = (x[:, :, start : start + n] for x in (xq, xk, xv))
        eta = torch.tril(te[:n, None] * lr[:, :, None, start : start + n])  # eta[t, s] = te[t] lr[s], s <= t
        xhat, std = normalize(k @ W + bias)  # the LN-L2 gradient at Z1 = XK W + bias, target XV - XK
        gx = gamma * (gamma * xhat + beta - (v - k))
        G = (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True)) / std
        zb = q @ W + bias - (eta * (q @ k.transpose(-1, -2) + 1.0)) @ G
        outs.append(q + gamma * normalize(zb)[0] + beta)
        if n == mini_batch:
            last = eta[..., -1, :, None]  # eta[b-1, s] as a column
            W, bias = W - (last * k).transpose(-1, -2) @ G, bias - (last * G).sum(-2, keepdim=True)
    return torch.cat(outs, 2).transpose(1, 2), W, bias
