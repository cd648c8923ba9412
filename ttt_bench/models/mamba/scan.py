"""Chunked selective scan (Mamba's SSM) in pure PyTorch, forward and hand-written backward.

The recurrence h_t = a_t h_{t-1} + b_t, with a_t = exp(delta_t A) and b_t = delta_t u_t B_t, runs
per (batch, channel, state) with its own decay, so the matmul trick of Mamba-2's SSD (one scalar
decay per head) would cost chunk_size times more exponentials here. Instead the sequence of L
tokens is cut into nc chunks of Q tokens and scanned in two levels, every step vectorised over
all chunks at once:

  1. within every chunk, from a zero state, Q steps over [nc, b, d, n] slices -> chunk end states;
  2. a short recurrence over the nc chunks -> the true state entering every chunk;
  3. Q steps again from those states, contracting each state with C_t on the fly.

That is about Q + nc Python steps instead of L, no [b, l, d, n] temporaries besides the states
kept for backward, and a_t, b_t are recomputed from [b, l, d] inputs (cheap, cache friendly). The
backward pass is the same two-level scan in reverse. Decays are exp(delta A) <= 1 products, so
there is no overflow; padding positions get delta = 0 (a = 1, b = 0) and carry the state.

Layout: (batch, length, channels), unlike mamba-ssm's (batch, channels, length).
"""

import math

import torch
import torch.nn.functional as F


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


class _ChunkedScan(torch.autograd.Function):
    """(u, delta, A, B, C, h0) -> (y, h_last) with y_t = C_t . h_t (no D, z, softplus: done by autograd)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, h0, chunk_size):
        l = u.shape[1]
        q = max(1, min(chunk_size or math.isqrt(l), l))  # ~sqrt(L): balances the Q and nc Python steps
        dt, du, Bc, Cc = _chunked(delta, q), _chunked(delta * u, q), _chunked(B, q), _chunked(C, q)
        decay = lambda i: torch.exp(dt[i].unsqueeze(-1) * A)  # a_t for step i of every chunk
        inp = lambda i: du[i].unsqueeze(-1) * Bc[i].unsqueeze(-2)  # b_t

        hz = torch.zeros_like(h0).expand(dt.shape[1], *h0.shape)
        for i in range(q):  # 1. chunk end states from zero
            hz = torch.addcmul(inp(i), decay(i), hz)
        chunk_decay = torch.exp(dt.sum(0).unsqueeze(-1) * A)
        h_in = torch.empty_like(hz)
        h = h0
        for c in range(hz.shape[0]):  # 2. states entering every chunk
            h_in[c] = h
            h = torch.addcmul(hz[c], chunk_decay[c], h)
        h_last = h

        hs = hz.new_empty(q, *hz.shape) if any(ctx.needs_input_grad[:6]) else None
        y = dt.new_empty(dt.shape)
        h = h_in
        for i in range(q):  # 3. all states, contracted with C_t
            h = torch.addcmul(inp(i), decay(i), h, out=None if hs is None else hs[i])
            y[i] = (h @ Cc[i].unsqueeze(-1)).squeeze(-1)
        if hs is not None:
            ctx.save_for_backward(u, delta, A, B, C, h_in, hs)
            ctx.chunk = q
        return _unchunked(y, l), h_last

    @staticmethod
    def backward(ctx, gy, gh_last):
        u, delta, A, B, C, h_in, hs = ctx.saved_tensors
        l, q = u.shape[1], ctx.chunk
        dt, du, Bc, Cc, gyc = (_chunked(x, q) for x in (delta, delta * u, B, C, gy))
        decay = lambda i: torch.exp(dt[i].unsqueeze(-1) * A)
        seed = lambda i: gyc[i].unsqueeze(-1) * Cc[i].unsqueeze(-2)  # dL/dh_t from y_t
        # g_t = dL/dh_t = C_t gy_t + a_{t+1} g_{t+1}: the same two-level scan, backwards in time.
        ga = None
        for i in reversed(range(q)):  # 1. chunk start gradients from a zero carry
            g = seed(i) if ga is None else seed(i).add_(ga)
            a0 = decay(i)
            ga = g * a0
        g0 = g  # g at the start of every chunk, zero carry
        inner_decay = torch.exp(dt[1:].sum(0).unsqueeze(-1) * A)  # prod of a over steps 1..q-1
        carry = torch.empty_like(g0)  # a_{t+1} g_{t+1} flowing into the last step of every chunk
        k = torch.zeros_like(h_in[0]) if gh_last is None else gh_last
        for c in reversed(range(g0.shape[0])):  # 2.
            carry[c] = k
            k = a0[c] * torch.addcmul(g0[c], inner_decay[c], k)
        gh0 = k

        gdu, gdt, gB, gC = (torch.empty_like(x) for x in (du, dt, Bc, Cc))
        gA = torch.zeros_like(hs[0])
        ga = carry
        for i in reversed(range(q)):  # 3. every g_t and the input gradients it gives
            g = seed(i).add_(ga)
            a = decay(i)
            ga = g * a
            m = ga * (hs[i - 1] if i > 0 else h_in)  # dL/da_t * a_t = dL/d(delta_t A)
            gdu[i] = (g @ Bc[i].unsqueeze(-1)).squeeze(-1)
            gB[i] = (du[i].unsqueeze(-2) @ g).squeeze(-2)
            gC[i] = (gyc[i].unsqueeze(-2) @ hs[i]).squeeze(-2)
            gdt[i] = (m * A).sum(-1)
            gA.addcmul_(m, dt[i].unsqueeze(-1))
        gdu, gdt = _unchunked(gdu, l), _unchunked(gdt, l)
        return (gdu * delta, gdt + gdu * u, gA.sum((0, 1)), _unchunked(gB, l), _unchunked(gC, l), gh0, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_last_state=False, chunk_size=None):
    """Mamba's selective scan, as mamba-ssm's `selective_scan_fn` but in (batch, length, channels) layout.

    u, delta, z: [b, l, d]; A: [d, n]; B, C: [b, l, n]; D, delta_bias: [d]; initial_state: [b, d, n].
    chunk_size: tokens per chunk, default ~sqrt(l). Returns y [b, l, d] (and the last state [b, d, n]
    with return_last_state). Computes in float32 (float64 for float64 inputs), returns u's dtype.
    """
    out_dtype, dtype = u.dtype, torch.promote_types(u.dtype, torch.float32)
    u, delta, A, B, C = (x.to(dtype) for x in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)
    if delta_softplus:
        delta = F.softplus(delta)
    h0 = u.new_zeros(u.shape[0], u.shape[2], A.shape[1]) if initial_state is None else initial_state.to(dtype)
    y, h_last = _ChunkedScan.apply(u, delta, A, B, C, h0, chunk_size)
    if D is not None:
        y = y + u * D.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = y.to(out_dtype)
    return (y, h_last) if return_last_state else y
