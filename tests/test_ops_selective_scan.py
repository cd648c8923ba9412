"""Every backend of the selective scan op (kernels/mamba/ops.py) equals the sequential reference, outputs and
gradients: the chunked PyTorch scan and the C++ kernel here, mamba-ssm's on a GPU."""

import pytest
import torch
import torch.nn.functional as F
from ttt_bench.kernels.mamba import mamba_inner, scan_cpu, selective_scan, selective_state_update
from ttt_bench.kernels.mamba.scan import default_chunk
from ttt_bench.kernels.mamba.scan_ref import selective_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


pytestmark = pytest.mark.usefixtures("one_thread")
# torch: the chunked PyTorch scan; cpu: the C++ kernel (skipped where no compiler builds it)
NO_KERNEL = pytest.mark.skipif(not scan_cpu.available(), reason="the C++ kernel does not build here")
IMPLS = [pytest.param("torch", id="chunked"), pytest.param("cpu", id="kernel", marks=NO_KERNEL)]


def _inputs(b, l, d, n, seed, delta_scale=0.5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    A = -torch.rand(d, n, generator=g, dtype=dtype) * 4 - 0.1
    x = dict(u=r(b, l, d), delta=r(b, l, d) * delta_scale, A=A, B=r(b, l, n), C=r(b, l, n), D=r(d),
             z=r(b, l, d), delta_bias=r(d) * 0.3, initial_state=r(b, d, n))
    return {k: v.requires_grad_() for k, v in x.items()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(fn, x, seed, **kw):
    y, h = fn(**x, delta_softplus=True, return_last_state=True, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    weight = lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype)
    loss = (y * weight(y)).sum() + (h * weight(h)).sum()
    return y, h, torch.autograd.grad(loss, list(x.values()))


@pytest.mark.parametrize("backend", IMPLS)
@pytest.mark.parametrize("b,l,d,n,chunk", [(2, 37, 5, 3, 8), (1, 5, 4, 2, 16), (3, 64, 6, 4, 16),
                                           (2, 1, 3, 2, None), (2, 50, 4, 16, None), (1, 23, 3, 5, 1),
                                           (2, 40, 19, 16, None)])
def test_fast_scans_match_reference(b, l, d, n, chunk, backend):
    seed = b * 1000 + l
    x = _inputs(b, l, d, n, seed)
    y, h, grads = _run(selective_scan, x, seed, chunk_size=chunk, backend=backend)
    y_ref, h_ref, grads_ref = _run(selective_scan_ref, x, seed)
    assert _rel(y, y_ref) <= 1e-5 and _rel(h, h_ref) <= 1e-5
    for name, g, g_ref in zip(NAMES, grads, grads_ref, strict=True):
        assert _rel(g, g_ref) <= 1e-5, name


@pytest.mark.parametrize("backend", IMPLS)
def test_strong_decay_stays_finite(backend):
    """delta * A sums to ~ -1e4 within a chunk: no overflow, still equal to the reference."""
    x = _inputs(2, 40, 4, 8, seed=0, delta_scale=0.0, dtype=torch.float32)
    with torch.no_grad():
        x["delta_bias"].fill_(50.0)
    y, h, grads = _run(selective_scan, x, 0, chunk_size=16, backend=backend)
    y_ref, h_ref, _ = _run(selective_scan_ref, x, 0)
    assert all(t.isfinite().all() for t in (y, h, *grads))
    assert _rel(y, y_ref) < 1e-5


@pytest.mark.parametrize("backend", IMPLS)
def test_defaults_and_dtype(backend):
    x = {k: v.detach().float() for k, v in _inputs(2, 9, 3, 4, seed=1).items()}
    del x["initial_state"]
    y = selective_scan(**x, backend=backend)
    torch.testing.assert_close(y, selective_scan_ref(**x), rtol=1e-4, atol=1e-5)
    assert selective_scan(**{k: v.bfloat16() for k, v in x.items()}, backend=backend).dtype == torch.bfloat16


@NO_KERNEL
@pytest.mark.parametrize("threads", [1, 4])
def test_kernel_splits_work_over_threads(threads):
    """The kernel's (sequence, channel block) pairs split over threads mid-sequence: same results."""
    x = _inputs(2, 37, 24, 16, seed=7)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, h, grads = _run(selective_scan, x, 7, backend="cpu")
    finally:
        torch.set_num_threads(previous)
    y_ref, h_ref, grads_ref = _run(selective_scan_ref, x, 7)
    assert _rel(y, y_ref) <= 1e-10 and _rel(h, h_ref) <= 1e-10
    for name, g, g_ref in zip(NAMES, grads, grads_ref, strict=True):
        assert _rel(g, g_ref) <= 1e-10, name


@NO_KERNEL
@pytest.mark.parametrize("b,l,c,k,threads", [(2, 37, 19, 4, 1), (3, 5, 8, 4, 2), (1, 2, 16, 4, 1),
                                             (2, 30, 8, 1, 1), (2, 64, 24, 3, 3)])
def test_conv_silu_matches_conv1d(b, l, c, k, threads):
    """The kernel's causal depthwise conv + SiLU equals F.silu(F.conv1d(...)) with k - 1 zeros on the left."""
    g = torch.Generator().manual_seed(l)
    x, weight, bias = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
                       for s in ((b, l, c), (c, 1, k), (c,)))
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight, bias, groups=c).transpose(1, 2))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = scan_cpu.conv_silu(x, weight, bias)
        dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad(out, (x, weight, bias), dy)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(ref, (x, weight, bias), dy), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_kernel_build_failure_leaves_the_pytorch_scan(monkeypatch, tmp_path, caplog):
    """A compiler that fails (or none): no library, a warning, and selective_scan runs the chunked scan."""
    monkeypatch.setenv("TTT_BENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(scan_cpu.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert scan_cpu._library.__wrapped__() is None and "building it failed" in caplog.text
    monkeypatch.setattr(scan_cpu.shutil, "which", lambda name: None)
    assert scan_cpu._library.__wrapped__() is None
    monkeypatch.setattr(scan_cpu, "available", lambda: False)
    x = {k: v.detach() for k, v in _inputs(1, 9, 3, 4, seed=2).items()}
    torch.testing.assert_close(selective_scan(**x), selective_scan_ref(**x))


def test_default_chunk_is_8_tokens_on_a_cpu_and_about_sqrt_l_on_a_gpu():
    """On a GPU each loop step is a kernel launch: 8-token chunks at 34,816 tokens took 7x the time of
    ~sqrt(L) on an H200 (results/gpu/RUN.md); on a CPU 8 measured fastest (docs/mamba.md)."""
    assert default_chunk(34816, cuda=False) == 8 and default_chunk(34816, cuda=True) == 186
    assert default_chunk(40, cuda=True) == 8  # short sequences keep the CPU's chunk


def test_the_reference_is_a_backend_and_a_backend_that_cannot_run_says_why():
    x = {k: v.detach() for k, v in _inputs(1, 6, 3, 4, seed=3).items()}
    torch.testing.assert_close(selective_scan(**x, backend="ref"), selective_scan_ref(**x))
    with pytest.raises(ValueError, match="backend must be one of"):
        selective_scan(**x, backend="triton")
    with pytest.raises(RuntimeError, match="CUDA input and mamba-ssm"):
        selective_scan(**x, backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available() or mamba_inner() is None,
                    reason="needs a CUDA GPU and mamba-ssm")
def test_mamba_ssm_backend_matches_the_chunked_scan_on_a_gpu():
    """mamba-ssm's selective_scan_fn (its (batch, channels, length) layout behind the op's) against the
    chunked scan at a 125m layer's width (d_inner 1536, d_state 16), float32: outputs, last states, grads."""
    x = {k: v.detach().float().cuda().requires_grad_() for k, v in _inputs(2, 256, 1536, 16, seed=4).items()}
    del x["initial_state"]
    runs = [_run(selective_scan, x, 4, backend=backend) for backend in ("cuda", "torch")]
    (y, h, grads), (y_ref, h_ref, grads_ref) = runs
    assert _rel(y, y_ref) <= 1e-4 and _rel(h, h_ref) <= 1e-4
    for name, g, g_ref in zip(NAMES, grads, grads_ref, strict=True):
        assert _rel(g, g_ref) <= 1e-3, name


def _steps(x: dict, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token through selective_state_update: (y [b, l, d], the last state)."""
    state, ys = x["initial_state"].clone(), []
    for t in range(x["u"].shape[1]):
        u, delta, B, C, z = (x[k][:, t] for k in ("u", "delta", "B", "C", "z"))
        ys.append(selective_state_update(state, u, delta, x["A"], B, C, x["D"], z, dt_bias=x["delta_bias"],
                                         dt_softplus=True, backend=backend))
    return torch.stack(ys, 1), state


def test_one_token_steps_in_place_equal_the_scan():
    """Decoding's op: l steps of selective_state_update, each updating the state in place, give the
    reference scan's outputs and last state (float64)."""
    x = {k: v.detach() for k, v in _inputs(2, 7, 5, 4, seed=5).items()}
    y_ref, h_ref = selective_scan_ref(**x, delta_softplus=True, return_last_state=True)
    y, h = _steps(x, "ref")
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="auto, ref or cuda"):
        _steps(x, "torch")


@pytest.mark.skipif(not torch.cuda.is_available() or mamba_inner() is None,
                    reason="needs a CUDA GPU and mamba-ssm")
def test_mamba_ssm_state_update_matches_the_reference_step_on_a_gpu():
    """mamba-ssm's Triton selective_state_update against the PyTorch step at a 125m layer's width, float32."""
    x = {k: v.detach().float().cuda() for k, v in _inputs(4, 8, 1536, 16, seed=6).items()}
    (y, h), (y_ref, h_ref) = _steps(x, "cuda"), _steps(x, "ref")
    assert _rel(y, y_ref) <= 1e-4 and _rel(h, h_ref) <= 1e-4
