"""TTT-MLP in dual form, fused, forward only (prefill / inference): one Triton program per (sequence, head).

The same function as the PyTorch dual form (`ttt_bench.models.ttt.dual_scan.ttt_mlp_dual`, and
`forms.dual_step` over `forms.scan`) for the layer's defaults: the inner model
f(x) = x + LN(gelu(x W1 + b1) W2 + b2) with hidden width m = 4f, GELU's tanh approximation (learner.gelu),
LayerNorm-and-residual, biases, and the mini-batch dual form (Appendix A.3). Per mini-batch of b tokens, with
W1 [f, m], b1 [1, m], W2 [m, f], b2 [1, f] held in registers (float32) across all N mini-batches:

    Z1 = XK W1 + b1,   X2 = gelu(Z1),   Z2 = X2 W2 + b2
    G2 = d/dZ2 1/2 ||LN(Z2) - (XV - XK)||^2                       (LN-L2 gradient, fused)
    G1 = (G2 W2^T) * gelu'(Z1)
    E  = tril(eta),  e = E[b-1, :]                                   (eta as given: see below)
    Zbar1 = XQ W1 + b1 - (E * (XQ XK^T + 1)) G1,   Xbar2 = gelu(Zbar1)
    Zbar2 = Xbar2 W2 + b2 - (E * (Xbar2 X2^T + 1)) G2,   out = XQ + LN(Zbar2)
    W1 -= XK^T diag(e) G1,  b1 -= e^T G1,  W2 -= X2^T diag(e) G2,  b2 -= e^T G2

eta [B, H, N, b, b] is taken as the PyTorch dual form takes it: the layer builds it as
TTTLayer.eta(token_eta, lr), eta[t, s] = token_eta[t] lr[s] with token_eta[t] = 1/(t+1) (+ the learnable
offset, clamped at 0) and lr = eta_base sigmoid(theta_lr . x + bias) / head_dim; only its lower triangle
(s <= t) is read, as there.

Inputs of any float dtype are read as they are and converted to float32 in registers; every matmul
accumulates in float32 (`precision`: exact float32 FMAs, or tf32 tensor cores), every LayerNorm, GELU,
gradient and update is float32. Z comes back in XQ's dtype, the weights in float32 (or float64 if given so).

Registers (python -m ttt_bench.kernels.ttt_mlp_aot): W1 and W2 are 2 f m = 8 f^2 float32 per program, 128
KB at f = 64, spread over the warps (8 warps: 128 of a thread's 255 registers). Each is held as two halves
of the hidden units (`_first_layer` and the others run once per half): Triton makes a whole copy of a tl.dot
operand in its operand layout, and every warp holds the whole [16, k] operand of the products over the hidden
units (X2 W2, Xbar2 X2^T, Xbar2 W2'), which are further split into even and odd units (`_dot_nt`). With
tf32 nothing spills at f = 16 (sm_80, sm_90) and f = 32 (sm_80; 60 bytes on sm_90); at f = 64 (the paper
sizes') 2.5-2.8 KB a thread spill to local memory (see `launch_options`). Triton keeps no tensor in shared
memory across loop iterations: shared memory holds only tl.dot operands on their way to the MMA layout,
at most 76 KB a program, under sm_80's 163 KB and sm_90's 227 KB.
"""

import torch
import triton
import triton.language as tl

from .ln import ln_l2_grad, normalize

HEAD_SIZES = (16, 32, 64)  # f: compiled for sm_80 and sm_90 (tests/test_kernel_ttt_mlp.py); 128 would hold
# 512 KB of float32 weights per program: no launch keeps them in registers
MINI_BATCHES = (16,)  # b: every paper configuration's
EXPANSION = 4  # m = 4 f: the layer's default mlp_expansion
PRECISIONS = ("ieee", "tf32")  # tl.dot input precision: exact float32 (FMAs), or tf32 tensor cores

GELU_C = tl.constexpr(1.5957691216057308)  # 2 sqrt(2 / pi): gelu(x) = x sigmoid(GELU_C (x + GELU_A x^3))
GELU_A = tl.constexpr(0.044715)


@triton.jit
def _gelu(x):
    """GELU's tanh approximation, 0.5 x (1 + tanh(c (x + 0.044715 x^3))) = x sigmoid(2 c (x + 0.044715 x^3))
    (learner.gelu)."""
    return x * tl.sigmoid(x * (GELU_C + GELU_A * GELU_C * x * x))


@triton.jit
def _gelu_and_grad(x):
    """gelu(x) and gelu'(x) = s + x s (1 - s) v' from one sigmoid s = sigmoid(v), v = C (x + A x^3)
    (learner.gelu_and_grad)."""
    xx = x * x
    s = tl.sigmoid(x * (GELU_C + GELU_A * GELU_C * xx))
    return x * s, s + x * (s - s * s) * (GELU_C + 3.0 * GELU_A * GELU_C * xx)


@triton.jit
def _tile(ptr, offs_r, offs_c, stride_r, stride_c):
    return tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c).to(tl.float32)


@triton.jit
def _store_tile(ptr, x, offs_r, offs_c, stride_r, stride_c):
    tl.store(ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, x.to(ptr.dtype.element_ty))


@triton.jit
def _dot_nt(a, bt, PRECISION: tl.constexpr):
    """a @ bt^T for a [r, k], bt [n, k] with k the hidden units: two products over the even and the odd
    units (each thread holds adjacent columns: the split moves no data). A tl.dot operand [r, k] is held
    whole by every warp; halving k halves those registers."""
    a0, a1 = tl.split(tl.reshape(a, (a.shape[0], a.shape[1] // 2, 2)))
    b0, b1 = tl.split(tl.reshape(bt, (bt.shape[0], bt.shape[1] // 2, 2)))
    return tl.dot(a0, b0.T, input_precision=PRECISION) + tl.dot(a1, b1.T, input_precision=PRECISION)


@triton.jit
def _first_layer(xq, xk, W1, b1, W2t, PRECISION: tl.constexpr):
    """A half of the hidden units: Z1 = XK W1 + b1 and XQ W1 + b1 (both products with W1 at once: Triton makes
    one copy of W1 in the tl.dot operand layout for all its uses, alive from the first to the last),
    X2 = gelu(Z1), gelu'(Z1), and the half's term X2 W2 of Z2."""
    z1 = tl.dot(xk, W1, input_precision=PRECISION) + b1
    zq1 = tl.dot(xq, W1, input_precision=PRECISION) + b1
    x2, dgelu1 = _gelu_and_grad(z1)
    return zq1, x2, dgelu1, _dot_nt(x2, W2t, PRECISION)


@triton.jit
def _first_output(G2, A1, W2t, zq1, x2, dgelu1, PRECISION: tl.constexpr):
    """A half: G1 = (G2 W2^T) * gelu'(Z1), Xbar2 = gelu(XQ W1 + b1 - A1 G1), and its term Xbar2 X2^T of M2."""
    G1 = tl.dot(G2, W2t, input_precision=PRECISION) * dgelu1
    xbar2 = _gelu(zq1 - tl.dot(A1, G1, input_precision=PRECISION))
    return G1, xbar2, _dot_nt(xbar2, x2, PRECISION)


@triton.jit
def _second_update(W2t, eG2, x2, xbar2, PRECISION: tl.constexpr):
    """A half: W2 <- W2 - X2^T diag(e) G2 (as W2^T), and the half's term Xbar2 W2' of the output (see the
    kernel)."""
    W2t -= tl.dot(eG2.T, x2, input_precision=PRECISION)
    return W2t, _dot_nt(xbar2, W2t, PRECISION)


@triton.jit
def _first_update(W1, b1, xk, G1, last, PRECISION: tl.constexpr):
    eG1 = last * G1
    W1 -= tl.dot(xk.T, eG1, input_precision=PRECISION)
    return W1, b1 - tl.sum(eG1, axis=0)[None, :]


@triton.jit
def _mlp_dual_fwd_kernel(XQ, XK, XV, ETA, W1_0, B1_0, W2_0, B2_0, LNW, LNB, Z, W1_OUT, B1_OUT, W2_OUT, B2_OUT,
                         N, H, BS: tl.constexpr, F: tl.constexpr, M: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B*H*N*b*f reaches 2^31 at the paper's batch x context
    h = bh % H
    rb = tl.arange(0, BS)
    rf = tl.arange(0, F)
    HALF: tl.constexpr = M // 2
    ra = tl.arange(0, HALF)  # the first half of the hidden units
    rz = HALF + ra  # the second
    # The weights, split by hidden unit into two halves (a, z), each its own register tensor: W1 [f, m/2],
    # b1 [1, m/2], and W2 transposed, [f, m/2] as W1 (see the updates below), read from W2 [m, f] as it is.
    W1_base, W2_base = W1_0 + bh * F * M, W2_0 + bh * M * F
    W1a, W1z = _tile(W1_base, rf, ra, M, 1), _tile(W1_base, rf, rz, M, 1)
    W2ta, W2tz = _tile(W2_base, rf, ra, 1, F), _tile(W2_base, rf, rz, 1, F)
    b1a = tl.load(B1_0 + bh * M + ra).to(tl.float32)[None, :]
    b1z = tl.load(B1_0 + bh * M + rz).to(tl.float32)[None, :]
    b2 = tl.load(B2_0 + bh * F + rf).to(tl.float32)[None, :]
    gamma = tl.load(LNW + h * F + rf).to(tl.float32)[None, :]
    beta = tl.load(LNB + h * F + rf).to(tl.float32)[None, :]
    causal = rb[:, None] >= rb[None, :]
    for n in range(N):
        tok = (bh * N + n) * BS * F
        xq = _tile(XQ + tok, rb, rf, F, 1)
        xk = _tile(XK + tok, rb, rf, F, 1)
        xv = _tile(XV + tok, rb, rf, F, 1)
        eta_ptr = ETA + (bh * N + n) * BS * BS
        eta = tl.where(causal, _tile(eta_ptr, rb, rb, BS, 1), 0.0)
        last = tl.load(eta_ptr + (BS - 1) * BS + rb).to(tl.float32)[:, None]  # e as a column

        # the gradients at the mini-batch's weights
        zq1a, x2a, dgelu1a, z2a = _first_layer(xq, xk, W1a, b1a, W2ta, PRECISION)
        zq1z, x2z, dgelu1z, z2z = _first_layer(xq, xk, W1z, b1z, W2tz, PRECISION)
        G2, _, _, _, _ = ln_l2_grad(z2a + z2z + b2, xv - xk, gamma, beta, F)
        # the outputs
        A1 = eta * (tl.dot(xq, xk.T, input_precision=PRECISION) + 1.0)
        G1a, xbar2a, M2a = _first_output(G2, A1, W2ta, zq1a, x2a, dgelu1a, PRECISION)
        G1z, xbar2z, M2z = _first_output(G2, A1, W2tz, zq1z, x2z, dgelu1z, PRECISION)
        M2 = M2a + M2z  # Xbar2 X2^T
        # Zbar2 = Xbar2 W2 + b2 - (E * (M2 + 1)) G2 with W2's update made first: Xbar2 W2 = Xbar2 W2' +
        # M2 diag(e) G2. A second product with the W2 of Z2 would keep W2's copy in the tl.dot operand layout
        # alive from Z2 to here (64 registers a thread at f = 64 with 8 warps).
        eG2 = last * G2
        W2ta, zq2a = _second_update(W2ta, eG2, x2a, xbar2a, PRECISION)
        W2tz, zq2z = _second_update(W2tz, eG2, x2z, xbar2z, PRECISION)
        A2 = eta * (M2 + 1.0) - M2 * tl.trans(last)
        zbar2 = zq2a + zq2z + b2 - tl.dot(A2, G2, input_precision=PRECISION)
        b2 -= tl.sum(eG2, axis=0)[None, :]
        xhat, _ = normalize(zbar2, F)
        _store_tile(Z + tok, xq + gamma * xhat + beta, rb, rf, F, 1)
        # W1's update last: Triton gives every chained tl.dot of the loop the warp layout it picks for the
        # last one by its shape, for an [f, m/2] result warps side by side along the columns, as every [b, .]
        # tile needs (b = 16 rows are one MMA tile high). For an [m, f] result (W2's update, were W2 not kept
        # transposed) they would be stacked along the rows, and every [b, .] tile replicated in every warp.
        W1a, b1a = _first_update(W1a, b1a, xk, G1a, last, PRECISION)
        W1z, b1z = _first_update(W1z, b1z, xk, G1z, last, PRECISION)
    W1_base, W2_base = W1_OUT + bh * F * M, W2_OUT + bh * M * F
    _store_tile(W1_base, W1a, rf, ra, M, 1)
    _store_tile(W1_base, W1z, rf, rz, M, 1)
    _store_tile(W2_base, W2ta, rf, ra, 1, F)
    _store_tile(W2_base, W2tz, rf, rz, 1, F)
    tl.store(B1_OUT + bh * M + ra[None, :], b1a)
    tl.store(B1_OUT + bh * M + rz[None, :], b1z)
    tl.store(B2_OUT + bh * F + rf[None, :], b2)


# (num_warps, num_stages) of the forward kernel by precision and head size, chosen from the ahead-of-time
# compile (python -m ttt_bench.kernels.ttt_mlp_aot; tests/test_kernel_ttt_mlp.py). tf32: f = 16 keeps
# everything in registers with 4 warps (203-224 registers a thread on sm_80 / sm_90), f = 32 with 8 on sm_80
# (255; sm_90 spills 60 bytes), f = 64 spills 2.5-2.8 KB a thread with 8 warps (the least of 4, 8, 16: the
# 128 KB of float32 weights and the [16, m/2] operands held whole by every warp do not fit). ieee (FMA
# matmuls) spills from f = 16 on sm_90 and from f = 32 on both. Shared memory: at most 76 KB (f = 64, ieee).
_LAUNCH = {
    "tf32": {16: (4, 1), 32: (8, 1), 64: (8, 1)},
    "ieee": {16: (8, 1), 32: (8, 1), 64: (16, 1)},
}


def launch_options(f: int, precision: str) -> dict:
    """The launch options (num_warps, num_stages) of the forward kernel at head size f."""
    warps, stages = _LAUNCH[precision][f]
    return {"num_warps": warps, "num_stages": stages}


def why_not(XQ: torch.Tensor, W1, b1, b2, ln_weight) -> str:
    """Why inputs are outside the kernel's domain ("" when inside): floating-point inputs, both biases and
    LN-and-residual (the layer's defaults), hidden width 4 f, head size f in HEAD_SIZES (powers of 2 for
    tl.arange, compiled and checked for registers and shared memory ahead of time) and mini-batch size in
    MINI_BATCHES."""
    bs, f = XQ.shape[-2:]
    if not XQ.dtype.is_floating_point:
        return f"dtype {XQ.dtype} (the kernel takes floating-point inputs)"
    if b1 is None or b2 is None or ln_weight is None:
        return "no bias or no LayerNorm-and-residual"
    if W1.shape[-1] != EXPANSION * f:
        return f"hidden width {W1.shape[-1]} (the kernel takes {EXPANSION} x the head size {f})"
    if f not in HEAD_SIZES:
        return f"head size {f} (the kernel takes {', '.join(map(str, HEAD_SIZES))})"
    if bs not in MINI_BATCHES:
        return f"mini-batch size {bs} (the kernel takes {', '.join(map(str, MINI_BATCHES))})"
    return ""


def supported(XQ: torch.Tensor, W1, b1, b2, ln_weight) -> bool:
    """Whether the kernel takes these inputs (`why_not`)."""
    return not why_not(XQ, W1, b1, b2, ln_weight)


def ttt_mlp_dual(XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, precision: str = "ieee"):
    """TTT-MLP's dual form over N mini-batches, forward only: the same inputs and outputs as
    `ttt_bench.models.ttt.dual_scan.ttt_mlp_dual` on the kernel's domain (`supported`).

    XQ, XK, XV [B, H, N, b, f]; eta [B, H, N, b, b] (lower triangle read); W1 [B, H, f, 4f], b1 [B, H, 1, 4f],
    W2 [B, H, 4f, f], b2 [B, H, 1, f] the initial weights; ln_weight, ln_bias [H, 1, f]. Returns Z
    [B, H, N, b, f] (with the +XQ residual, in XQ's dtype) and the weights after the last mini-batch
    (W1, b1, W2, b2; float32 at least). No autograd: under grad mode with an input that requires grad it
    raises (a backward kernel is future work). precision: "ieee" (exact float32 matmuls) or "tf32".
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    inputs = (XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise RuntimeError("ttt_mlp_dual (Triton) is forward only: call it under torch.no_grad()")
    reason = why_not(XQ, W1, b1, b2, ln_weight)
    if reason:
        raise ValueError(f"outside the TTT-MLP kernel's domain: {reason}")
    B, H, N, BS, F = XQ.shape
    M = EXPANSION * F
    shapes = {"XK": (XK, (B, H, N, BS, F)), "XV": (XV, (B, H, N, BS, F)), "eta": (eta, (B, H, N, BS, BS)),
              "W1": (W1, (B, H, F, M)), "b1": (b1, (B, H, 1, M)), "W2": (W2, (B, H, M, F)),
              "b2": (b2, (B, H, 1, F)), "ln_weight": (ln_weight, (H, 1, F)), "ln_bias": (ln_bias, (H, 1, F))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias = (t.contiguous() for t in inputs)
    Z = torch.empty_like(XQ)
    state = lambda w: torch.empty_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
    W1_out, b1_out, W2_out, b2_out = state(W1), state(b1), state(W2), state(b2)
    if N:
        _mlp_dual_fwd_kernel[(B * H,)](XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, Z,
                                       W1_out, b1_out, W2_out, b2_out, N, H, BS=BS, F=F, M=M,
                                       PRECISION=precision, **launch_options(F, precision))
    else:
        for out, w in zip((W1_out, b1_out, W2_out, b2_out), (W1, b1, W2, b2), strict=True):
            out.copy_(w)
    return Z, W1_out, b1_out, W2_out, b2_out
