"""Triton's CPU interpreter (TRITON_INTERPRET=1), made to multiply bfloat16 as a GPU does.

The interpreter keeps bfloat16 as uint16 and its tl.dot (InterpreterBuilder.create_dot) multiplies that
storage as integers. `bf16_dot` wraps create_dot to widen bf16 operands to float32 first, exactly, as the
tensor cores multiply bf16 exactly and accumulate in float32; every `.to(bfloat16)` is already rounded as on
the GPU, so a bf16 kernel's numerics are emulated. Installed by the prefill benchmark's --dry, the kernel
check on CPU (models/ttt/kernel_check.py) and tests/test_kernel_prefill.py.
"""


def bf16_dot(create_dot):
    """create_dot with bfloat16 operands widened to float32."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def widen(x):
        if x.get_element_ty() == tl.bfloat16 and x.data.dtype == np.uint16:
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    dot.widens_bf16 = True
    return dot


def emulate_bf16_dot() -> None:
    """Install `bf16_dot` in the interpreter, once per process."""
    from triton.runtime.interpreter import InterpreterBuilder

    if not getattr(InterpreterBuilder.create_dot, "widens_bf16", False):
        InterpreterBuilder.create_dot = bf16_dot(InterpreterBuilder.create_dot)
