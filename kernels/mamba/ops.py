"""Mamba's selective scan (Gu and Dao, 2023) as one op with a `backend` argument, every backend beside its
reference (as mamba-ssm's ops/selective_scan_interface.py with its `*_ref`):

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,   y_t = C_t h_t + D u_t,   y *= silu(z)

  ref    scan_ref.py: one Python step per token, the reference (slow);
  torch  scan.py: the chunked two-level scan in PyTorch with a hand-written backward (any device);
  cpu    scan_cpu.py: a C++ kernel for CPUs, built at first use where a compiler works;
  cuda   mamba-ssm's `selective_scan_fn` (CUDA, where mamba-ssm imports);
  auto   cuda on a CUDA input where mamba-ssm imports, cpu on a CPU input where the kernel builds and takes
         it, torch otherwise.
One token of decoding is its own op, `selective_state_update`, the state updated in place (`ref` here,
`cuda` mamba-ssm's Triton kernel of the same name, as mamba-ssm's Mamba.step).
tests/test_ops_selective_scan.py compares each with ref in float64 (outputs, last states, gradients), cuda
with torch on a GPU; tests/test_mamba.py the whole block. The whole mixer fused, mamba-ssm's `mamba_inner_fn`
(projections, conv, scan, gate), is `mamba_inner()`.
"""

import functools

import torch

from . import scan_cpu
from .scan import chunked_scan
from .scan_ref import selective_scan_ref

BACKENDS = ("auto", "ref", "torch", "cpu", "cuda")


@functools.cache
def _mamba_ssm():
    """mamba-ssm's (selective_scan_fn, mamba_inner_fn), or None where mamba-ssm or causal-conv1d (which
    mamba_inner_fn needs) do not import."""
    try:  # imported lazily: mamba-ssm cannot be imported without CUDA
        import causal_conv1d  # noqa: F401
        from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn
    except (ImportError, OSError, RuntimeError):
        return None
    return selective_scan_fn, mamba_inner_fn


@functools.cache
def _state_update():
    """mamba-ssm's Triton `selective_state_update`, or None where it does not import."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as update
    except (ImportError, OSError, RuntimeError):
        return None
    return update


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, *,
                           backend: str = "auto"):
    """One token of the scan, h = exp(dt A) h + dt B x in place in `state` [b, d, n]; returns
    y = (C h + D x) silu(z), [b, d] in x's dtype. x, dt, z: [b, d]; A: [d, n]; B, C: [b, n]; D, dt_bias:
    [d]. ref: PyTorch in the state's precision (float32 at least); cuda: mamba-ssm's Triton kernel;
    auto: cuda on a CUDA input where it imports, else ref."""
    if backend not in ("auto", "ref", "cuda"):
        raise ValueError(f"backend must be auto, ref or cuda, got {backend!r}")
    if backend == "auto":
        backend = "cuda" if x.is_cuda and _state_update() is not None else "ref"
    if backend == "cuda":
        if not (x.is_cuda and _state_update() is not None):
            raise RuntimeError("the cuda backend needs a CUDA input and mamba-ssm (pip install -e '.[cuda]')")
        return _state_update()(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    f = torch.promote_types(state.dtype, torch.float32)
    dt = dt.to(f) if dt_bias is None else dt.to(f) + dt_bias.to(f)
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    h = state.to(f) * torch.exp(dt[..., None] * A.to(f)) + (dt * x.to(f))[..., None] * B.to(f)[:, None]
    state.copy_(h)
    y = (h * C.to(f)[:, None]).sum(-1)
    y = y if D is None else y + D.to(f) * x.to(f)
    y = y if z is None else y * torch.nn.functional.silu(z.to(f))
    return y.to(x.dtype)


def mamba_inner():
    """mamba-ssm's fused Mamba mixer (`mamba_inner_fn`, forward and backward), or None where it does not
    import."""
    kernels = _mamba_ssm()
    return None if kernels is None else kernels[1]


def backend_for(u: torch.Tensor, d_state: int, backend: str = "auto") -> str:
    """The backend `selective_scan` runs for input u (`auto` resolved); an error where the one asked for
    cannot run u."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cpu_ok = scan_cpu.supports(u, d_state) and scan_cpu.available()
    if backend == "auto":
        return "cuda" if u.is_cuda and _mamba_ssm() is not None else "cpu" if cpu_ok else "torch"
    if backend == "cpu" and not cpu_ok:
        raise RuntimeError("the Mamba CPU kernel needs CPU float32/float64 inputs, d_state <= "
                           f"{scan_cpu.MAX_STATE} and a C++ compiler (see docs/mamba.md)")
    if backend == "cuda" and not (u.is_cuda and _mamba_ssm() is not None):
        raise RuntimeError("the cuda backend needs a CUDA input and mamba-ssm (pip install -e '.[cuda]')")
    return backend


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_last_state=False, *, backend: str = "auto", chunk_size=None):
    """Mamba's selective scan in (batch, length, channels) layout, as mamba-ssm's `selective_scan_fn`.

    u, delta, z: [b, l, d]; A: [d, n]; B, C: [b, l, n]; D, delta_bias: [d]; initial_state: [b, d, n].
    Returns y [b, l, d] in u's dtype (and the last state [b, d, n] with return_last_state), computed in
    float32 (float64 for float64 inputs). chunk_size: tokens per chunk of the torch backend (default
    scan.default_chunk). cuda takes no initial state: with one, auto runs torch."""
    backend = backend_for(u, A.shape[1], backend)
    if backend == "cuda" and initial_state is not None:
        backend = "torch"
    args = (u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    if backend == "ref":
        return selective_scan_ref(*args, initial_state=initial_state, return_last_state=return_last_state)
    if backend == "torch":
        return chunked_scan(*args, initial_state, return_last_state, chunk_size)
    if backend == "cuda":  # mamba-ssm's layout: (batch, channels, length)
        t = lambda x: None if x is None else x.transpose(1, 2)
        out = _mamba_ssm()[0](t(u), t(delta), A, t(B), t(C), D, t(z), delta_bias, delta_softplus,
                              return_last_state)
        return (t(out[0]), out[1]) if return_last_state else t(out)
    dtype = torch.promote_types(u.dtype, torch.float32)
    cast = lambda x: None if x is None else x.to(dtype)
    inputs = map(cast, (u, delta, A, B, C, D, z, delta_bias, initial_state))
    y, h_last = scan_cpu.KernelScan.apply(*inputs, delta_softplus)
    y = y.to(u.dtype)
    return (y, h_last) if return_last_state else y
