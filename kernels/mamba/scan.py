"""Chunked selective scan (Mamba's SSM) in pure PyTorch, forward and hand-written backward.

The recurrence h_t = a_t h_{t-1} + b_t, with a_t = exp(delta_t A) and b_t = delta_t u_t B_t, runs
per (batch, channel, state) with its own decay, so the matmul trick of Mamba-2's SSD (one scalar
decay per head) would cost chunk_size times more exponentials here. Instead the sequence of L
tokens is cut into nc chunks of Q tokens and scanned in two levels, every step vectorised over
all chunks at once:

  1. within every chunk, from a zero state, Q steps over [nc, b, d, n] slices -> chunk end states;
  2. a short recurrence over the nc chunks -> the true state entering every chunk;
  3. Q steps again from those states, writing every state h_t; y_t = C_t . h_t is then one batched
     matmul over all tokens.

The backward pass is the same two-level scan in reverse for g_t = dL/dh_t, and in its third level
each step also turns its g_t into dL/d(delta_t A), while the slices are in cache.

On a CPU the cost is the number of passes over [b, l, d, n] tensors (each memory-bound; an
exponential costs about three multiplications), so: the decays a_t are exponentiated once, in the
forward, and kept for the backward, which recomputes the states from them (one multiply-add each,
and the memory of one such tensor per layer, as before); every step of a loop is one `addcmul` over
a contiguous slice; the contractions with C_t, B_t, delta_t u_t and the output gradient are batched
matmuls over all tokens; and softplus(delta + bias), the D skip and the silu(z) gate are part of
the same autograd Function, with a hand-written backward (docs/mamba.md has the measurements).
Decays are exp(delta A) <= 1 products, so there is no overflow; padding positions get delta = 0
(a = 1, b = 0) and carry the state.

This is the portable path (`model.block.backend=torch`, and wherever the C++ kernel of `scan_cpu.py`
does not build): the backend `torch` of `ops.selective_scan`, which runs that kernel by default on CPUs.

Layout: (batch, length, channels), unlike mamba-ssm's (batch, channels, length).
"""

import math

import torch
import torch.nn.functional as F

# Tokens per chunk when the caller gives none: the loops' Q steps and the nc chunk steps of small
# tensors; 8 measured fastest at the CPU sweeps' sizes (docs/mamba.md).
DEFAULT_CHUNK = 8


def default_chunk(l: int, cuda: bool) -> int:
    """Tokens per chunk for a sequence of l tokens: DEFAULT_CHUNK on a CPU; about sqrt(l) on a GPU, where
    each loop step is a kernel launch and the 2 sqrt(l) + l/Q steps are the cost (an H200 at l = 34,816,
    scan fwd+bwd: 330 ms at 8 tokens, 165 at 16, 56 at 64, 45 at 256, 133 at 1,024; results/gpu/RUN.md)."""
    return max(DEFAULT_CHUNK, math.isqrt(l)) if cuda else DEFAULT_CHUNK


def _chunked(x: torch.Tensor, q: int) -> torch.Tensor:
    """[b, l, k] -> [q, nc, b, k], zero-padded to nc * q tokens, position t = c * q + i at [i, c]."""
    b, l, k = x.shape
    nc = math.ceil(l / q)
    x = F.pad(x, (0, 0, 0, nc * q - l))
    return x.view(b, nc, q, k).permute(2, 1, 0, 3).contiguous()


def _unchunked(x: torch.Tensor, l: int) -> torch.Tensor:
    """Inverse of `_chunked`: [q, nc, b, k] -> [b, l, k]."""
    q, nc, b, k = x.shape
    return x.permute(2, 1, 0, 3).reshape(b, nc * q, k)[:, :l]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[q, nc, b, *s] -> [q nc b, *s] (a view): every token one batch entry of a bmm."""
    return x.flatten(0, 2)


def _states(a, du, Bc, h_in):
    """Step 3 of the forward: every state h_t, [q, nc, b, d, n], from the states entering the chunks."""
    hs = du.unsqueeze(-1) * Bc.unsqueeze(-2)  # every b_t, overwritten by h_t
    h = h_in
    for i in range(a.shape[0]):
        h = torch.addcmul(hs[i], a[i], h, out=hs[i])
    return hs


def _scan_forward(dt, du, A, Bc, Cc, h0):
    """The two-level scan on chunked inputs: (y, h_last, a, h_in)."""
    q = dt.shape[0]
    a = torch.mul(dt.unsqueeze(-1), A).exp_()  # [q, nc, b, d, n]: every a_t, the one exponential pass
    bx = du.unsqueeze(-1) * Bc.unsqueeze(-2)  # every b_t
    hz = bx[0]
    for i in range(1, q):  # 1. chunk end states from zero
        hz = torch.addcmul(bx[i], a[i], hz)
    chunk_decay = torch.exp(dt.sum(0).unsqueeze(-1) * A)
    h_in = torch.empty_like(hz)
    h = h0
    for c in range(hz.shape[0]):  # 2. states entering every chunk
        h_in[c] = h
        h = torch.addcmul(hz[c], chunk_decay[c], h)
    del bx
    hs = _states(a, du, Bc, h_in)  # 3.
    y = torch.bmm(_rows(Cc).unsqueeze(1), _rows(hs).transpose(1, 2)).view(dt.shape)
    return y, h, a, h_in


def _scan_backward(dt, du, A, Bc, Cc, a, h_in, gyc, gh_last):
    """Gradients of the two-level scan: (gdu, gdt, gA, gB, gC, gh0), chunked like the inputs."""
    q = dt.shape[0]
    hs = _states(a, du, Bc, h_in)
    # g_t = dL/dh_t = C_t gy_t + a_{t+1} g_{t+1}: the same two-level scan, backwards in time.
    g = gyc.unsqueeze(-1) * Cc.unsqueeze(-2)  # the seeds C_t gy_t, overwritten by g_t in 3.
    g0 = g[q - 1]
    for i in reversed(range(q - 1)):  # 1. chunk start gradients from a zero carry
        g0 = torch.addcmul(g[i], a[i + 1], g0)
    inner_decay = torch.exp(dt[1:].sum(0).unsqueeze(-1) * A)  # prod of a over steps 1..q-1
    carry = torch.empty_like(g0)  # a_{t+1} g_{t+1} flowing into the last step of every chunk
    k = gh_last
    for c in reversed(range(g0.shape[0])):  # 2.
        carry[c] = k
        k = a[0, c] * torch.addcmul(g0[c], inner_decay[c], k)
    gh0 = k
    g[q - 1] += carry

    gdt = torch.empty_like(dt)
    gA = torch.zeros_like(carry)
    m = torch.empty_like(carry)
    for i in reversed(range(q)):  # 3. every g_t in place of its seed, and dL/d(delta_t A) from it
        if i < q - 1:
            torch.addcmul(g[i], a[i + 1], g[i + 1], out=g[i])
        torch.mul(g[i], a[i], out=m).mul_(hs[i - 1] if i > 0 else h_in)  # dL/da_t a_t = dL/d(delta_t A)
        gA.addcmul_(m, dt[i].unsqueeze(-1))
        torch.sum(m.mul_(A), -1, out=gdt[i])
    gr = _rows(g)
    gdu = torch.bmm(_rows(Bc).unsqueeze(1), gr.transpose(1, 2)).view(dt.shape)
    gB = torch.bmm(_rows(du).unsqueeze(1), gr).view(Bc.shape)
    gC = torch.bmm(_rows(gyc).unsqueeze(1), _rows(hs)).view(Cc.shape)
    return gdu, gdt, gA.sum((0, 1)), gB, gC, gh0


class _SelectiveScan(torch.autograd.Function):
    """(u, delta, A, B, C, D, z, delta_bias, h0) -> (y, h_last), all of `selective_scan` in one Function.

    D, z, delta_bias may be None; h0 is a tensor (zeros for no initial state)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, h0, softplus, chunk_size):
        l = u.shape[1]
        pre = delta if delta_bias is None else delta + delta_bias
        delta = F.softplus(pre) if softplus else pre
        q = max(1, min(chunk_size or default_chunk(l, u.is_cuda), l))
        dt, du, Bc, Cc = _chunked(delta, q), _chunked(delta * u, q), _chunked(B, q), _chunked(C, q)
        y, h_last, a, h_in = _scan_forward(dt, du, A, Bc, Cc, h0)
        y = _unchunked(y, l)  # a copy: the in-place ops below are safe
        if D is not None:
            y.addcmul_(u, D)
        out, sz = y, None
        if z is not None:
            sz = torch.sigmoid(z)
            out = y * z * sz
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(u, delta, pre if softplus else None, A, B, C, D, z,
                                  y if z is not None else None, sz, a, h_in)
            ctx.chunk, ctx.has_bias = q, delta_bias is not None
        return out, h_last

    @staticmethod
    def backward(ctx, gout, gh_last):
        u, delta, pre, A, B, C, D, z, y, sz, a, h_in = ctx.saved_tensors
        l, q = u.shape[1], ctx.chunk
        gz = gD = gbias = None
        gy = gout
        if z is not None:
            silu = z * sz
            gy = gout * silu
            gz = gout * y * torch.addcmul(sz, silu, 1 - sz)  # silu'(z) = s + silu (1 - s)
        if D is not None:
            gD = (gy * u).sum((0, 1))
        dt, du, Bc, Cc, gyc = (_chunked(x, q) for x in (delta, delta * u, B, C, gy))
        gdu, gdt, gA, gB, gC, gh0 = _scan_backward(dt, du, A, Bc, Cc, a, h_in, gyc, gh_last)
        gdu, gdt, gB, gC = (_unchunked(x, l) for x in (gdu, gdt, gB, gC))
        gu = gdu * delta if D is None else torch.addcmul(gdu * delta, gy, D)
        gdelta = torch.addcmul(gdt, gdu, u)
        if pre is not None:
            gdelta = gdelta * torch.sigmoid(pre)  # softplus' = sigmoid
        if ctx.has_bias:
            gbias = gdelta.sum((0, 1))
        return gu, gdelta, gA, gB, gC, gD, gz, gbias, gh0, None, None


def chunked_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
                 return_last_state=False, chunk_size=None):
    """The chunked scan: `ops.selective_scan(..., backend="torch")`, whose arguments it takes; chunk_size is
    the tokens per chunk (default `default_chunk`). Computes in float32 (float64 for float64 inputs)."""
    dtype = torch.promote_types(u.dtype, torch.float32)
    h0 = u.new_zeros(u.shape[0], u.shape[2], A.shape[1]) if initial_state is None else initial_state
    inputs = (None if x is None else x.to(dtype) for x in (u, delta, A, B, C, D, z, delta_bias, h0))
    y, h_last = _SelectiveScan.apply(*inputs, delta_softplus, chunk_size)
    y = y.to(u.dtype)
    return (y, h_last) if return_last_state else y
