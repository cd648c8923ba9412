"""The TTT-MLP dual-form Triton kernels (kernels/ttt_mlp.py, forward and backward) against the PyTorch dual
and primal forms in float64, and compiled ahead of time for sm_80 / sm_90 (kernels/ttt_mlp_aot.py).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported).
eta is built as the TTT layer builds it (ttt.eta of its token scaling and inner learning rates).
"""

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
    ttt_mlp,  # noqa: E402
)
from ttt_bench.kernels.ttt import dual_scan, forms  # noqa: E402

from tests.conftest import rel_err  # noqa: E402

HEAD_SIZES, launch_options, supported, ttt_mlp_dual, why_not = (
    ttt_mlp.HEAD_SIZES, ttt_mlp.launch_options, ttt_mlp.supported, ttt_mlp.ttt_mlp_dual, ttt_mlp.why_not)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Largest error over the largest entry of the float64 reference. The kernel computes in float32 (ieee
# matmuls here): measured <= 1e-6 on outputs and weights; the weights' change over the sequence (the updates
# alone, 1e-2 of the weights) within 1e-5.
TOL = 1e-5
TOL_UPDATE = 1e-4
# sigmoid(v) = 1 / (1 + exp(-v)) in the interpreter's numpy overflows to the right limit for very negative v
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def mlp_inputs(B=2, H=2, N=2, b=16, f=16, seed=0, eta_base=1.0):
    """Random TTT-MLP inputs (every weight off its init: the init's zero biases and unit LN would hide
    errors) with eta as the layer makes it: token_eta[t] = 1/(t+1), lr = eta_base sigmoid(.) / f."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(DEVICE)
    m = 4 * f
    lr = eta_base * torch.sigmoid(torch.randn(B, H, N, b, generator=g)) / f
    token_eta = 1.0 / torch.arange(1, b + 1, dtype=torch.float32)
    eta = ttt.eta(token_eta, lr).to(DEVICE)  # [B, H, N, b, b]: token_eta[t] lr[s]
    return [r(B, H, N, b, f), r(B, H, N, b, f), r(B, H, N, b, f), eta,
            r(B, H, f, m, scale=f ** -0.5), r(B, H, 1, m, scale=0.3), r(B, H, m, f, scale=m ** -0.5),
            r(B, H, 1, f, scale=0.3), r(H, 1, f, scale=0.2, shift=1.0), r(H, 1, f, scale=0.2)]


NAMES = ("Z", "W1", "b1", "W2", "b2")


def check_against(reference: tuple, ours: tuple, initial: list, names=NAMES):
    """ours against the float64 reference (Z and the final weights, or the weights alone): each within TOL,
    and the weights' updates within TOL_UPDATE."""
    for name, a, ref in zip(names, ours, reference, strict=True):
        assert a.shape == ref.shape, name
        assert rel_err(a.double(), ref) < TOL, (name, rel_err(a.double(), ref))
    for name, a, ref, w0 in zip(names[-4:], ours[-4:], reference[-4:], initial, strict=True):
        # the updates alone (W_N - W_0): the weights themselves move by ~1e-2 over a few mini-batches
        update = rel_err(a.double() - w0.double(), ref - w0.double())
        assert update < TOL_UPDATE, (f"{name} update", update)


@pytest.mark.parametrize("f", [16, 32])
@pytest.mark.parametrize("N", [2, 4])
def test_forward_matches_float64_dual_form(f, N, one_thread):
    """Outputs and final weights against the PyTorch dual form in float64, on the same float32 values, at two
    sequence lengths (N mini-batches of 16: 32 and 64 tokens), batch 2 and 2 heads."""
    inputs = mlp_inputs(f=f, N=N, seed=f + N)
    with torch.no_grad():
        ours = ttt_mlp_dual(*inputs)
        ref = dual_scan.ttt_mlp_dual(*(t.double() for t in inputs))
    assert ours[0].dtype == torch.float32
    check_against(ref, ours, inputs[4:8])


def test_forward_matches_float64_primal_form(one_thread):
    """The primal form (every token's weights W_t materialised, Equation 6) is the same function: the kernel
    against it, in float64, with a larger inner learning rate (bigger updates)."""
    inputs = mlp_inputs(f=16, N=3, seed=5, eta_base=8.0)
    with torch.no_grad():
        ours = ttt_mlp_dual(*inputs)
        x64 = [t.double() for t in inputs]
        Z, params = forms.ttt_scan("primal", tuple(x64[4:8]), *x64[:4], ln=tuple(x64[8:]))
    check_against((Z, *params), ours, inputs[4:8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs(dtype, one_thread):
    """Inputs (XQ, XK, XV, eta) of a 16-bit dtype are read as they are and computed in float32: against the
    float64 dual form on the same (rounded) values; Z comes back in the inputs' dtype (its rounding: 2^-8 of
    the entries for bfloat16), the weights in float32."""
    inputs = mlp_inputs(f=16, N=2, seed=9)
    inputs[:4] = [t.to(dtype) for t in inputs[:4]]
    with torch.no_grad():
        Z, *weights = ttt_mlp_dual(*inputs)
        ref = dual_scan.ttt_mlp_dual(*(t.double() for t in inputs))
    assert Z.dtype == dtype and all(w.dtype == torch.float32 for w in weights)
    assert rel_err(Z.double(), ref[0]) < 1e-2
    check_against(ref[1:], weights, inputs[4:8], names=NAMES[1:])
    assert rel_err(Z.double(), ref[0]) > 0  # not trivially equal: the dtype reached the output


def test_domain():
    x = torch.zeros(1, 1, 1, 16, 16)
    W1, b1, b2, lnw = torch.zeros(1, 1, 16, 64), torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 16), x
    assert supported(x, W1, b1, b2, lnw)
    for f in (8, 16, 32, 64, 96, 128):
        for b in (8, 16, 32):
            xq = torch.zeros(1, 1, 1, b, f)
            inside = f in HEAD_SIZES and b == 16
            assert supported(xq, torch.zeros(1, 1, f, 4 * f), b1, b2, lnw) == inside, (f, b)
    assert "head size 128" in why_not(torch.zeros(1, 1, 1, 16, 128), torch.zeros(1, 1, 128, 512), b1, b2, lnw)
    assert "hidden width" in why_not(x, torch.zeros(1, 1, 16, 32), b1, b2, lnw)
    assert "bias" in why_not(x, W1, None, b2, lnw) and "LayerNorm" in why_not(x, W1, b1, b2, None)
    assert "mini-batch" in why_not(torch.zeros(1, 1, 1, 8, 16), W1, b1, b2, lnw)
    assert "dtype" in why_not(x.long(), W1, b1, b2, lnw)
    inputs = mlp_inputs(B=1, H=1, N=1)
    with pytest.raises(ValueError, match="precision"):
        ttt_mlp_dual(*inputs, precision="bf16")
    with pytest.raises(ValueError, match="W2 has shape"):
        ttt_mlp_dual(*inputs[:6], inputs[6][..., :8], *inputs[7:])



# ---- the backward (TTTMLPDual) ----

INPUT_NAMES = ("XQ", "XK", "XV", "eta", "W1", "b1", "W2", "b2", "ln_weight", "ln_bias")
# The backward in float32 (ieee matmuls) against float64 autograd: measured <= 5e-7 of the largest entry
# of every gradient (f = 16, 32, 64 at N = 3; f = 16 at N = 16)
TOL_GRAD = 1e-4


def gradients(fn, inputs: list, probes: list, dtype=None) -> list:
    """The gradients of every input of fn of the loss sum_o <o, probe_o> over its outputs (Z and the final
    weights), the inputs cast to dtype first (as leaves)."""
    leaves = [(t if dtype is None else t.to(dtype)).detach().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    sum((o * p.to(o.dtype)).sum() for o, p in zip(outputs, probes, strict=True)).backward()
    return [t.grad for t in leaves]


def probes_for(inputs: list, seed: int) -> list:
    """Random cotangents for Z, W1, b1, W2, b2 (their shapes are those of XQ and the initial weights)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g).to(DEVICE) for t in (inputs[0], *inputs[4:8])]


@pytest.mark.parametrize("f,N", [(16, 3), (32, 3), (64, 3), (16, 16)])
def test_backward_matches_float64_dual_form(f, N, one_thread):
    """Gradients of every input (eta and the per-head LayerNorm's included) of a loss on Z and the final
    weights, against autograd through the PyTorch dual form in float64, at N mini-batches of 16 (16: the
    backward undoes 16 updates in float32, from the last weights), one sequence and 2 heads, with a large
    inner learning rate (updates that matter to the later mini-batches)."""
    inputs = mlp_inputs(B=1, H=2, N=N, f=f, seed=20 + f, eta_base=4.0)
    probes = probes_for(inputs, seed=f)
    ours = gradients(ttt_mlp_dual, inputs, probes)
    ref = gradients(dual_scan.ttt_mlp_dual, inputs, probes, torch.float64)
    for name, a, r, t in zip(INPUT_NAMES, ours, ref, inputs, strict=True):
        assert a.shape == t.shape and a.dtype == t.dtype, name
        assert rel_err(a.double(), r) < TOL_GRAD, (name, rel_err(a.double(), r))
    deta = ours[3]
    assert deta.triu(1).eq(0).all() and deta.tril().ne(0).any()  # eta is read below its diagonal only


class LaunchSpy:
    """A kernel's launches, recording their keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_backward_of_some_outputs_and_inputs(one_thread, monkeypatch):
    """A loss on Z alone (the final weights' gradients materialised as zeros), gradients of some inputs only
    (the others constants); the forward stores every mini-batch's G1, G2 only when a gradient is to
    come (not under no_grad, inputs requiring grad or not), and its outputs are bitwise the same."""
    spy = LaunchSpy(ttt_mlp._mlp_dual_fwd_kernel)
    monkeypatch.setattr(ttt_mlp, "_mlp_dual_fwd_kernel", spy)
    inputs = mlp_inputs(B=2, H=1, N=2, f=16, seed=31)
    leaves = [t.clone().requires_grad_(i in (2, 6, 9)) for i, t in enumerate(inputs)]  # XV, W2, ln_bias
    with torch.no_grad():
        plain = ttt_mlp_dual(*leaves)
    outputs = ttt_mlp_dual(*leaves)
    assert [launch["STORE_STATES"] for launch in spy.launches] == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(outputs, plain, strict=True))
    probe = probes_for(inputs, seed=1)[0]
    (outputs[0] * probe).sum().backward()
    ref = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    (dual_scan.ttt_mlp_dual(*ref)[0] * probe.double()).sum().backward()
    for i in (2, 6, 9):
        assert rel_err(leaves[i].grad.double(), ref[i].grad) < TOL_GRAD, INPUT_NAMES[i]


def test_backward_16_bit_inputs(one_thread):
    """bfloat16 XQ, XK, XV, eta: their gradients come back in bfloat16, the weights' in float32; against the
    float64 dual form on the same (rounded) values, within bfloat16's rounding of the gradients."""
    inputs = mlp_inputs(B=1, H=2, N=2, f=16, seed=41)
    inputs[:4] = [t.to(torch.bfloat16) for t in inputs[:4]]
    probes = probes_for(inputs, seed=2)
    probes[0] = probes[0].to(torch.bfloat16)  # Z's cotangent comes in Z's dtype: the same for the reference
    ours = gradients(ttt_mlp_dual, inputs, probes)
    ref = gradients(dual_scan.ttt_mlp_dual, inputs, probes, torch.float64)
    for name, a, r, t in zip(INPUT_NAMES, ours, ref, inputs, strict=True):
        assert a.dtype == t.dtype, name
        assert rel_err(a.double(), r) < (1e-2 if t.dtype == torch.bfloat16 else TOL_GRAD), name

# ---- ahead of time, for the GPU (kernels/ttt_mlp_aot.py) ----

AOT_PRECISION = "tf32"  # what the layer would run on CUDA (models/ttt/kernel_check.PRECISION)
# Where the kernel keeps everything in registers (tf32, the launcher's options): f = 16 on both targets and
# f = 32 on sm_80. Reported, not asserted: f = 32 on sm_90 (60 bytes a thread) and f = 64, the paper sizes'
# (2.5-2.8 KB): the 128 KB of float32 weights per program and the [16, k] tl.dot operands over the hidden
# units, held whole by every warp, do not fit (kernels/ttt_mlp.py's docstring).
# The training forward (which also stores every mini-batch's G1, G2) keeps everything in registers at f = 16
# too. The backward spills at every size (kernels/ttt_mlp.py's docstring has the report: at most 316, 1248
# and 3188 bytes of spill stores per thread at f = 16, 32, 64): the bounds guard against a regression.
NO_SPILLS = {("forward", 80, 16), ("forward", 90, 16), ("forward", 80, 32), ("training", 80, 16),
             ("training", 90, 16)}
BACKWARD_SPILLS = {16: 640, 32: 2048, 64: 4096}
AOT_CONFIGS = [(kernel, arch, f) for kernel in ("forward", "training", "backward") for arch in (80, 90)
               for f in HEAD_SIZES]


@pytest.fixture(scope="module")
def aot_records(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    def run(chunk):
        configs = json.dumps([[kernel, arch, f, AOT_PRECISION, None] for kernel, arch, f in chunk])
        cmd = [sys.executable, "-m", "ttt_bench.kernels.ttt_mlp_aot", "--json", "--configs", configs]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    workers = min(2, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(run, [AOT_CONFIGS[i::workers] for i in range(workers)])
    return {(r["kernel"], r["arch"], r["f"]): r for part in parts for r in part}


@pytest.mark.integration
@pytest.mark.parametrize("kernel,arch,f", AOT_CONFIGS, ids=[f"{k}-sm_{a}-f{f}" for k, a, f in AOT_CONFIGS])
def test_compiles_for_the_gpu_and_fits(kernel, arch, f, aot_records):
    r = aot_records[kernel, arch, f]
    where = f"TTT-MLP {kernel} for sm_{arch} at head size {f}, {AOT_PRECISION}, {r['num_warps']} warps"
    assert all(r[k] == v for k, v in launch_options(f, AOT_PRECISION, kernel).items())  # the launcher's
    assert r["error"] is None, f"{where} does not compile: {r['error']}"
    assert r["shared"] <= r["limit"], f"{where} needs {r['shared']} bytes of shared memory, over {r['limit']}"
    assert r["int64_offsets"], f"{where}: 32-bit offsets"
    spills = f"{where} spills {r['spill_stores']} bytes of registers per thread ({r['regs']} registers)"
    if (kernel, arch, f) in NO_SPILLS:
        assert r["spill_stores"] == r["spill_loads"] == 0, spills
    if kernel == "backward":
        assert r["spill_stores"] <= BACKWARD_SPILLS[f], spills
