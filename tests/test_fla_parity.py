"""flash-linear-attention's TTT-Linear (fla-core, `fla.ops.ttt`) against the toolkit's reference, on the
variant both compute (issue 48: `bench forms` times them side by side on a GPU).

Where they differ, read from fla-core 0.6.0's naive.py and fused_chunk.py and checked here:
- the learning rate: fla's eta is one number per token t, the row of the mini-batch's [b, b] eta matrix;
  the paper's (and the toolkit's) eta[t, s] = token_eta[t] * lr[s] has a learnable lr per *column* token s
  (Section 2.7: lr(x_s) = eta_base sigmoid(theta_lr x_s)). They agree when lr is one constant: fla's
  eta_t = lr * token_eta[t]. The toolkit's learnable-lr models (Table 1's last rows) are outside fla's.
- the output: fla returns Zb + LN(Zb), the residual around the *updated-weights* output; the paper's inner
  model f(x) = x + LN(f_res(x)) gives XQ + LN(Zb) (the authors' ttt-lm-pytorch: XQ + ln_fwd(Z1_bar)). The
  pre-residual outputs and the final weights agree.
On CPU fla's kernels run in Triton's interpreter, where fused_chunk runs and chunk does not (the interpreter
fails on one of its kernels); its autotuner, which times configs on a GPU, takes the first config here.
"""

import pytest
import torch

fla_ttt = pytest.importorskip("fla.ops.ttt", reason="fla-core is not installed (pip install -e '.[dev]')")

from ttt_bench.kernels.ln import LN_EPS  # noqa: E402
from ttt_bench.kernels.ttt_linear_prefill import prefill_reference  # noqa: E402

from tests.conftest import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def first_config_without_a_gpu(monkeypatch):
    if DEVICE == "cpu":
        from triton.runtime import autotuner

        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, **k: [0.0, 0.0, 0.0])


@pytest.mark.parametrize("kernel", ["fused_chunk", "chunk"])
def test_fla_computes_the_toolkits_ttt_linear_with_a_constant_lr_and_its_own_residual(kernel):
    if DEVICE == "cpu" and kernel == "chunk":
        pytest.skip("fla's chunk kernels do not run in Triton's CPU interpreter; on a GPU they are compared")
    from fla.ops.ttt.chunk import ChunkTTTLinearFunction
    from fla.ops.ttt.fused_chunk import FusedChunkTTTLinearFunction

    B, T, H, f, b, lr = 2, 32, 2, 16, 16, 0.3
    g = torch.Generator().manual_seed(0)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(DEVICE)
    XQ, XK, XV = r(B, T, H, f), r(B, T, H, f), r(B, T, H, f)
    W0, b0 = r(B, H, f, f, scale=0.3), r(B, H, 1, f, scale=0.3)
    ln_w, ln_b = r(H, f, scale=0.2, shift=1.0), r(H, f, scale=0.2)
    te = 1.0 / torch.arange(1, b + 1, device=DEVICE)  # the paper's token scaling 1/i
    Z, W_last, b_last = prefill_reference(XQ, XK, XV, torch.full((B, H, T), lr, device=DEVICE), W0, b0, ln_w,
                                          ln_b, te, mini_batch=b)
    eta = (lr * te).repeat(T // b)[None, :, None, None].expand(B, T, H, 1).contiguous()  # per row t
    fn = {"fused_chunk": FusedChunkTTTLinearFunction, "chunk": ChunkTTTLinearFunction}[kernel].apply
    extra = (None,) if kernel == "fused_chunk" else (None, None)  # cu_seqlens (and its CPU copy)
    Zb, W_fla, b_fla = fn(XQ, XK, XV, ln_w, ln_b, b, eta, 1.0, LN_EPS.value, W0, b0, True, *extra)
    assert rel_err(W_fla.double(), W_last) < 1e-5 and rel_err(b_fla.double(), b_last) < 1e-5
    ln_of_zb = Z - XQ.double()  # ours: XQ + LN(Zb)
    centered = Zb.double() - Zb.double().mean(-1, keepdim=True)
    ln_fla = centered / (centered.square().mean(-1, keepdim=True) + LN_EPS.value).sqrt() * ln_w + ln_b
    assert rel_err(ln_fla, ln_of_zb) < 1e-5  # the same Zb
    public = getattr(fla_ttt, f"{kernel}_ttt_linear")
    out, _, _ = public(XQ, XK, XV, ln_w, ln_b, eta, scale=1.0, eps=LN_EPS.value, chunk_size=b,
                       initial_state=W0, initial_state_bias=b0, output_final_state=True)
    assert rel_err(out.double(), Zb.double() + ln_of_zb) < 1e-5  # fla's residual: around Zb
    assert rel_err(out.double(), Z) > 1e-2  # not the paper's XQ + LN(Zb)
