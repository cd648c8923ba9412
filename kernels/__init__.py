"""Triton kernels for TTT-Linear (docs/speed.md): the dual-form chunk kernel (forward and backward) and the
single-token decode kernel, each behind a torch.autograd.Function.

Triton is optional: without it `HAS_TRITON` is False, `use_triton` is always False and the callers keep
their PyTorch path. `dual_supported` / `decode_supported` tell whether given inputs are in a kernel's domain
(float32, LN-and-residual, a bias, power-of-2 sizes). `use_triton(x)` is the selection: true for CUDA
tensors once the kernels have matched PyTorch on that GPU (a one-time check, cached; see
ttt_bench/kernel_check.py), unless forced off with backend="torch" or TTT_BENCH_KERNELS=torch.
"""

import os

import torch

try:
    from .ttt_decode import supported as decode_supported
    from .ttt_decode import ttt_linear_decode
    from .ttt_linear import supported as dual_supported
    from .ttt_linear import ttt_linear_dual

    HAS_TRITON = True
except ImportError:  # triton not installed
    HAS_TRITON = False
    ttt_linear_dual = ttt_linear_decode = None
    dual_supported = decode_supported = lambda *args: False

BACKENDS = ("auto", "torch", "triton")


def use_triton(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether to run the Triton kernel on x's device. backend: auto (CUDA only, unless
    TTT_BENCH_KERNELS=torch, and only where the kernels passed their check against PyTorch on this GPU:
    ttt_bench/kernel_check.py), torch (never) or triton (always, unchecked; on CPU only under
    TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if not HAS_TRITON or backend == "torch":
        return False
    if backend == "triton":
        return True
    if not x.is_cuda or os.environ.get("TTT_BENCH_KERNELS", "auto") == "torch":
        return False
    from ttt_bench.kernel_check import triton_verified

    return triton_verified(x.device)


__all__ = ["HAS_TRITON", "use_triton", "ttt_linear_dual", "ttt_linear_decode", "dual_supported",
           "decode_supported"]
