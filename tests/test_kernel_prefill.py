"""The TTT-Linear prefill kernel (kernels/ttt_linear_prefill.py) against the PyTorch dual form in float64.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which
rounds every `.to(bfloat16)` as the GPU does: the bf16 matmul operands are emulated (its tl.dot multiplies
bf16 operands as their uint16 storage: kernels/interpreter.py widens them first), tf32 is not (it runs as
exact float32 there), so float32 inputs are checked with exact float32 operands ("ieee"). On CUDA the same
tests run natively. Whether the kernel compiles for a GPU, its registers and spills, is
tests/test_kernels_aot.py's; its speed is scripts/gpu_speed.sh's.
"""

import csv
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from ttt_bench.kernels import (
    speed,  # noqa: E402
    ttt,  # noqa: E402
)
from ttt_bench.kernels import ttt_linear_prefill as prefill_module  # noqa: E402
from ttt_bench.kernels.interpreter import bf16_dot  # noqa: E402
from ttt_bench.kernels.ttt import dual_scan, forms  # noqa: E402
from ttt_bench.kernels.ttt_linear_prefill import (  # noqa: E402
    default_precision,
    launch_options,
    prefill_reference,
    ttt_linear_prefill,
    why_not,
)

from tests.conftest import rel_err  # noqa: E402
from ttt_bench.models.ttt.layer import TTTCache, TTTLayer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpreter_bf16_dot(monkeypatch):
    """Under Triton's interpreter, tl.dot with bf16 operands multiplies their uint16 storage: widen them to
    float32 first (exact; kernels/interpreter.py)."""
    if DEVICE == "cpu":
        builder = pytest.importorskip("triton.runtime.interpreter").InterpreterBuilder
        monkeypatch.setattr(builder, "create_dot", bf16_dot(builder.create_dot))


B, H, b = 2, 2, 16
# largest error over the reference's largest entry. float32 inputs, exact float32 matmuls: rounding only.
# bfloat16 inputs: the matmul operands (W, the gradient, eta * (XQ XK^T + 1)) rounded to 8 bits and the
# output written in bfloat16 (2^-9 relative): a few 1e-3 (METHOD.md: bf16 operands 1e-3 to 1e-2)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def prefill_inputs(T, f, dtype=torch.float32, seed=0):
    """Random inputs as the layer has them, every weight off its init: XQ, XK, XV [B, T, H, f] in `dtype`;
    lr [B, H, T] (a transposed view, as TTTLayer.inner_lr's) in [0, 0.3); W [H, f, f], bias [H, 1, f],
    LN weight and bias [H, 1, f] in float32; token scaling te [b] = 1/i plus a learned offset."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: shift + scale * torch.randn(*s, generator=g)
    XQ, XK, XV = (r(B, T, H, f).to(dtype).to(DEVICE) for _ in range(3))
    lr = (0.3 * torch.rand(B, T, H, generator=g)).to(DEVICE).transpose(1, 2)
    te = (1.0 / torch.arange(1, b + 1) + 0.1 * torch.rand(b, generator=g)).to(DEVICE)
    weights = [r(H, f, f, scale=0.3), r(H, 1, f, scale=0.3), r(H, 1, f, scale=0.2, shift=1.0),
               r(H, 1, f, scale=0.2)]
    return XQ, XK, XV, lr, *(w.to(DEVICE) for w in weights), te


def reference(XQ, XK, XV, lr, W, bias, ln_w, ln_b, te):
    """The layer's function in float64: dual_scan.ttt_linear_dual over the complete mini-batches and
    forms.dual_step on a last short one (TTTLayer._ttt without a cache), eta = ttt.eta(te, lr).
    Returns Z [B, T, H, f] and the weights after the last complete mini-batch."""
    d = lambda x: x.double()
    T, f = XQ.shape[1], XQ.shape[-1]
    N = T // b
    xq, xk, xv = (d(x).transpose(1, 2) for x in (XQ, XK, XV))  # [B, H, T, f]
    split = lambda v: v[:, :, : N * b].reshape(B, H, N, b, -1)
    eta = ttt.eta(d(te), split(d(lr)[..., None]).squeeze(-1))
    Z, W_last, b_last = dual_scan.ttt_linear_dual(split(xq), split(xk), split(xv), eta,
                                                  d(W).expand(B, H, f, f), d(bias).expand(B, H, 1, f),
                                                  d(ln_w), d(ln_b))
    outs = [Z.reshape(B, H, N * b, f)]
    if T > N * b:
        rest = lambda v: v[:, :, N * b :]
        z, _ = forms.dual_step((W_last, b_last), rest(xq), rest(xk), rest(xv),
                               ttt.eta(d(te)[: T - N * b], rest(d(lr))), (d(ln_w), d(ln_b)))
        outs.append(z)
    return torch.cat(outs, 2).transpose(1, 2), W_last, b_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [16, 48])
@pytest.mark.parametrize("f", [16, 32, 64])
def test_prefill_matches_the_dual_form_in_float64(f, T, dtype):
    """Outputs (every element written: the output starts as NaN) and the final weights, on fresh random
    inputs per case; bf16 inputs give a bf16 output in their layout, the weights stay float32."""
    XQ, XK, XV, lr, W, bias, ln_w, ln_b, te = inputs = prefill_inputs(T, f, dtype, seed=f + T)
    precision = "ieee" if dtype == torch.float32 else default_precision(dtype)
    out = torch.full_like(XQ, float("nan"))
    Z, W_last, b_last = ttt_linear_prefill(XQ, XK, XV, lr, W, bias, ln_w, ln_b, te, precision=precision,
                                           out=out)
    assert Z is out and Z.dtype == dtype and Z.shape == (B, T, H, f) and not Z.isnan().any()
    assert W_last.dtype == b_last.dtype == torch.float32
    ref = reference(*inputs)
    errors = {name: rel_err(a.double(), r) for name, a, r in zip(("Z", "W", "b"), (Z, W_last, b_last), ref,
                                                                  strict=True)}
    assert max(errors.values()) < TOL[dtype], errors
    if dtype == torch.bfloat16:  # the operands were rounded to bf16 (float32 operands: ~1e-7)
        assert errors["W"] > 1e-5, errors


def test_prefill_in_float16():
    """float16 inputs: fp16 operands (10-bit mantissas: closer than bf16's 7), a float16 output."""
    inputs = prefill_inputs(48, 32, torch.float16, seed=5)
    Z, W_last, b_last = ttt_linear_prefill(*inputs)
    assert Z.dtype == torch.float16
    errors = [rel_err(a.double(), r) for a, r in zip((Z, W_last, b_last), reference(*inputs), strict=True)]
    assert max(errors) < 5e-3, errors


def test_prefill_reads_strided_views_and_a_short_last_mini_batch():
    """Views into one fused [B, T, 3, H, f] projection, lr a transposed view, W shared over the batch: the
    same outputs bit for bit as contiguous copies, and T = 40 (two mini-batches and 8 tokens) matches the
    float64 reference with the weights of the last complete mini-batch; without final_state only Z."""
    T, f = 40, 16
    XQ, XK, XV, lr, W, bias, ln_w, ln_b, te = inputs = prefill_inputs(T, f, seed=11)
    fused = torch.stack([XQ, XK, XV], 2)  # [B, T, 3, H, f]
    views = (fused[:, :, 0], fused[:, :, 1], fused[:, :, 2])
    assert not views[0].is_contiguous() and not lr.is_contiguous()
    kw = dict(precision="ieee")
    Z, W_last, b_last = ttt_linear_prefill(*views, lr, W, bias, ln_w, ln_b, te, **kw)
    Zc, Wc, bc = ttt_linear_prefill(*(x.contiguous() for x in (XQ, XK, XV)), lr.contiguous(),
                                    W.expand(B, H, f, f).contiguous(), bias.expand(B, H, 1, f).contiguous(),
                                    ln_w.reshape(H, f), ln_b.reshape(H, f), te, **kw)
    assert torch.equal(Z, Zc) and torch.equal(W_last, Wc) and torch.equal(b_last, bc)
    Z_ref, W_ref, b_ref = reference(*inputs)
    errors = [rel_err(a.double(), r) for a, r in ((Z, Z_ref), (W_last, W_ref), (b_last, b_ref))]
    assert max(errors) < 1e-5, errors
    Z_only, none_W, none_b = ttt_linear_prefill(*views, lr, W, bias, ln_w, ln_b, te, final_state=False, **kw)
    assert none_W is None and none_b is None and torch.equal(Z_only, Z)


def test_prefill_is_the_layers_inner_loop():
    """TTTLayer._ttt (no cache, PyTorch path, float64) of the last row of Table 1 (LN-and-residual, b = 16,
    learnable eta and token scaling, with a learned offset): the kernel on the same xq, xk, xv and lr
    (token-major) with the layer's W1, b1, LN and token_eta(0, b) gives its output."""
    T, f = 40, 32
    layer = TTTLayer(H * f, H, learner="linear", mini_batch_size=b, form="dual", ln_residual=True,
                     token_scaling="learnable", kernel="torch").double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (layer.W1, layer.b1, layer.ttt_norm_weight, layer.ttt_norm_bias, layer.token_idx_offset):
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        xq, xk, xv = (torch.randn(B, H, T, f, generator=g, dtype=torch.float64) for _ in range(3))
        lr = 0.3 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
        z_ref = layer._ttt(xq, xk, xv, lr, None)  # [B, H, T, f]
    to = lambda x: x.float().to(DEVICE)
    ln_w, ln_b = layer.ln()
    Z, _, _ = ttt_linear_prefill(*(to(x.transpose(1, 2)) for x in (xq, xk, xv)), to(lr), to(layer.W1),
                                 to(layer.b1), to(ln_w), to(ln_b), to(layer.token_eta(0, b)),
                                 precision="ieee")
    assert rel_err(Z.double().cpu(), z_ref.transpose(1, 2)) < 1e-5


@pytest.mark.parametrize("T", [32, 40])
def test_the_torch_reference_is_the_dual_form(T):
    """prefill_reference (torch only: the GPU check of kernels/speed.py uses it where ttt_bench's
    models are not installed) computes what dual_scan and forms do, to float64 rounding."""
    inputs = prefill_inputs(T, 16, seed=T)
    for a, r in zip(prefill_reference(*inputs), reference(*inputs), strict=True):
        assert rel_err(a, r) < 1e-12


def test_prefill_domain_and_launch_options():
    lnw = torch.ones(1, 1, 16)
    x = torch.zeros(1, 16, 1, 16)
    assert why_not(x, lnw, lnw) == why_not(x.bfloat16(), lnw, lnw) == ""
    assert "dtype" in why_not(x.double(), lnw, lnw)
    assert "head size 96" in why_not(torch.zeros(1, 16, 1, 96), lnw, lnw)
    assert "mini-batch size 32" in why_not(x, lnw, lnw, mini_batch=32)
    assert "bias" in why_not(x, None, lnw) and "LayerNorm" in why_not(x, lnw, None)
    with pytest.raises(ValueError, match="head size"):
        ttt_linear_prefill(*(torch.zeros(1, 16, 1, 12),) * 3, torch.zeros(1, 1, 16), torch.zeros(1, 12, 12),
                           torch.zeros(1, 1, 12), torch.ones(1, 1, 12), torch.zeros(1, 1, 12))
    assert default_precision(torch.bfloat16) == "bf16" and default_precision(torch.float32) == "tf32"
    for f in (16, 32, 64, 128):
        for precision in ("bf16", "tf32"):
            assert set(launch_options(f, precision)) == {"num_warps", "num_stages"}


def test_gpu_speed_script_runs(tmp_path):
    """kernels/speed.py (scripts/gpu_speed.sh's) on tiny shapes: its check passes, every prefill variant and
    every launch of the training kernel is timed and written, each launch's outputs and gradients equal to
    the default's (on CPU in the interpreter: the timings mean nothing there)."""
    assert speed.main(["--dry", "--out", str(tmp_path), "--warmup", "0", "--repeats", "1"]) == 0
    read = lambda name: list(csv.DictReader((tmp_path / name).open()))
    check, prefill, train = read("prefill_check.csv"), read("prefill_speed.csv"), read("train_speed.csv")
    assert check and all(r["ok"] == "True" for r in check)
    variants = [r["variant"] for r in prefill]
    assert variants.count("old_kernel") == variants.count("old_path") == 2 and variants.count("new") == 6
    assert all(float(r["ms_median"]) > 0 for r in prefill + train)
    launches = {(int(r["fwd_warps"]), int(r["bwd_warps"])) for r in train if r["variant"] == "triton"}
    assert launches >= set(speed.TRAIN_LAUNCHES[16]) and all(r["ok"] == "True" for r in train)
    assert [r["variant"] for r in train].count("pytorch_dual") == 1
    card = read("card.csv")[0]  # the card's rates, and every row's time against the op's floor on it
    assert all(float(card[k]) > 0 for k in ("bf16_tflops", "tf32_tflops", "copy_gb_s"))
    assert all(float(r["floor_ms"]) > 0 and float(r["of_floor"]) > 0 for r in prefill + train)


def test_op_floor_is_the_larger_of_compute_and_traffic():
    """The prefill op at 1.3b's heads (32 of 64), batch 16, 8k tokens, bf16, on a card of 1000 TFLOP/s and
    1000 GB/s: (6 b f^2 + 6 b^2 f) FLOPs a mini-batch and head, 44.7 GFLOP, 0.045 ms; q, k, v, Z in bf16, lr
    and the weights in float32, 139.6 MB, 0.14 ms: memory-bound. A training step: 3x the FLOPs, its
    traffic with the gradients and the stored states."""
    rates = {"bf16_tflops": 1000.0, "tf32_tflops": 500.0, "copy_gb_s": 1000.0}
    f, b, T, B, H = 64, 16, 8192, 16, 32
    flops = B * H * (T // b) * (6 * b * f * f + 6 * b * b * f)
    traffic = B * H * (4 * T * f * 2 + 4 * T + 2 * 4 * (f * f + f))
    floor = speed.op_floor(rates, B, T, H, f, 2, "bf16")
    assert floor == {"op_gflop": round(flops / 1e9, 3), "op_mb": round(traffic / 1e6, 1),
                     "floor_ms": float(f"{traffic / 1e9:.4g}"), "bound": "memory"}
    train = speed.op_floor(rates, B, T, H, f, 2, "tf32", training=True)
    assert train["op_gflop"] == round(3 * flops / 1e9, 3) and train["op_mb"] > 2 * floor["op_mb"]


def test_the_layer_prefills_in_the_kernel_when_no_gradient_is_recorded(monkeypatch):
    """TTTLayer (kernel=triton) runs its forward in the prefill kernel under no_grad, on the projections'
    token-major output: the same output as the PyTorch path (kernel=torch); with a cache, the complete
    mini-batches there and a short last one in PyTorch with its gradient sums, so that decoding goes on as
    after the PyTorch prefill. With gradients recorded (training) the kernel is not taken."""
    monkeypatch.setenv("TTT_BENCH_KERNEL_PRECISION", "ieee")  # float32 inputs: exact float32 matmuls
    calls = []
    real = prefill_module.ttt_linear_prefill  # what the op `ttt.linear_prefill` calls
    monkeypatch.setattr(prefill_module, "ttt_linear_prefill",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    f, T = 16, 40
    make = lambda kernel: TTTLayer(H * f, H, learner="linear", mini_batch_size=b, form="dual",
                                   ln_residual=True, token_scaling="learnable", kernel=kernel)
    torch.manual_seed(0)
    ours, ref = make("triton"), make("torch")
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(B, T, H * f)
    with torch.no_grad():
        assert rel_err(ours(x), ref(x)) < 1e-5 and calls == [(B, T, H, f)]  # a short last mini-batch too
        caches = [TTTCache(), TTTCache()]
        outs = [layer(x, cache) for layer, cache in zip((ours, ref), caches, strict=True)]
        assert calls[-1] == (B, 32, H, f) and rel_err(outs[0], outs[1]) < 1e-5
        for t in range(3):  # decoding goes on from the caches: the 8 tokens' gradient sums carried
            step = torch.randn(B, 1, H * f)
            outs = [layer(step, cache) for layer, cache in zip((ours, ref), caches, strict=True)]
            assert rel_err(outs[0], outs[1]) < 1e-5, t
    calls.clear()
    ours(x).sum().backward()  # training: the dual-form kernel, with its backward
    assert calls == [] and ours.W1.grad is not None
