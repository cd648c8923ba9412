"""The chunked selective scan equals the sequential reference, outputs and gradients."""

import pytest
import torch

from ttt_bench.models.mamba.scan import selective_scan
from ttt_bench.models.mamba.scan_ref import selective_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize("b,l,d,n,chunk", [(2, 37, 5, 3, 8), (1, 5, 4, 2, 16), (3, 64, 6, 4, 16),
                                           (2, 1, 3, 2, None), (2, 50, 4, 16, None), (1, 23, 3, 5, 1)])
def test_chunked_matches_reference(b, l, d, n, chunk):
    seed = b * 1000 + l
    x = _inputs(b, l, d, n, seed)
    y, h, grads = _run(selective_scan, x, seed, chunk_size=chunk)
    y_ref, h_ref, grads_ref = _run(selective_scan_ref, x, seed)
    assert _rel(y, y_ref) <= 1e-5 and _rel(h, h_ref) <= 1e-5
    for name, g, g_ref in zip(NAMES, grads, grads_ref, strict=True):
        assert _rel(g, g_ref) <= 1e-5, name


def test_strong_decay_stays_finite():
    """delta * A sums to ~ -1e4 within a chunk: no overflow, still equal to the reference."""
    x = _inputs(2, 40, 4, 8, seed=0, delta_scale=0.0, dtype=torch.float32)
    with torch.no_grad():
        x["delta_bias"].fill_(50.0)
    y, h, grads = _run(selective_scan, x, 0, chunk_size=16)
    y_ref, h_ref, _ = _run(selective_scan_ref, x, 0)
    assert all(t.isfinite().all() for t in (y, h, *grads))
    assert _rel(y, y_ref) < 1e-5


def test_defaults_and_dtype():
    x = {k: v.detach().float() for k, v in _inputs(2, 9, 3, 4, seed=1).items()}
    del x["initial_state"]
    y = selective_scan(**x)
    torch.testing.assert_close(y, selective_scan_ref(**x), rtol=1e-4, atol=1e-5)
    assert selective_scan(**{k: v.bfloat16() for k, v in x.items()}).dtype == torch.bfloat16
