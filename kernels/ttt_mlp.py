"""TTT-MLP in dual form, fused, forward and backward: one Triton program per (sequence, head) and direction.

The same function as the PyTorch dual form (`ttt_bench.kernels.ttt.dual_scan.ttt_mlp_dual`, and
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

eta [B, H, N, b, b] is taken as the PyTorch dual form takes it: the op builds it as ttt.eta(token_eta, lr)
(kernels/ttt/ops.py), eta[t, s] = token_eta[t] lr[s] with token_eta[t] = 1/(t+1) (+ the learnable
offset, clamped at 0) and lr = eta_base sigmoid(theta_lr . x + bias) / head_dim; only its lower triangle
(s <= t) is read, as there.

Inputs of any float dtype are read as they are and converted to float32 in registers; every matmul
accumulates in float32 (`precision`: exact float32 FMAs, or tf32 tensor cores), every LayerNorm, GELU,
gradient and update is float32. Z comes back in XQ's dtype, the weights in float32 (or float64 if given so).

Forward registers (python -m ttt_bench.kernels.ttt_mlp_aot): W1 and W2 are 2 f m = 8 f^2 float32 a program,
128 KB at f = 64, spread over the warps (8 warps: 128 of a thread's 255 registers). Each is held as two halves
of the hidden units (`_first_layer` and the others run once per half): Triton makes a whole copy of a tl.dot
operand in its operand layout, and every warp holds the whole [16, k] operand of the products over the hidden
units (X2 W2, Xbar2 X2^T, Xbar2 W2'), which are further split into even and odd units (`_dot_nt`). With
tf32 nothing spills at f = 16 (sm_80, sm_90) and f = 32 (sm_80; 60 bytes on sm_90); at f = 64 (the paper
sizes') 2.5-2.8 KB a thread spill to local memory (see `launch_options`). Triton keeps no tensor in shared
memory across loop iterations: shared memory holds only tl.dot operands on their way to the MMA layout,
at most 76 KB a program, under sm_80's 163 KB and sm_90's 227 KB.

Training (`TTTMLPDual`, structured as kernels/ttt_linear.py's TTT-Linear): when a gradient is to come, the
forward kernel (STORE_STATES) also stores each mini-batch's G1 [b, m] and G2 [b, f], float32: 5 b f floats per
(sequence, head, mini-batch), 1.5x the mini-batch's inputs XQ, XK, XV, eta at f = 64 (20 KB), where its
weights W1, b1, W2, b2 (8 f^2 + 5 f floats, 10x the inputs) would be 6.5x more (1.7x at f = 16); without a
gradient it stores nothing (STORE_STATES off: the same compiled kernel as before). The backward kernel walks
the mini-batches in reverse from the last weights (the forward's outputs), undoes each mini-batch's update
with its stored G1, G2 (W1 += XK^T diag(e) G1, then W2 += X2^T diag(e) G2 with X2 at that W1: float32 rounding
only, measured no drift over 16 mini-batches), recomputes its forward and carries dL/dW1, db1, dW2, db2 back
through the update. Its weight-sized tensors stay in memory (L1 / L2), read where used: the weights in a
scratch buffer (both [f, m] as read, W2 transposed) and the carried dW1, dW2 in the gradient outputs, to which
each term is added as soon as it is known (7 read-modify-writes of an [f, m] tile a mini-batch; a barrier
before each): held in registers across a mini-batch (this kernel's first version) they spilled more,
4.7-5.2 KB a thread at f = 64, 280 B at f = 16. tf32, with the launcher's 8 warps and maxnreg 255 (without it
ptxas gives the kernel 128 registers a thread on sm_80 at f = 64 and spills 5.3 KB), per thread (python
-m ttt_bench.kernels.ttt_mlp_aot --kernel backward --launch):

    f    sm_80: regs  spill st/ld B  shared KB    sm_90: regs  spill st/ld B  shared KB
    16          255      132 / 124       10              255      316 / 312       10
    32          255     1044 / 1096      34              255     1248 / 1404      34
    64          255     3188 / 3504     132              255     2680 / 2984     164

4 and 16 warps spill more at every size (f = 64: 6.2-7.4 KB with 4, 3.9-4.2 KB with 16). What spills: the
[16, m] tiles over the hidden units (X2, gelu'(Z1), G1, Xbar2, their gradients, ...) live across most of the
mini-batch (16 registers each at f = 64), and each tl.dot operand over them is held whole by every warp
(`_dot_nt`). The training forward (also maxnreg 255) spills about as the forward: f = 16 nothing, f = 32
8-52 B, f = 64 1.6 KB (sm_80) and 2.8 KB (sm_90).
"""

import torch
import triton
import triton.language as tl

from .ln import ln_backward, ln_l2_grad, normalize, row_mean

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
def _add_tile(ptr, x, offs_r, offs_c, stride_r, stride_c):
    """tile += x in memory, after every thread's earlier reads and writes of it (a program's threads need not
    hold a tile's entries in the same layout from one use to the next)."""
    tl.debug_barrier()
    _store_tile(ptr, _tile(ptr, offs_r, offs_c, stride_r, stride_c) + x, offs_r, offs_c, stride_r, stride_c)


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
                         G1_STATES, G2_STATES, N, H, BS: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
                         STORE_STATES: tl.constexpr, PRECISION: tl.constexpr):
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
        if STORE_STATES:  # the weights' updates' G1, G2, for the backward to undo them
            _store_tile(G1_STATES + (bh * N + n) * BS * M, G1a, rb, ra, M, 1)
            _store_tile(G1_STATES + (bh * N + n) * BS * M, G1z, rb, rz, M, 1)
            _store_tile(G2_STATES + tok, G2, rb, rf, F, 1)
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



@triton.jit
def _gelu_grad2(x):
    """gelu''(x) = s (1 - s) (2 v' + x (1 - 2 s) v'^2 + x v''), s = sigmoid(v), v = C (x + A x^3)
    (learner.gelu_grad2)."""
    xx = x * x
    s = tl.sigmoid(x * (GELU_C + GELU_A * GELU_C * xx))
    dv = GELU_C + 3.0 * GELU_A * GELU_C * xx
    return (s - s * s) * (2.0 * dv + x * (1.0 - 2.0 * s) * dv * dv + 6.0 * GELU_A * GELU_C * xx)


@triton.jit
def _ln_l2_grad_backward(dG, G, xhat, std, gy, gx, gamma, F: tl.constexpr):
    """Through G = ln_l2_grad(z, target, gamma, beta) = ln_backward(gx, xhat, std), gx = gamma gy,
    gy = gamma xhat + beta - target (as kernels/ttt_linear.py's backward): dL/dz, dL/dgy (dL/dtarget = -dgy,
    dL/dbeta's per-token terms) and dL/dgamma's per-token terms."""
    dGs = dG / std
    dgx = ln_backward(dG, xhat, std, F)
    dxhat = -row_mean(gx * xhat, F) * dGs - row_mean(dGs * xhat, F) * gx
    dstd = -tl.sum(dG * G, axis=1)[:, None] / std
    dgy = dgx * gamma
    dxhat += dgy * gamma
    dz = ln_backward(dxhat, xhat, std, F) + dstd * xhat / F
    return dz, dgy, dgx * gy + dgy * xhat


@triton.jit
def _mlp_dual_bwd_kernel(XQ, XK, XV, ETA, G1_STATES, G2_STATES, W1_LAST, B1_LAST, W2_LAST, B2_LAST,
                         W1_S, W2_S, LNW, LNB, DZ, DW1_LAST, DB1_LAST, DW2_LAST, DB2_LAST,
                         DXQ, DXK, DXV, DETA, DW1_0, DB1_0, DW2_0, DB2_0, DLNW, DLNB,
                         N, H, BS: tl.constexpr, F: tl.constexpr, M: tl.constexpr, PRECISION: tl.constexpr):
    """The mini-batches in reverse: each one's weights got back from the next one's by undoing its update
    with the G1, G2 the forward stored, its forward recomputed (the module docstring's equations, same
    names), then its backward, carrying dL/dW1, db1, dW2, db2 of the weights after it. W2 and its gradient
    are read transposed, [f, m], as the forward holds W2. The weight-sized tensors stay in memory, read at
    each use: the weights in W1_S, W2_S (from the last ones, W1_LAST, W2_LAST), the carried dW1, dW2 in the
    outputs DW1_0, DW2_0; the mini-batch's terms are added to them as soon as known (`_add_tile`)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets, as the forward
    h = bh % H
    rb = tl.arange(0, BS)
    rf = tl.arange(0, F)
    rm = tl.arange(0, M)
    gamma = tl.load(LNW + h * F + rf).to(tl.float32)[None, :]
    beta = tl.load(LNB + h * F + rf).to(tl.float32)[None, :]
    causal = rb[:, None] >= rb[None, :]
    is_last_row = rb[:, None] == BS - 1
    w1, w2 = W1_S + bh * F * M, W2_S + bh * M * F
    _store_tile(w1, _tile(W1_LAST + bh * F * M, rf, rm, M, 1), rf, rm, M, 1)
    _store_tile(w2, _tile(W2_LAST + bh * M * F, rf, rm, 1, F), rf, rm, 1, F)
    b1 = tl.load(B1_LAST + bh * M + rm).to(tl.float32)[None, :]
    b2 = tl.load(B2_LAST + bh * F + rf).to(tl.float32)[None, :]
    dw1, dw2 = DW1_0 + bh * F * M, DW2_0 + bh * M * F
    _store_tile(dw1, _tile(DW1_LAST + bh * F * M, rf, rm, M, 1), rf, rm, M, 1)
    _store_tile(dw2, _tile(DW2_LAST + bh * M * F, rf, rm, 1, F), rf, rm, 1, F)
    db1 = tl.load(DB1_LAST + bh * M + rm).to(tl.float32)[None, :]
    db2 = tl.load(DB2_LAST + bh * F + rf).to(tl.float32)[None, :]
    dgamma = tl.zeros([1, F], dtype=tl.float32)
    dbeta = tl.zeros([1, F], dtype=tl.float32)
    tl.debug_barrier()  # the copies before the first mini-batch reads them
    for i in range(N):
        n = N - 1 - i
        mb = bh * N + n
        tok = mb * BS * F
        xq = _tile(XQ + tok, rb, rf, F, 1)
        xk = _tile(XK + tok, rb, rf, F, 1)
        xv = _tile(XV + tok, rb, rf, F, 1)
        eta_ptr = ETA + mb * BS * BS
        eta = tl.where(causal, _tile(eta_ptr, rb, rb, BS, 1), 0.0)
        last = tl.load(eta_ptr + (BS - 1) * BS + rb).to(tl.float32)[:, None]

        # the mini-batch's weights, W1 = W1' + XK^T diag(e) G1, b1 = b1' + e^T G1, then W2 = W2' +
        # X2^T diag(e) G2, b2 = b2' + e^T G2 (X2 at W1), and its forward, again
        eG1 = last * _tile(G1_STATES + mb * BS * M, rb, rm, M, 1)
        _add_tile(w1, tl.dot(_tile(XK + tok, rf, rb, 1, F), eG1, input_precision=PRECISION), rf, rm, M, 1)
        b1 += tl.sum(eG1, axis=0)[None, :]
        tl.debug_barrier()
        z1 = tl.dot(xk, _tile(w1, rf, rm, M, 1), input_precision=PRECISION) + b1
        x2, dgelu1 = _gelu_and_grad(z1)
        eG2 = last * _tile(G2_STATES + tok, rb, rf, F, 1)
        _add_tile(w2, tl.dot(eG2.T, x2, input_precision=PRECISION), rf, rm, 1, F)
        b2 += tl.sum(eG2, axis=0)[None, :]
        tl.debug_barrier()
        z2 = _dot_nt(x2, _tile(w2, rf, rm, 1, F), PRECISION) + b2
        G2, xhat1, std1, gy, gx = ln_l2_grad(z2, xv - xk, gamma, beta, F)
        hG2 = tl.dot(G2, _tile(w2, rf, rm, 1, F), input_precision=PRECISION)  # H = G2 W2^T
        G1 = hG2 * dgelu1
        h_dgelu2 = hG2 * _gelu_grad2(z1)  # H gelu''(Z1): all the backward needs of H and Z1
        S1 = tl.dot(xq, xk.T, input_precision=PRECISION) + 1.0
        A1 = eta * S1
        zbar1 = tl.dot(xq, _tile(w1, rf, rm, M, 1), input_precision=PRECISION) + b1
        zbar1 -= tl.dot(A1, G1, input_precision=PRECISION)
        xbar2, dgelu_bar1 = _gelu_and_grad(zbar1)
        S2 = _dot_nt(xbar2, x2, PRECISION) + 1.0  # Xbar2 X2^T + 1
        A2 = eta * S2
        zbar2 = _dot_nt(xbar2, _tile(w2, rf, rm, 1, F), PRECISION) + b2
        zbar2 -= tl.dot(A2, G2, input_precision=PRECISION)
        xhat2, std2 = normalize(zbar2, F)

        # W1' = W1 - XK^T diag(e) G1, b1' = b1 - e^T G1, W2' = W2 - X2^T diag(e) G2, b2' = b2 - e^T G2:
        # the terms through the carried gradients. dL/d(diag(e) G1) = -u1, dL/d(diag(e) G2) = -u2
        u1 = tl.dot(xk, _tile(dw1, rf, rm, M, 1), input_precision=PRECISION) + db1
        u2 = _dot_nt(x2, _tile(dw2, rf, rm, 1, F), PRECISION) + db2
        dlast = -tl.sum(u1 * G1, axis=1) - tl.sum(u2 * G2, axis=1)
        dG1 = -last * u1
        dG2 = -last * u2
        dxk = -_dot_nt(last * G1, _tile(dw1, rf, rm, M, 1), PRECISION)
        dx2 = -tl.dot(last * G2, _tile(dw2, rf, rm, 1, F), input_precision=PRECISION)
        # out = XQ + gamma LN(Zbar2) + beta
        dout = _tile(DZ + tok, rb, rf, F, 1)
        dgamma += tl.sum(dout * xhat2, axis=0)[None, :]
        dbeta += tl.sum(dout, axis=0)[None, :]
        dzbar2 = ln_backward(dout * gamma, xhat2, std2, F)
        _add_tile(dw2, tl.dot(dzbar2.T, xbar2, input_precision=PRECISION), rf, rm, 1, F)
        # Zbar2 = Xbar2 W2 + b2 - A2 G2, A2 = E * S2, S2 = Xbar2 X2^T + 1
        dxbar2 = tl.dot(dzbar2, _tile(w2, rf, rm, 1, F), input_precision=PRECISION)
        dG2 -= tl.dot(A2.T, dzbar2, input_precision=PRECISION)
        dA2 = -tl.dot(dzbar2, G2.T, input_precision=PRECISION)
        dS2 = dA2 * eta
        dxbar2 += tl.dot(dS2, x2, input_precision=PRECISION)
        dx2 += tl.dot(dS2.T, xbar2, input_precision=PRECISION)
        # Zbar1 = XQ W1 + b1 - A1 G1, Xbar2 = gelu(Zbar1), A1 = E * S1, S1 = XQ XK^T + 1
        dzbar1 = dxbar2 * dgelu_bar1
        # XQ^T (and XK^T below) read as [f, b] tiles
        xq_t = _tile(XQ + tok, rf, rb, 1, F)
        _add_tile(dw1, tl.dot(xq_t, dzbar1, input_precision=PRECISION), rf, rm, M, 1)
        dA1 = -tl.dot(dzbar1, G1.T, input_precision=PRECISION)
        dG1 -= tl.dot(A1.T, dzbar1, input_precision=PRECISION)
        deta = dA2 * S2 + dA1 * S1 + tl.where(is_last_row, dlast[None, :], 0.0)  # e is E's last row
        _store_tile(DETA + mb * BS * BS, tl.where(causal, deta, 0.0), rb, rb, BS, 1)
        dS1 = dA1 * eta
        dxq = dout + _dot_nt(dzbar1, _tile(w1, rf, rm, M, 1), PRECISION)
        _store_tile(DXQ + tok, dxq + tl.dot(dS1, xk, input_precision=PRECISION), rb, rf, F, 1)
        dxk += tl.dot(dS1.T, xq, input_precision=PRECISION)
        # G1 = H * gelu'(Z1), H = G2 W2^T
        dhG2 = dG1 * dgelu1
        dz1 = dG1 * h_dgelu2
        dG2 += _dot_nt(dhG2, _tile(w2, rf, rm, 1, F), PRECISION)
        _add_tile(dw2, tl.dot(G2.T, dhG2, input_precision=PRECISION), rf, rm, 1, F)
        # G2: the LN-L2 gradient at Z2 = X2 W2 + b2 with the target XV - XK
        dz2, dgy, dgamma_tok = _ln_l2_grad_backward(dG2, G2, xhat1, std1, gy, gx, gamma, F)
        dgamma += tl.sum(dgamma_tok, axis=0)[None, :]
        dbeta += tl.sum(dgy, axis=0)[None, :]
        _store_tile(DXV + tok, -dgy, rb, rf, F, 1)
        dx2 += tl.dot(dz2, _tile(w2, rf, rm, 1, F), input_precision=PRECISION)
        _add_tile(dw2, tl.dot(dz2.T, x2, input_precision=PRECISION), rf, rm, 1, F)
        # X2 = gelu(Z1), Z1 = XK W1 + b1
        dz1 += dx2 * dgelu1
        _store_tile(DXK + tok, dxk + dgy + _dot_nt(dz1, _tile(w1, rf, rm, M, 1), PRECISION), rb, rf, F, 1)
        _add_tile(dw1, tl.dot(_tile(XK + tok, rf, rb, 1, F), dz1, input_precision=PRECISION), rf, rm, M, 1)
        db1 += tl.sum(dzbar1 + dz1, axis=0)[None, :]
        db2 += tl.sum(dzbar2 + dz2, axis=0)[None, :]
    tl.store(DB1_0 + bh * M + rm[None, :], db1)
    tl.store(DB2_0 + bh * F + rf[None, :], db2)
    tl.store(DLNW + bh * F + rf[None, :], dgamma)
    tl.store(DLNB + bh * F + rf[None, :], dbeta)


# (num_warps, num_stages) of the (forward, backward) kernel by precision and head size, chosen from the
# ahead-of-time compile (python -m ttt_bench.kernels.ttt_mlp_aot, --kernel backward;
# tests/test_kernel_ttt_mlp.py).
# Forward, tf32: f = 16 keeps everything in registers with 4 warps (203-224 registers a thread on sm_80 /
# sm_90), f = 32 with 8 on sm_80 (255; sm_90 spills 60 bytes), f = 64 spills 2.5-2.8 KB a thread with 8 warps
# (the least of 4, 8, 16: the 128 KB of float32 weights and the [16, m/2] operands held whole by every warp do
# not fit). ieee (FMA matmuls) spills from f = 16 on sm_90 and from f = 32 on both. Shared memory: at most
# 76 KB (f = 64, ieee). Backward (with maxnreg, `launch_options`), tf32: 8 warps spill the least at every size
# (the module docstring's table). ieee: 0.6-0.7 KB at f = 16, 3.4-5.6 KB at f = 32 (8 warps), 19-23 KB at
# f = 64 (16 warps; 22-28 KB with 8), where it needs 206 KB of shared memory (190 with 8 warps): over sm_80's
# 163 KB, it runs on sm_90 only (the layer runs tf32 on CUDA).
_LAUNCH = {
    "tf32": {16: ((4, 1), (8, 1)), 32: ((8, 1), (8, 1)), 64: ((8, 1), (8, 1))},
    "ieee": {16: ((8, 1), (8, 1)), 32: ((8, 1), (8, 1)), 64: ((16, 1), (16, 1))},
}


def launch_options(f: int, precision: str, kernel: str = "forward", num_warps: int | None = None) -> dict:
    """The launch options of `kernel` at head size f: "forward" (no gradient to come), "training" (the forward
    storing every mini-batch's G1, G2) or "backward". num_warps (the table's unless given), num_stages, and
    for training and the backward maxnreg, every register a thread may have at that many warps: without it
    ptxas gives them 128 registers on sm_80 at f = 64 and spills more (tf32: the backward 5.3 KB instead of
    3.2, training 2.9 KB instead of 1.6). The forward without a gradient keeps the options it had before the
    backward existed."""
    warps, stages = _LAUNCH[precision][f][kernel == "backward"]
    warps = num_warps or warps
    options = {"num_warps": warps, "num_stages": stages}
    if kernel != "forward":
        options["maxnreg"] = min(255, 65536 // (32 * warps))  # 64K registers per SM (and per block)
    return options


def model_why_not(x: torch.Tensor, W1, b1, b2, ln_weight) -> str:
    """Why an inner model is outside what TTT-MLP's kernels (this one, ttt_mlp_decode.py) take ("" when
    inside): floating-point inputs x [..., f], both biases and LN-and-residual (the layer's defaults), hidden
    width 4 f, head size f in HEAD_SIZES (powers of 2 for tl.arange, compiled and checked for registers and
    shared memory ahead of time)."""
    f = x.shape[-1]
    if not x.dtype.is_floating_point:
        return f"dtype {x.dtype} (the kernel takes floating-point inputs)"
    if b1 is None or b2 is None or ln_weight is None:
        return "no bias or no LayerNorm-and-residual"
    if W1.shape[-1] != EXPANSION * f:
        return f"hidden width {W1.shape[-1]} (the kernel takes {EXPANSION} x the head size {f})"
    if f not in HEAD_SIZES:
        return f"head size {f} (the kernel takes {', '.join(map(str, HEAD_SIZES))})"
    return ""


def why_not(XQ: torch.Tensor, W1, b1, b2, ln_weight) -> str:
    """Why inputs are outside the kernel's domain ("" when inside): the inner model's (`model_why_not`), and
    a mini-batch size XQ.shape[-2] in MINI_BATCHES."""
    bs = XQ.shape[-2]
    reason = model_why_not(XQ, W1, b1, b2, ln_weight)
    if not reason and bs not in MINI_BATCHES:
        reason = f"mini-batch size {bs} (the kernel takes {', '.join(map(str, MINI_BATCHES))})"
    return reason


def supported(XQ: torch.Tensor, W1, b1, b2, ln_weight) -> bool:
    """Whether the kernel takes these inputs (`why_not`)."""
    return not why_not(XQ, W1, b1, b2, ln_weight)


class TTTMLPDual(torch.autograd.Function):
    """Autograd wrapper: the forward kernel (storing every mini-batch's G1, G2 when `store`: a gradient is to
    come) and the backward kernel; gradients to every input, eta and the LayerNorm's included."""

    @staticmethod
    def forward(ctx, XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, precision, store: bool):
        B, H, N, BS, F = XQ.shape
        M = EXPANSION * F
        Z = torch.empty_like(XQ)
        state = lambda w: torch.empty_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
        last = state(W1), state(b1), state(W2), state(b2)
        # each mini-batch's G1 [b, m], G2 [b, f] (float32): 5 b f floats per (sequence, head, mini-batch);
        # without a gradient none (the kernel's STORE_STATES off, the pointers unused)
        states = (XQ.new_empty((B, H, N, BS, M), dtype=torch.float32),
                  XQ.new_empty((B, H, N, BS, F), dtype=torch.float32)) if store else (Z, Z)
        if N:
            _mlp_dual_fwd_kernel[(B * H,)](XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, Z, *last,
                                           *states, N, H, BS=BS, F=F, M=M,
                                           STORE_STATES=store, PRECISION=precision,
                                           **launch_options(F, precision, "training" if store else "forward"))
        else:
            for out, w in zip(last, (W1, b1, W2, b2), strict=True):
                out.copy_(w)
        if store:
            ctx.save_for_backward(XQ, XK, XV, eta, *states, *last, ln_weight, ln_bias)
            ctx.precision, ctx.weight_dtypes = precision, tuple(w.dtype for w in (W1, b1, W2, b2))
        return Z, *last

    @staticmethod
    def backward(ctx, dZ, *dlast):
        XQ, XK, XV, eta, G1, G2, W1, b1, W2, b2, ln_weight, ln_bias = ctx.saved_tensors
        B, H, N, BS, F = XQ.shape
        dZ, dlast = dZ.contiguous(), tuple(d.contiguous() for d in dlast)  # zeros for unused outputs
        dXQ, dXK, dXV, deta = map(torch.empty_like, (XQ, XK, XV, eta))
        dW1, db1, dW2, db2 = (torch.empty_like(w, dtype=torch.float32) for w in (W1, b1, W2, b2))
        dlnw, dlnb = (XQ.new_zeros(B, H, 1, F, dtype=torch.float32) for _ in range(2))
        if N:
            scratch = torch.empty_like(dW1), torch.empty_like(dW2)  # each mini-batch's W1, W2 in turn
            _mlp_dual_bwd_kernel[(B * H,)](XQ, XK, XV, eta, G1, G2, W1, b1, W2, b2, *scratch, ln_weight,
                                           ln_bias, dZ, *dlast, dXQ, dXK, dXV, deta, dW1, db1, dW2, db2, dlnw,
                                           dlnb, N, H, BS=BS, F=F, M=EXPANSION * F, PRECISION=ctx.precision,
                                           **launch_options(F, ctx.precision, "backward"))
        else:
            for out, d in zip((dW1, db1, dW2, db2), dlast, strict=True):
                out.copy_(d)
        dweights = (d.to(dtype) for d, dtype in zip((dW1, db1, dW2, db2), ctx.weight_dtypes, strict=True))
        dln = (d.sum(0).to(w.dtype) for d, w in ((dlnw, ln_weight), (dlnb, ln_bias)))
        return dXQ, dXK, dXV, deta, *dweights, *dln, None, None


def ttt_mlp_dual(XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias, precision: str = "ieee"):
    """TTT-MLP's dual form over N mini-batches: the same inputs and outputs as
    `ttt_bench.kernels.ttt.dual_scan.ttt_mlp_dual` on the kernel's domain (`supported`), differentiable
    (`TTTMLPDual`: with respect to every input, eta and the LayerNorm's weight and bias included).

    XQ, XK, XV [B, H, N, b, f]; eta [B, H, N, b, b] (lower triangle read; its gradient is zero above the
    diagonal); W1 [B, H, f, 4f], b1 [B, H, 1, 4f], W2 [B, H, 4f, f], b2 [B, H, 1, f] the initial weights;
    ln_weight, ln_bias [H, 1, f]. Returns Z [B, H, N, b, f] (with the +XQ residual, in XQ's dtype) and the
    weights after the last mini-batch (W1, b1, W2, b2; float32 at least). When an input requires grad (under
    grad mode) the forward also stores every mini-batch's G1, G2 for the backward, 5 b f floats per
    (sequence, head, mini-batch); otherwise it stores nothing. precision: "ieee" (exact float32 matmuls) or
    "tf32", of both kernels.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    reason = why_not(XQ, W1, b1, b2, ln_weight)
    if reason:
        raise ValueError(f"outside the TTT-MLP kernel's domain: {reason}")
    B, H, N, BS, F = XQ.shape
    M = EXPANSION * F
    inputs = (XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias)
    shapes = {"XK": (XK, (B, H, N, BS, F)), "XV": (XV, (B, H, N, BS, F)), "eta": (eta, (B, H, N, BS, BS)),
              "W1": (W1, (B, H, F, M)), "b1": (b1, (B, H, 1, M)), "W2": (W2, (B, H, M, F)),
              "b2": (b2, (B, H, 1, F)), "ln_weight": (ln_weight, (H, 1, F)), "ln_bias": (ln_bias, (H, 1, F))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    # store the weights for a backward only when there will be one (ctx.needs_input_grad is also true under
    # no_grad)
    store = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return TTTMLPDual.apply(*(t.contiguous() for t in inputs), precision, store)
