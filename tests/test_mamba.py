"""Mamba LM: config, sizes, mamba-ssm parameter layout and init, backends (decoding: tests/test_models.py)."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from ttt_bench.kernels import mamba as mamba_ops
from ttt_bench.kernels.mamba import scan_cpu

from ttt_bench.config import compose
from ttt_bench.errors import UserError
from ttt_bench.models import LanguageModel
from ttt_bench.models.mamba import Mamba, MambaBlock, block

pytestmark = pytest.mark.usefixtures("one_thread")


def _lm(d_model=32, n_layers=2, vocab=61, **kw):
    factory = lambda layer_idx: MambaBlock(layer_idx, d_model, **kw)
    return LanguageModel(vocab, d_model, n_layers, factory)


@pytest.mark.parametrize("size", ["125m", "350m", "760m", "1.3b"])
def test_paper_sizes_have_twice_the_transformers_blocks(size):
    """Mamba blocks have no MLP: twice the layers at the same width (their parameter counts are checked with
    every model's in tests/test_models.py)."""
    cfg = compose("train", ["model=mamba", f"size={size}"])
    assert cfg.model.n_layers == 2 * compose("train", [f"size={size}"]).size.n_layers


def test_parameter_names_and_shapes_match_mamba_ssm():
    d, di, n, r = 48, 96, 16, 3  # dt_rank = ceil(48 / 16)
    shapes = {k: tuple(v.shape) for k, v in Mamba(d).state_dict().items()}
    assert shapes == {"in_proj.weight": (2 * di, d), "conv1d.weight": (di, 1, 4), "conv1d.bias": (di,),
                      "x_proj.weight": (r + 2 * n, di), "dt_proj.weight": (di, r), "dt_proj.bias": (di,),
                      "A_log": (di, n), "D": (di,), "out_proj.weight": (d, di)}
    lm_keys = {k.removeprefix("blocks.0.mixer.") for k in _lm(d, 1).state_dict() if ".mixer." in k}
    assert lm_keys == set(shapes)


def test_init_as_mamba_ssm_after_lm_init():
    torch.manual_seed(0)
    mixer = _lm(64, 2).blocks[1].mixer
    torch.testing.assert_close(mixer.A_log, torch.log(torch.arange(1.0, 17.0)).expand(128, 16))
    assert (mixer.D == 1).all()
    dt = F.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert mixer.dt_proj.weight.abs().max() <= 4**-0.5


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = _lm(n_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 61, (4, 32))
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


def test_backend_selection(caplog, monkeypatch):
    with pytest.raises(UserError, match="backend"):
        Mamba(16, backend="triton")
    monkeypatch.setattr(mamba_ops, "mamba_inner", lambda: None)
    with pytest.raises(UserError, match=r"pip install -e '\.\[cuda\]'"):
        Mamba(16, backend="cuda")
    for backend in ("torch", "auto"):
        monkeypatch.setattr(block, "_logged_backends", set())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=block.__name__):
            Mamba(16, backend=backend)(torch.randn(1, 3, 16))
        kernel = backend == "auto" and scan_cpu.available()
        used = "cpu (C++ selective scan kernel)" if kernel else "torch (chunked selective scan)"
        assert used in caplog.text
    monkeypatch.setattr(scan_cpu, "available", lambda: False)
    with pytest.raises(UserError, match="backend=cpu needs the Mamba CPU kernel"):
        Mamba(16, backend="cpu")


@pytest.mark.skipif(not scan_cpu.available(), reason="the C++ kernel does not build here")
def test_cpu_kernel_matches_torch_path():
    """The whole LM, outputs and every parameter's gradient, float64: backend=cpu equals backend=torch."""
    torch.manual_seed(0)
    ref = _lm(24, 2, backend="torch").double()
    fast = copy.deepcopy(ref)
    for b in fast.blocks:
        b.mixer.backend = "cpu"
    ids = torch.randint(0, 61, (3, 45))
    outs = []
    for model in (ref, fast):
        out = model(ids)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append((out, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-9, atol=1e-9)
    for g_fast, g_ref in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-8, atol=1e-10)


def _cuda_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if mamba_ops.mamba_inner() is None:
        return "needs mamba-ssm and causal-conv1d (pip install -e '.[cuda]')"
    return ""


@pytest.mark.skipif(bool(_cuda_reason()), reason=_cuda_reason() or "runs")
def test_cuda_kernels_match_torch_path():
    torch.manual_seed(0)
    ref = _lm(64, 2, backend="torch").cuda()
    fast = copy.deepcopy(ref)
    for b in fast.blocks:
        b.mixer.backend = "cuda"
    ids = torch.randint(0, 61, (2, 300), device="cuda")
    out_ref, out_fast = ref(ids), fast(ids)
    torch.testing.assert_close(out_fast, out_ref, rtol=1e-3, atol=1e-3)
    out_ref.square().mean().backward()
    out_fast.square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-2, atol=1e-4, msg=name)


def test_narrow_linear_gradients():
    """dt_proj's matmul with its transposed gradients (block._NarrowLinear) against autograd's."""
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(block._NarrowLinear.apply, (x, w))
