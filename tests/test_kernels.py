"""Triton kernels vs the PyTorch TTT layer: outputs and gradients in float32, and at head size 64 (the paper
sizes') against PyTorch in float64, in both matmul precisions (docs/speed.md). Whether the kernels compile
for a GPU is tests/test_kernels_aot.py's.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported);
on CUDA the same tests run natively.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from ttt_bench.kernels import ttt  # noqa: E402
from ttt_bench.kernels.ttt.decode import decode_reference, ttt_linear_decode  # noqa: E402
from ttt_bench.kernels.ttt_linear import supported, ttt_linear_dual  # noqa: E402

from tests.conftest import rel_err  # noqa: E402
from ttt_bench.models.ttt import kernel_check  # noqa: E402
from ttt_bench.models.ttt.kernel_check import use_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4  # relative to the largest entry: float32 with reductions over a few hundred terms


def dual_inputs(B=2, H=2, N=3, b=16, f=16, seed=0):
    """Random TTT-Linear inputs with every weight off its init: xq, xk, xv [B, H, T, f] as views of
    token-major [B, T, H, f] activations (the layer's layout), lr [B, H, T] in [0, 0.3), token_eta [b] =
    1/i plus an offset, W, b, and the LN weight around 1."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(DEVICE)
    tokens = lambda: r(B, N * b, H, f).transpose(1, 2)
    lr = (0.3 * torch.rand(B, N * b, H, generator=g)).to(DEVICE).transpose(1, 2)
    te = (1.0 / torch.arange(1, b + 1) + 0.1 * torch.rand(b, generator=g)).to(DEVICE)
    return [tokens(), tokens(), tokens(), lr, te, r(B, H, f, f, scale=0.3), r(B, H, 1, f, scale=0.3),
            r(H, 1, f, scale=0.2, shift=1.0), r(H, 1, f, scale=0.2)]


NAMES = ("xq", "xk", "xv", "lr", "token_eta", "W", "b", "ln_weight", "ln_bias")


def dual_reference(xq, xk, xv, lr, token_eta, W, b, ln_weight, ln_bias):
    """The PyTorch dual form (kernels/ttt/dual_scan.py through the op): (Z, W_last, b_last)."""
    Z, (W_last, b_last) = ttt.linear(xq, xk, xv, lr, token_eta, (W, b), (ln_weight, ln_bias), backend="dual")
    return Z, W_last, b_last


def test_dual_forward_matches_pytorch():
    inputs = dual_inputs()
    with torch.no_grad():  # the inference path: no per-mini-batch weights kept
        ours, ref = ttt_linear_dual(*inputs), dual_reference(*inputs)
    for name, a, b in zip(("Z", "W_last", "b_last"), ours, ref, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL, name


@pytest.mark.parametrize("with_state_grads", [True, False])
def test_dual_gradients_match_pytorch(with_state_grads):
    """Gradients to every input, through the N-step recurrence; without state grads the backward gets None
    for W_last and b_last (the training case: only Z is used)."""
    inputs = [t.requires_grad_() for t in dual_inputs(N=4, seed=1)]
    g = torch.Generator().manual_seed(2)
    cot = None
    grads = []
    for fn in (ttt_linear_dual, dual_reference):
        Z, W_last, b_last = fn(*inputs)
        cot = cot or [torch.randn(t.shape, generator=g).to(DEVICE) for t in (Z, W_last, b_last)]
        loss = (Z * cot[0]).sum()
        if with_state_grads:
            loss = loss + (W_last * cot[1]).sum() + (b_last * cot[2]).sum()
        grads.append(torch.autograd.grad(loss, inputs))
    for name, a, b in zip(NAMES, *grads, strict=True):
        assert rel_err(a, b) < TOL, name


def test_dual_larger_head_dim():
    """f=32, b=16: non-square tiles in every matmul."""
    inputs = [t.requires_grad_() for t in dual_inputs(B=1, H=1, N=2, f=32, seed=3)]
    grads = [torch.autograd.grad(fn(*inputs)[0].square().sum(), inputs)
             for fn in (ttt_linear_dual, dual_reference)]
    for name, a, b in zip(NAMES, *grads, strict=True):
        assert rel_err(a, b) < TOL, name


def float64_reference_errors(kernel, reference, inputs, seed=6):
    """Outputs and gradients of every input (under random cotangents) of `kernel` on float32 `inputs`, each
    as its error relative to the largest entry of `reference` run in float64 on the same values."""
    x32 = [t.detach().requires_grad_() for t in inputs]
    x64 = [t.detach().double().requires_grad_() for t in inputs]
    out32, out64 = kernel(*x32), reference(*x64)
    out32, out64 = [o for o in out32 if o is not None], [o for o in out64 if o is not None]
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device) for o in out64]
    g32 = torch.autograd.grad(out32, x32, [c.float() for c in cot], allow_unused=True)
    g64 = torch.autograd.grad(out64, x64, cot, allow_unused=True)
    errors = {f"out{i}": rel_err(a.double(), b) for i, (a, b) in enumerate(zip(out32, out64, strict=True))}
    for name, a, b in zip(NAMES if len(inputs) == len(NAMES) else range(len(inputs)), g32, g64, strict=True):
        if b is not None:
            errors[f"d{name}"] = rel_err(a.double(), b)
    return errors


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_dual_head_size_64_against_float64(precision, monkeypatch):
    """The paper sizes' head size (125m, 350m, 1.3b): outputs and gradients of every input against the
    PyTorch dual form in float64. ieee: float32 rounding only. tf32 (the layer's precision on CUDA): every
    tl.dot input rounded to 10 mantissa bits, natively on a GPU and emulated in the interpreter (which
    otherwise ignores the precision), within the kernel check's TF32_TOLERANCE and well above ieee's error,
    so the precision reaches the matmuls."""
    if precision == "tf32" and DEVICE == "cpu":
        interpreter = pytest.importorskip("triton.runtime.interpreter")
        builder, round_tf32 = interpreter.InterpreterBuilder, getattr(interpreter, "_round_f32_to_tf32", None)
        if round_tf32 is None:
            pytest.skip("this Triton's interpreter has no tf32 rounding to emulate tf32 matmuls with")
        create_dot = builder.create_dot

        def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if str(input_precision).upper().endswith("TF32"):
                a = interpreter.TensorHandle(round_tf32(a.data), a.dtype.scalar)
                b = interpreter.TensorHandle(round_tf32(b.data), b.dtype.scalar)
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        monkeypatch.setattr(builder, "create_dot", tf32_dot)
    inputs = dual_inputs(B=1, H=2, N=2, f=64, seed=7)
    errors = float64_reference_errors(lambda *x: ttt_linear_dual(*x, precision=precision),
                                      dual_reference, inputs)
    assert len(errors) == 3 + len(NAMES)
    worst = max(errors.values())
    if precision == "ieee":
        assert worst < 1e-5, errors
    else:
        assert 1e-4 < worst < kernel_check.TF32_TOLERANCE, errors


def test_dual_reads_16_bit_activations_where_the_layer_has_them():
    """bfloat16 xq, xk, xv as views of token-major [B, T, H, f] projections (the layer under autocast): read
    in place, computed in float32, Z and their gradients written token-major in bfloat16: Z and every
    gradient (Z's upstream gradient is bfloat16 too) within bf16's rounding of the float64 result, the final
    weights (float32, not through Z) as exact as from float32 inputs."""
    inputs = dual_inputs(B=1, H=2, N=2, seed=8)
    inputs[:3] = [x.bfloat16() for x in inputs[:3]]
    assert inputs[0].stride(-1) == 1 and inputs[0].stride(2) == inputs[0].shape[1] * inputs[0].shape[3]
    errors = float64_reference_errors(ttt_linear_dual, dual_reference, inputs)
    Z = ttt_linear_dual(*inputs)[0]
    assert Z.dtype == torch.bfloat16 and Z.transpose(1, 2).is_contiguous()  # token-major, as it came in
    assert max(errors["out1"], errors["out2"]) < 1e-6, errors
    assert max(errors.values()) < 1e-2, errors


def test_dual_takes_q_k_v_and_the_upstream_gradient_in_different_layouts():
    """q, k contiguous token-major (from the Mamba backbone's convs), v a view into a wider fused projection,
    the upstream gradient heads-major: the same outputs and gradients as from one layout."""
    inputs = dual_inputs(B=2, H=2, N=2, seed=9)
    B, H, T, f = inputs[0].shape
    fused = torch.randn(B, T, 3 * H * f + 5, device=DEVICE)
    fused[..., H * f : 2 * H * f] = inputs[2].transpose(1, 2).reshape(B, T, H * f)
    mixed = list(inputs)
    mixed[2] = fused[..., H * f : 2 * H * f].view(B, T, H, f).transpose(1, 2)
    assert mixed[2].stride() != mixed[0].stride() and torch.equal(mixed[2], inputs[2])
    dZ = torch.randn(B, H, T, f, device=DEVICE)  # heads-major, unlike the kernel's token-major Z
    grads = []
    for xs in (inputs, mixed):
        leaves = [x.detach().requires_grad_() for x in xs]
        grads.append(torch.autograd.grad(ttt_linear_dual(*leaves)[0], leaves, dZ))
    for name, a, b in zip(NAMES, *grads, strict=True):
        assert rel_err(a, b) < 1e-6, name


def decode_inputs(B=2, H=3, f=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(DEVICE)
    return [r(B, H, 1, f), r(B, H, 1, f), r(B, H, 1, f), (0.1 * torch.rand(B, H, generator=g)).to(DEVICE),
            torch.tensor(0.3, device=DEVICE), r(B, H, f, f, scale=0.3), r(B, H, 1, f, scale=0.3),
            r(B, H, f, f, scale=0.1), r(B, H, 1, f, scale=0.1), r(H, 1, f, scale=0.2, shift=1.0),
            r(H, 1, f, scale=0.2)]


def test_decode_matches_pytorch_with_gradients():
    inputs = [t.requires_grad_() for t in decode_inputs()]
    z, sw, sb = ttt_linear_decode(*inputs)
    z_ref, (sw_ref, sb_ref) = decode_reference(*inputs)
    for name, a, b in (("z", z, z_ref), ("sums_W", sw, sw_ref), ("sums_b", sb, sb_ref)):
        assert a.shape == b.shape and rel_err(a, b) < TOL, name
    grads = [torch.autograd.grad((o.sin().sum() + s.sum()), inputs) for o, s in ((z, sw), (z_ref, sw_ref))]
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < TOL


def test_decode_writes_the_sums_in_place_without_autograd():
    """Under no_grad the decode kernel writes the new sums over the old (decoding's state stays where it is,
    as CUDA graphs need): the same values as with autograd recording, which leaves its inputs alone."""
    inputs = decode_inputs()
    with torch.no_grad():
        expected = ttt_linear_decode(*[t.clone() for t in inputs])
        sums = inputs[7], inputs[8]
        z, sw, sb = ttt_linear_decode(*inputs)
    assert sw is sums[0] and sb is sums[1]
    for a, b in zip((z, sw, sb), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_decode_head_size_64_against_float64():
    """The decode kernel at the paper sizes' head size: outputs (z and the gradient sums) and gradients of
    every input against its PyTorch step in float64."""
    errors = float64_reference_errors(ttt_linear_decode, decode_reference_flat, decode_inputs(B=1, H=2, f=64))
    assert len(errors) == 3 + 11 and max(errors.values()) < 1e-5, errors


def decode_reference_flat(*inputs):
    z, (sw, sb) = decode_reference(*inputs)
    return z, sw, sb


def test_decode_token_by_token_equals_dual_mini_batch():
    """b decode steps from W_{t'} reproduce the dual form over that mini-batch; W_b = W_{t'} - te[b-1] S."""
    B, H, b, f = 1, 2, 16, 16
    xq, xk, xv, lr, te, W, bias, lnw, lnb = dual_inputs(B, H, 1, b, f, seed=5)
    Z, W_last, b_last = dual_reference(xq, xk, xv, lr, te, W, bias, lnw, lnb)
    sw, sb = torch.zeros_like(W), torch.zeros_like(bias)
    for t in range(b):
        q, k, v, z_ref = (x[:, :, t : t + 1] for x in (xq, xk, xv, Z))
        z, sw, sb = ttt_linear_decode(q, k, v, lr[..., t], te[t], W, bias, sw, sb, lnw, lnb)
        assert rel_err(z, z_ref) < TOL, t
    assert rel_err(W - te[-1] * sw, W_last) < TOL and rel_err(bias - te[-1] * sb, b_last) < TOL


def test_selection_and_domain(monkeypatch):
    x = torch.zeros(1, 1, 1, 16, 16)
    assert use_triton(x, "triton") and not use_triton(x, "torch")
    assert use_triton(x) == x.is_cuda
    assert not use_triton(x.to(DEVICE), "auto") or DEVICE == "cuda"
    monkeypatch.setenv("TTT_BENCH_KERNELS", "torch")
    assert not use_triton(x.to(DEVICE))
    with pytest.raises(ValueError, match="backend"):
        use_triton(x, "cuda")
    lnw, x = torch.ones(1, 1, 16), torch.zeros(1, 1, 32, 16)
    assert supported(x, lnw, lnw, 16) and supported(x.bfloat16(), lnw, lnw, 16)
    assert not supported(x, None, lnw, 16) and not supported(x, lnw, None, 16)  # no bias / no LN: PyTorch
    assert not supported(torch.zeros(1, 1, 32, 12), lnw, lnw, 16) and not supported(x.double(), lnw, lnw, 16)
    assert not supported(x, lnw, lnw, 8) and not supported(x[:, :, :20], lnw, lnw, 16)  # b 8; 20 tokens
