"""Mamba (Gu & Dao, 2023) blocks: x + Mamba(RMSNorm(x)), as mamba-ssm's MambaLMHeadModel.

`Mamba` has the parameter names and shapes of `mamba_ssm.modules.mamba_simple.Mamba` (in_proj,
conv1d, x_proj, dt_proj, A_log, D, out_proj), so a state dict loads into either. Three backends
compute the same function:

  torch: pure PyTorch, the chunked selective scan (kernels/mamba, backend torch; any device);
  cpu:   the selective scan as the C++ kernel (kernels/mamba, backend cpu: CPU inputs; built at first
         use), the rest of the layer as in `torch`;
  cuda:  mamba-ssm's fused kernels (mamba_inner_fn, causal_conv1d) for CUDA inputs.

`backend="auto"` uses mamba-ssm's kernels when the input is on CUDA and mamba-ssm imports, the CPU
kernel when the input is on the CPU and the kernel builds, else PyTorch. Decoding with a cache takes the cpu
or torch path, which handle an initial state; one token at a time, `selective_state_update` (mamba-ssm's
Triton kernel on a GPU with cuda or auto, PyTorch otherwise), the state updated in place.
"""

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ttt_bench.errors import UserError

from ...kernels import mamba as ops
from ...kernels.mamba import scan_cpu
from ..cost import arguments
from ..graphs import StaticCache
from ..layers import CausalConv1d, RMSNorm

log = logging.getLogger(__name__)
BACKENDS = ("auto", "torch", "cpu", "cuda")
_logged_backends: set[str] = set()
SCAN_FLOPS_PER_STATE = 9  # mamba-ssm: 9 * batch * length * d_inner * d_state for the selective scan


def _log_backend(name: str) -> None:
    if name not in _logged_backends:
        _logged_backends.add(name)
        log.info("Mamba backend: %s", name)


class _NarrowLinear(torch.autograd.Function):
    """F.linear(x, w) for a weight with few input features (dt_proj: dt_rank = d_model / 16 of them).
    Autograd computes both gradients as matmuls with an output of dt_rank columns (g^T x and g w), which MKL
    runs several times slower than their transposes (x^T g)^T and (w^T g^T)^T (docs/mamba.md). CPU only."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        x, w = x.to(g.dtype), w.to(g.dtype)  # under autocast the forward's linear ran in g's dtype (bf16)
        g2 = g.reshape(-1, g.shape[-1])
        gx = (w.t() @ g2.t()).t().reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = (x.reshape(-1, x.shape[-1]).t() @ g2).t() if ctx.needs_input_grad[1] else None
        return gx, gw


@dataclass
class MambaCache(StaticCache):  # one graph: a step's path depends on no Python state
    conv: torch.Tensor  # [B, d_conv - 1, d_inner]: the last inputs of the causal convolution
    ssm: torch.Tensor  # [B, d_inner, d_state]


class Mamba(nn.Module):
    """Mamba mixer (selective SSM), the layer of mamba-ssm's `Mamba` with the same hyperparameters."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, dt_rank="auto",
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dt_scale: float = 1.0, conv_bias: bool = True, bias: bool = False, backend: str = "auto",
                 chunk_size: int | None = None):
        super().__init__()
        if backend not in BACKENDS:
            raise UserError(f"model.block.backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        if backend == "cuda" and not (torch.cuda.is_available() and ops.mamba_inner() is not None):
            raise UserError("model.block.backend=cuda needs a CUDA GPU and mamba-ssm: install a CUDA build "
                            "of torch, then `pip install -e '.[cuda]'` (or use backend=auto|torch)")
        if backend == "cpu" and not scan_cpu.available():
            raise UserError("model.block.backend=cpu needs the Mamba CPU kernel, which did not build here "
                            "(it needs a C++ compiler, g++ or c++, on PATH; see docs/mamba.md); "
                            "or use backend=auto|torch")
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = expand * d_model
        self.dt_rank = self._rank(d_model, dt_rank)
        self.dt_min, self.dt_max, self.dt_init_floor, self.dt_scale = dt_min, dt_max, dt_init_floor, dt_scale
        self.backend, self.chunk_size = backend, chunk_size

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias)
        self.conv1d = CausalConv1d(self.d_inner, d_conv, bias=conv_bias)  # nn.Conv1d's parameters
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        for p in (self.A_log, self.D):  # as mamba-ssm; the optimizer may honour it
            p._no_weight_decay = True
        self.init_special_parameters()

    @staticmethod
    def _rank(d_model: int, dt_rank) -> int:
        return math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank

    @staticmethod
    def flops_per_token(seq_len: int, d_model: int, d_state: int, d_conv: int, expand: int, dt_rank,
                        **_) -> dict:
        """in_proj [d, 2E], the depthwise conv, x_proj [E, R + 2N], dt_proj [R, E], out_proj [E, d]
        (E = d_inner, N = d_state, R = dt_rank); the selective scan, elementwise, as mamba-ssm counts it."""
        E, N, R, k = expand * d_model, d_state, Mamba._rank(d_model, dt_rank), d_conv
        dense = 2.0 * d_model * 2 * E + 2.0 * E * k + 2.0 * E * (R + 2 * N) + 2.0 * R * E + 2.0 * E * d_model
        return {"dense": dense, "scan": SCAN_FLOPS_PER_STATE * E * N}

    @staticmethod
    def state_floats(seq_len: int, d_model: int, d_state: int, d_conv: int, expand: int, **_) -> dict:
        """The SSM state, d_inner x d_state, and the conv state, d_inner x (d_conv - 1)."""
        d_inner = expand * d_model
        return {"ssm": d_inner * d_state, "conv": d_inner * (d_conv - 1)}

    @torch.no_grad()
    def init_special_parameters(self) -> None:
        """mamba-ssm's init: PyTorch defaults for in_proj/x_proj/conv1d, softplus(dt bias) log-uniform in
        [dt_min, dt_max], S4D-real A = -(1..d_state), D = 1. out_proj keeps the LM's scaled init."""
        for m in (self.in_proj, self.x_proj, self.conv1d):
            m.reset_parameters()
        if self.in_proj.bias is not None:
            nn.init.zeros_(self.in_proj.bias)
        std = self.dt_rank**-0.5 * self.dt_scale
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        u = torch.rand(self.d_inner, device=self.D.device)
        dt = torch.exp(u * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
        dt = dt.clamp(min=self.dt_init_floor)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=self.D.device)
        self.A_log.copy_(torch.log(A))
        self.D.fill_(1.0)

    def forward(self, x: torch.Tensor, cache: MambaCache | None = None) -> torch.Tensor:
        if cache is None and self.backend != "torch" and x.is_cuda and ops.mamba_inner() is not None:
            _log_backend("cuda (mamba-ssm kernels)")
            return self._forward_cuda(x)
        if self.backend == "cuda" and not x.is_cuda:
            raise UserError("model.block.backend=cuda but the input is not on a CUDA device: "
                            "use backend=auto|torch")
        if self.backend == "cpu" and x.is_cuda:
            raise UserError("model.block.backend=cpu but the input is on a CUDA device: "
                            "use backend=auto|cuda")
        if cache is not None and x.shape[1] == 1:
            return self._step(x, cache)
        kernel = self.backend == "cpu" or (self.backend == "auto" and scan_cpu.supports(x, self.d_state)
                                            and scan_cpu.available())
        no_cuda_kernels = self.backend == "auto" and x.is_cuda and ops.mamba_inner() is None
        why = ": mamba-ssm / causal-conv1d do not import here" if no_cuda_kernels else ""
        _log_backend("cpu (C++ selective scan kernel)" if kernel else f"torch (chunked selective scan{why})")
        return self._forward_torch(x, cache, kernel)

    def _forward_torch(self, x: torch.Tensor, cache: MambaCache | None, kernel: bool = False) -> torch.Tensor:
        """The layer in PyTorch ops around `selective_scan`, with the C++ scan kernel or the chunked scan."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        if (kernel and cache is None and self.d_conv <= scan_cpu.MAX_CONV
                and xs.dtype in (torch.float32, torch.float64)):
            xs = scan_cpu.conv_silu(xs, self.conv1d.weight, self.conv1d.bias)  # the conv and silu in one pass
        else:
            xs, conv_state = self.conv1d(xs, None if cache is None else cache.conv)
            if cache is not None:
                cache.conv = conv_state
            xs = F.silu(xs)
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        w = self.dt_proj.weight
        delta = F.linear(dt, w) if dt.is_cuda else _NarrowLinear.apply(dt, w)
        y = ops.selective_scan(xs, delta, -torch.exp(self.A_log.float()), B, C,
                               self.D.float(), z, delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                               initial_state=None if cache is None else cache.ssm,
                               return_last_state=cache is not None, chunk_size=self.chunk_size,
                               backend="cpu" if kernel else "torch")
        if cache is not None:
            y, ssm = y
            cache.ssm = ssm.to(cache.ssm.dtype, copy=True)  # its own memory: decoding updates it in place
        return self.out_proj(y)

    def _step(self, x: torch.Tensor, cache: MambaCache) -> torch.Tensor:
        """One token [B, 1, D] of decoding, the SSM state updated in place (`selective_state_update`:
        mamba-ssm's Triton kernel on a GPU where it imports, as mamba-ssm's Mamba.step)."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs, cache.conv = self.conv1d(xs, cache.conv)
        xs = F.silu(xs[:, 0])
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        y = ops.selective_state_update(cache.ssm, xs, F.linear(dt, self.dt_proj.weight),
                                       -torch.exp(self.A_log.float()), B, C, self.D.float(), z[:, 0],
                                       dt_bias=self.dt_proj.bias.float(), dt_softplus=True,
                                       backend={"cuda": "cuda", "auto": "auto"}.get(self.backend, "ref"))
        return self.out_proj(y[:, None])

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        xz = self.in_proj(x).transpose(1, 2)  # mamba-ssm's layout: [B, 2 d_inner, T]
        return ops.mamba_inner()(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight,
                              self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias,
                              -torch.exp(self.A_log.float()), None, None, self.D.float(),
                              delta_bias=self.dt_proj.bias.float(), delta_softplus=True)

    def init_cache(self, batch_size: int, device=None, dtype=None) -> MambaCache:
        zeros = lambda *shape: torch.zeros(batch_size, *shape, device=device, dtype=dtype)
        return MambaCache(conv=zeros(self.d_conv - 1, self.d_inner), ssm=zeros(self.d_inner, self.d_state))


class MambaBlock(nn.Module):
    """x + Mamba(RMSNorm(x)): mamba-ssm's `Block` with `mixer` and `norm`, no MLP."""

    def __init__(self, layer_idx: int, d_model: int, norm_eps: float = 1e-6, **mixer_kwargs):
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = RMSNorm(d_model, norm_eps)
        self.mixer = Mamba(d_model, **mixer_kwargs)

    def forward(self, x: torch.Tensor, cache: MambaCache | None = None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), cache)

    def init_special_parameters(self) -> None:
        self.mixer.init_special_parameters()

    def init_cache(self, batch_size: int, device=None, dtype=None, max_len=None) -> MambaCache:
        return self.mixer.init_cache(batch_size, device, dtype)

    @staticmethod
    def flops_per_token(seq_len: int, d_model: int, mixer_kwargs: dict, **_) -> dict:
        """The mixer's (the norm costs nothing)."""
        return Mamba.flops_per_token(seq_len, **arguments(Mamba, {"d_model": d_model, **mixer_kwargs}))

    @staticmethod
    def state_floats(seq_len: int, d_model: int, mixer_kwargs: dict, **_) -> dict:
        """The mixer's."""
        return Mamba.state_floats(seq_len, **arguments(Mamba, {"d_model": d_model, **mixer_kwargs}))
