"""The compute ops of the models, each backend beside its reference (docs/architecture.md, "The ops"):

    ttt.linear, ttt.mlp, ttt.step, ttt.linear_prefill    TTT's inner loop (kernels/ttt/ops.py)
    mamba.selective_scan, mamba.mamba_inner             Mamba's scan (kernels/mamba/ops.py)
    conv.causal_conv1d                                  the short causal convs (kernels/conv.py)

each with a `backend` argument: PyTorch references and forms (kernels/ttt/, kernels/mamba/), the C++ CPU
scan, mamba-ssm, causal-conv1d, and the Triton kernels in this folder: TTT-Linear's dual form (ttt_linear.py,
forward and backward), prefill (ttt_linear_prefill.py, forward only, token-major 16-bit inputs) and decode
(ttt_decode.py), TTT-MLP's dual form (ttt_mlp.py, forward and backward) and decode (ttt_mlp_decode.py).
A leaf: torch and Triton only, nothing of ttt_bench. Whether a Triton kernel passed its check on this GPU,
and so whether a layer asks for it, is ttt_bench/models/ttt/kernel_check.py's.

Triton is optional: without it `HAS_TRITON` is False and the kernels below are None. `dual_why_not` /
`decode_why_not` / `prefill_why_not` / `mlp_why_not` / `mlp_decode_why_not` say why inputs are outside a
kernel's domain, the one compiled ahead of time in tests/test_kernels_aot.py (head sizes 16-128, 16-64 for
TTT-MLP; mini-batch 16; LN-and-residual and biases): "" inside it, "Triton is not installed" without it.
"""

try:
    from .ttt_decode import why_not as decode_why_not
    from .ttt_linear import ttt_linear_dual
    from .ttt_linear import why_not as dual_why_not
    from .ttt_linear_prefill import default_precision as prefill_precision
    from .ttt_linear_prefill import why_not as prefill_why_not
    from .ttt_mlp import ttt_mlp_dual
    from .ttt_mlp import why_not as mlp_why_not
    from .ttt_mlp_decode import why_not as mlp_decode_why_not

    HAS_TRITON = True
except ImportError:  # triton not installed
    HAS_TRITON = False
    ttt_linear_dual = prefill_precision = ttt_mlp_dual = None
    dual_why_not = decode_why_not = prefill_why_not = mlp_why_not = mlp_decode_why_not = (
        lambda *args: "Triton is not installed")

__all__ = ["HAS_TRITON", "ttt_linear_dual", "ttt_mlp_dual", "prefill_precision", "dual_why_not",
           "prefill_why_not", "decode_why_not", "mlp_why_not", "mlp_decode_why_not"]
