"""TTT-MLP's one-token decode kernel (kernels/ttt_mlp_decode.py, forward only) against the PyTorch primal step
in float64 as the TTT layer calls it, token by token against the layer's own path over a mini-batch boundary,
and compiled ahead of time for sm_80 / sm_90 (kernels/aot.py's compile and ptxas report).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported).
"""

import copy
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from ttt_bench.kernels import (
    ttt,  # noqa: E402
    ttt_mlp_decode,  # noqa: E402
)
from ttt_bench.kernels.ttt import forms  # noqa: E402

from tests.conftest import REPO, rel_err  # noqa: E402
from ttt_bench.models.ttt.layer import TTTCache, TTTLayer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Largest error over the largest entry of the float64 reference; the kernel computes in float32 (measured
# <= 3e-7 on z, the sums and their increments).
TOL = 1e-4
# sigmoid(v) = 1 / (1 + exp(-v)) in the interpreter's numpy overflows to the right limit for very negative v
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
NAMES = ("z", "S_W1", "S_b1", "S_W2", "S_b2")


def step_inputs(B=2, H=2, f=16, seed=0):
    """One token's inputs: xq, xk, xv [B, H, 1, f], lr [B, H] (as the layer's: sigmoid(.) / f, times 4 for
    larger steps), the weights W_{t'} (W1, b1, W2, b2) and non-zero pending sums of the same shapes, all off
    any init, and ln (weight, bias)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(DEVICE)
    m = 4 * f
    shapes = [((B, H, f, m), f ** -0.5), ((B, H, 1, m), 0.3), ((B, H, m, f), m ** -0.5), ((B, H, 1, f), 0.3)]
    tokens = [r(B, H, 1, f) for _ in range(3)]
    lr = (4.0 * torch.sigmoid(torch.randn(B, H, generator=g)) / f).to(DEVICE)
    weights = [r(*shape, scale=scale) for shape, scale in shapes]
    sums = [r(*shape, scale=0.3 * scale) for shape, scale in shapes]
    return tokens, lr, weights, sums, (r(H, 1, f, scale=0.2, shift=1.0), r(H, 1, f, scale=0.2))


def primal_step(tokens, lr, te, weights, sums, ln):
    """The PyTorch step as layer.py's `_continue` makes it for one token (c = 1): (z, new sums)."""
    te, lr = te.view(1), lr[..., None]  # token_eta [c], lr [B, H, c]
    eta = ttt.eta(te, lr)
    return forms.primal_step(tuple(weights), *tokens, eta, ln, pending=(tuple(sums), te[:, None],
                                                                         lr[..., None, :]))


@pytest.mark.parametrize("f", [16, 32])
def test_step_matches_float64_primal_step(f, one_thread):
    """z and the four new sums against the float64 primal step with pending sums, at three positions of the
    mini-batch (te = 1/(t+1)); the sums' increments lr G alone too (a fraction of the sums)."""
    tokens, lr, weights, sums, ln = step_inputs(f=f, seed=f)
    x64 = lambda ts: [t.double() for t in ts]
    for t in (0, 6, 15):
        te = torch.tensor(1.0 / (t + 1), device=DEVICE)
        with torch.no_grad():
            ours = ttt_mlp_decode.decode_step(*tokens, lr, te, *weights, *sums, *ln)
        z, new_sums = primal_step(x64(tokens), lr.double(), te.double(), x64(weights), x64(sums), x64(ln))
        for name, a, ref in zip(NAMES, ours, (z, *new_sums), strict=True):
            assert a.shape == ref.shape and a.dtype == torch.float32, name
            assert rel_err(a.double(), ref) < TOL, (name, t, rel_err(a.double(), ref))
        xq = tokens[0].double()
        assert rel_err(ours[0].double() - xq, z - xq) < TOL, ("z - xq", t)  # without the residual
        for name, a, ref, s in zip(NAMES[1:], ours[1:], new_sums, sums, strict=True):
            increment = rel_err(a.double() - s.double(), ref - s.double())
            assert increment < TOL, (f"{name} increment", t, increment)


def test_decoding_across_a_mini_batch_matches_the_layer(one_thread):
    """20 tokens decoded one at a time, completing the first mini-batch of 16 in between (W = W - te[15] S,
    new sums 0, as the layer's `_continue`), against the TTT layer's PyTorch path over the same 20 tokens in
    float64 (the dual form over the mini-batch of 16, the primal step over the last 4): every token's z, the
    weights after the mini-batch (and their update alone) and the sums after the last token. The sums are
    written in place, as the layer decodes without autograd."""
    B, H, f, b, T = 2, 2, 16, 16, 20
    torch.manual_seed(0)
    layer = TTTLayer(H * f, H, learner="mlp", mini_batch_size=b, form="dual", ln_residual=True,
                     token_scaling="learnable", kernel="torch").to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():  # off the init (zero biases, unit LN), as trained weights are
            p.add_(0.05 * torch.randn_like(p))
        layer.token_idx_offset.copy_(0.1 * torch.rand(b))
    ref_layer = copy.deepcopy(layer).double()
    XQ, XK, XV = (torch.randn(B, H, T, f, device=DEVICE) for _ in range(3))
    lr = 4.0 * torch.sigmoid(torch.randn(B, H, T, device=DEVICE)) / f
    cache = TTTCache()
    with torch.no_grad():
        Z_ref = ref_layer._ttt(XQ.double(), XK.double(), XV.double(), lr.double(), cache)
        ln = layer.ln()
        weights = [w.contiguous() for w in layer.initial_params(B)]
        sums = [torch.zeros_like(w) for w in weights]
        for t in range(T):
            te = layer.token_eta(t % b, 1)[0]
            token = [x[:, :, t : t + 1] for x in (XQ, XK, XV)]
            before = list(sums)  # in place, as the layer decodes without autograd
            z, *sums = ttt_mlp_decode.decode_step(*token, lr[..., t], te, *weights, *sums, *ln, in_place=True)
            assert rel_err(z.double(), Z_ref[:, :, t : t + 1]) < TOL, t
            assert all(s is s0 for s, s0 in zip(sums, before, strict=True))
            if t % b == b - 1:
                weights = [w - te * s for w, s in zip(weights, sums, strict=True)]
                sums = [torch.zeros_like(w) for w in weights]
    names = ("W1", "b1", "W2", "b2", *NAMES[1:])
    for name, a, ref in zip(names, [*weights, *sums], [*cache.params, *cache.sums], strict=True):
        assert rel_err(a.double(), ref) < TOL, (name, rel_err(a.double(), ref))
    for name, a, ref, w0 in zip(names[:4], weights, cache.params, ref_layer.initial_params(B), strict=True):
        update = rel_err(a.double() - w0, ref - w0)  # the mini-batch's update alone
        assert update < TOL, (f"{name} update", update)


def test_domain_and_forward_only():
    why_not, supported = ttt_mlp_decode.why_not, ttt_mlp_decode.supported
    b1, b2, lnw = torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 16), torch.ones(1, 1, 16)
    for f in (8, 16, 32, 64, 96, 128):
        xq, W1 = torch.zeros(1, 1, 1, f), torch.zeros(1, 1, f, 4 * f)
        assert supported(xq, W1, b1, b2, lnw) == (f in ttt_mlp_decode.HEAD_SIZES), f
    x, W1 = torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 16, 64)
    assert "head size 128" in why_not(torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, 128, 512), b1, b2, lnw)
    assert "2 tokens" in why_not(torch.zeros(1, 1, 2, 16), W1, b1, b2, lnw)
    assert "hidden width" in why_not(x, torch.zeros(1, 1, 16, 32), b1, b2, lnw)
    assert "bias" in why_not(x, W1, b1, None, lnw) and "LayerNorm" in why_not(x, W1, b1, b2, None)
    assert "dtype" in why_not(x.long(), W1, b1, b2, lnw)
    tokens, lr, weights, sums, ln = step_inputs(B=1, H=1)
    te = torch.tensor(0.5, device=DEVICE)
    weights[0].requires_grad_()
    with pytest.raises(RuntimeError, match="forward only"):
        ttt_mlp_decode.decode_step(*tokens, lr, te, *weights, *sums, *ln)
    weights[0] = weights[0].detach()
    with pytest.raises(ValueError, match="S_W2 has shape"):
        ttt_mlp_decode.decode_step(*tokens, lr, te, *weights, *sums[:2], sums[2][..., :8], sums[3], *ln)
    with pytest.raises(ValueError, match="domain: no bias"):
        ttt_mlp_decode.decode_step(*tokens, lr, te, weights[0], None, *weights[2:], *sums, *ln)


# ---- ahead of time, for the GPU (kernels/aot.py) ----

AOT_CONFIGS = [(arch, f) for arch in (80, 90) for f in ttt_mlp_decode.HEAD_SIZES]


def compile_records(configs: list) -> None:
    """Print one JSON record a line for each [arch, f, num_warps or None (the launcher's)]: the kernel
    compiled for sm_{arch} at head size f with float32 inputs (aot.ptxas_report: registers, spills, shared
    memory, int64 offsets). Not under TRITON_INTERPRET=1 (the test runs it in a subprocess)."""
    from ttt_bench.kernels.aot import SHARED_LIMIT, ptxas_report

    fn = ttt_mlp_decode._mlp_decode_kernel
    for arch, f, warps in configs:
        launch = ttt_mlp_decode.launch_options(f)
        if warps is not None:
            launch["num_warps"] = warps
        constexprs = {"F": f, "M": 4 * f}
        signature = {a: "constexpr" if a in constexprs else "i32" if a == "H" else "*fp32"
                     for a in fn.arg_names}
        # as at a launch: torch's allocations are 16-byte aligned and Triton specializes pointers on that
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if signature[a].startswith("*")}
        record = {"arch": arch, "f": f, **launch, "limit": SHARED_LIMIT[arch]}
        report = ptxas_report(fn, signature, constexprs, attrs, arch, launch)
        print(json.dumps({**record, **report}), flush=True)


@pytest.fixture(scope="module")
def aot_records(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no CUDA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton"))}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    def run(chunk):
        configs = [(arch, f, None) for arch, f in chunk]
        code = f"from tests.test_kernel_ttt_mlp_decode import compile_records; compile_records({configs!r})"
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    workers = min(2, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(run, [AOT_CONFIGS[i::workers] for i in range(workers)])
    return {(r["arch"], r["f"]): r for part in parts for r in part}


@pytest.mark.integration
@pytest.mark.parametrize("arch,f", AOT_CONFIGS, ids=[f"sm_{a}-f{f}" for a, f in AOT_CONFIGS])
def test_compiles_for_the_gpu_without_spills(arch, f, aot_records):
    """At the launcher's options every head size keeps its tiles in registers (kernels/ttt_mlp_decode.py's
    table: f = 64 at 255 registers a thread, the most there are)."""
    r = aot_records[arch, f]
    where = f"TTT-MLP decode for sm_{arch} at head size {f}, {r['num_warps']} warps"
    assert r["error"] is None, f"{where} does not compile: {r['error']}"
    assert (r["num_warps"], r["num_stages"]) == tuple(ttt_mlp_decode.launch_options(f).values())
    assert r["shared"] <= r["limit"], f"{where} needs {r['shared']} bytes of shared memory, over {r['limit']}"
    assert r["int64_offsets"], f"{where}: 32-bit offsets"
    assert r["spill_stores"] == r["spill_loads"] == 0, (
        f"{where} spills {r['spill_stores']} bytes of registers per thread ({r['regs']} registers)")
