"""TTTLayer's TTT-MLP in the Triton kernels (kernels/ttt_mlp.py, forward and backward;
kernels/ttt_mlp_decode.py for decoding): the same outputs as the PyTorch path (kernel=torch), with and
without a cache, decoding after it unchanged, and in training the same gradients of every parameter.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported; exact
float32 matmuls, TTT_BENCH_KERNEL_PRECISION=ieee). Tiny shapes: head size 16, 2 heads, mini-batches of 16.
The kernel itself against the float64 dual form is tests/test_kernel_ttt_mlp.py's.
"""

import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from ttt_bench.kernels.ttt import dual_scan  # noqa: E402

from tests.conftest import rel_err  # noqa: E402
from ttt_bench import kernels  # noqa: E402
from ttt_bench.models.ttt import kernel_check  # noqa: E402
from ttt_bench.models.ttt.layer import TTTCache, TTTLayer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, f, b = 2, 2, 16, 16
TOL = 1e-5  # float32 both ways, exact float32 matmuls in the kernel: rounding only
# sigmoid(v) = 1 / (1 + exp(-v)) in the interpreter's numpy overflows to the right limit for very negative v
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture
def calls(monkeypatch):
    """The kernel's calls as the layer makes them (kernels.ttt_mlp_dual): (XQ's shape, precision) each; and
    exact float32 matmuls (TTT_BENCH_KERNEL_PRECISION=ieee)."""
    monkeypatch.setenv("TTT_BENCH_KERNEL_PRECISION", "ieee")
    made, real = [], kernels.ttt_mlp_dual

    def spy(*args, precision="ieee", **kwargs):
        made.append((tuple(args[0].shape), precision))
        return real(*args, precision=precision, **kwargs)

    monkeypatch.setattr(kernels, "ttt_mlp_dual", spy)
    return made


def layers(**kw):
    """Two identical TTT-MLP layers (LN-and-residual, learnable token scaling, every parameter off its init:
    the init's zero biases and unit LN would hide errors), one with the Triton kernels, one in PyTorch."""
    make = lambda kernel: TTTLayer(H * f, H, learner="mlp", mini_batch_size=b, form="dual", ln_residual=True,
                                   token_scaling="learnable", kernel=kernel, **kw).to(DEVICE)
    torch.manual_seed(0)
    ours, ref = make("triton"), make("torch")
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
        ours.token_idx_offset.copy_(0.1 * torch.rand(b))  # >= 0: not clamped
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def test_the_layer_runs_ttt_mlp_in_the_kernel(calls, monkeypatch, caplog):
    """Under no_grad, 40 tokens: the 2 complete mini-batches in the kernel (one call, ieee), the last 8
    tokens in PyTorch; the same output as the PyTorch layer. The path is logged once per shape."""
    monkeypatch.setattr(kernel_check, "_logged", set())
    ours, ref = layers(eta_base=4.0)  # larger inner steps: the updates weigh in the outputs
    x = torch.randn(B, 40, H * f, device=DEVICE)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=kernel_check.__name__):
        out, expected = ours(x), ref(x)
        ours(x)
    assert calls == [((B, H, 2, b, f), "ieee")] * 2
    assert rel_err(out, expected) < TOL, rel_err(out, expected)
    logged = [r.getMessage() for r in caplog.records if "TTT-MLP" in r.getMessage()]
    assert logged == [f"TTT-MLP at head size {f}, mini-batch {b}: Triton kernel (ieee matmuls)"]
    # the inner loop's updates reach the outputs (beyond TOL), so the comparison sees them
    frozen = layers(eta_base=0.0)[1]
    with torch.no_grad():
        assert rel_err(frozen(x), expected) > 100 * TOL


def test_prefill_then_decoding_from_the_caches(calls):
    """With caches: a prompt of 40 tokens (2 complete mini-batches in the kernel, 8 tokens in PyTorch whose
    gradient sums the cache carries), 3 decoding steps of one token (PyTorch), then a chunk of 21 tokens (the
    5 that finish the mini-batch in PyTorch, the next complete one in the kernel): the same outputs as the
    PyTorch layer at every step, and the same weights W_t' in the caches."""
    ours, ref = layers(eta_base=4.0)
    caches = [TTTCache(), TTTCache()]
    steps = [torch.randn(B, T, H * f) for T in (40, 1, 1, 1, 21)]
    with torch.no_grad():
        for i, x in enumerate(steps):
            outs = [layer(x.to(DEVICE), cache) for layer, cache in zip((ours, ref), caches, strict=True)]
            assert rel_err(outs[0], outs[1]) < TOL, (i, rel_err(outs[0], outs[1]))
            for p, q in zip(*(c.params for c in caches), strict=True):
                assert rel_err(p, q) < TOL, i
    assert calls == [((B, H, 2, b, f), "ieee"), ((B, H, 1, b, f), "ieee")]
    assert caches[0].pos == 64 and caches[0].sums is None


def test_training_runs_the_kernel_with_the_pytorch_gradients(calls, monkeypatch):
    """With gradients recorded the kernel runs forward and backward (issue 49): every parameter's gradient
    equals the PyTorch layer's (its dual form, not run for the kernel layer), and reaches the inner loop."""
    ours, ref = layers(eta_base=4.0)
    dual = []
    real = dual_scan.ttt_mlp_dual
    monkeypatch.setattr(dual_scan, "ttt_mlp_dual", lambda *a, **k: dual.append(1) or real(*a, **k))
    x = torch.randn(B, 40, H * f, device=DEVICE)
    for layer in (ours, ref):
        layer(x).square().sum().backward()
    assert calls == [((B, H, 2, b, f), "ieee")] and dual == [1]  # the reference layer's dual form only
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and rel_err(p.grad, q.grad) < 1e-4, name
    for name in ("W1", "b1", "W2", "b2", "ttt_norm_weight", "lr_weight", "token_idx_offset"):
        assert getattr(ours, name).grad.abs().max() > 0, name


def test_selection():
    """`mlp_kernel` (the one selection `_ttt` follows): TTT-MLP, dual form, with or without gradients, no
    diagnostics, no pending gradient sums, the Triton kernels selected (kernel=triton here) and inputs in
    the kernel's domain (float32, head size 16-64, mini-batch 16)."""
    ours, _ = layers()
    XQ = torch.zeros(B, H, 2, b, f, device=DEVICE)
    params, ln = ours.initial_params(B), ours.ln()
    take = lambda layer=ours, XQ=XQ, params=params, cache=None: layer.mlp_kernel(XQ, params, ln, cache)
    with torch.no_grad():
        assert take() == kernel_check.precision()
        assert take(cache=TTTCache()) and not take(cache=TTTCache(sums=params, pos=3))
        assert not take(XQ=XQ.double())  # a float64 model keeps its float64 PyTorch dual form
        ours.form = "primal"
        assert not take()
        ours.form, ours.diagnostics = "dual", object()
        assert not take()
        ours.diagnostics, ours.kernel = None, "torch"
        assert not take()
        ours.kernel = "triton"
        small = layers(mlp_expansion=2)[0]  # hidden width 2 f: outside the kernel
        assert not take(small, params=small.initial_params(B))
        assert not take(XQ=torch.zeros(B, H, 2, 8, f, device=DEVICE))  # mini-batch 8
    assert take()  # gradients recorded: its backward kernel
    linear = TTTLayer(H * f, H, learner="linear", kernel="triton")  # TTT-Linear: never this kernel
    with torch.no_grad():
        assert not linear.mlp_kernel(XQ, params, ln, None)
