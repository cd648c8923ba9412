"""Triton kernels for TTT-Linear (docs/speed.md): the dual-form chunk kernel (forward and backward, behind a
torch.autograd.Function), the prefill kernel (a whole sequence, forward only, token-major 16-bit inputs) and
the single-token decode kernel (forward only); and TTT-MLP's dual form, fused, forward only (`ttt_mlp_dual`:
the layer's TTT-MLP when no gradient is recorded).

A leaf: torch and Triton only, nothing of ttt_bench. What compares the kernels with the PyTorch layer, selects
them (`use_triton`) or gives the decode kernel a backward (PyTorch recomputation) lives beside the TTT layer:
ttt_bench/models/ttt/kernel_check.py and triton_decode.py.

Triton is optional: without it `HAS_TRITON` is False, the kernels are None and `dual_supported` /
`decode_supported` (whether given inputs are in a kernel's domain: float32, LN-and-residual, a bias, head
sizes 16-128 and mini-batch 16, compiled ahead of time in tests/test_kernels_aot.py) are always False;
`dual_why_not` / `decode_why_not` / `prefill_why_not` / `mlp_why_not` (TTT-MLP: head sizes 16-64, hidden
width 4 f, both biases, LN-and-residual, mini-batch 16) say why inputs are outside it.
"""

try:
    from .ttt_decode import decode_step
    from .ttt_decode import supported as decode_supported
    from .ttt_decode import why_not as decode_why_not
    from .ttt_linear import supported as dual_supported
    from .ttt_linear import ttt_linear_dual
    from .ttt_linear import why_not as dual_why_not
    from .ttt_linear_prefill import default_precision as prefill_precision
    from .ttt_linear_prefill import ttt_linear_prefill as prefill  # the module keeps its name
    from .ttt_linear_prefill import why_not as prefill_why_not
    from .ttt_mlp import ttt_mlp_dual
    from .ttt_mlp import why_not as mlp_why_not

    HAS_TRITON = True
except ImportError:  # triton not installed
    HAS_TRITON = False
    ttt_linear_dual = decode_step = prefill = prefill_precision = ttt_mlp_dual = None
    dual_supported = decode_supported = lambda *args: False
    dual_why_not = decode_why_not = prefill_why_not = mlp_why_not = lambda *args: "Triton is not installed"

__all__ = ["HAS_TRITON", "ttt_linear_dual", "prefill", "decode_step", "dual_supported",
           "decode_supported", "dual_why_not", "prefill_why_not", "decode_why_not", "prefill_precision",
           "ttt_mlp_dual", "mlp_why_not"]
