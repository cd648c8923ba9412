"""TTT inner loop: primal form == dual form == the naive per-token loop, checkpointing, Theorems 1 and 2."""

import random
import shutil
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from ttt_bench.kernels.ttt import dual_scan
from ttt_bench.kernels.ttt.dual_scan import ttt_linear_dual
from ttt_bench.kernels.ttt.forms import ttt_scan
from ttt_bench.kernels.ttt.learner import nadaraya_watson
from ttt_bench.kernels.ttt.naive import naive_ttt

from tests.conftest import rel_err
from ttt_bench.models.linear_attention import causal_linear_attention
from ttt_bench.models.ttt import TTTLayer

pytestmark = pytest.mark.usefixtures("float64_one_thread")




def perturb(module: torch.nn.Module, std: float = 0.1) -> None:
    """Move every parameter off its init (LN weights, biases, offsets) so that each one is tested."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(std * torch.randn_like(p))


def random_layers(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        kw = dict(
            learner=rng.choice(["linear", "mlp"]),
            ln_residual=rng.random() < 0.5,
            mini_batch_size=rng.randint(1, 5),
            inner_bias=rng.random() < 0.8,
            learnable_lr=rng.random() < 0.8,
            token_scaling=rng.choice(["none", "fixed", "learnable"]),
            share_qk=rng.random() < 0.5,
        )
        H, f = rng.randint(1, 2), rng.choice([2, 4])
        yield kw, H, f, rng.randint(1, 2), rng.randint(1, 13)


@pytest.mark.parametrize("seed", range(6))
def test_primal_equals_dual_outputs_and_gradients(seed):
    for kw, H, f, B, T in random_layers(3, seed):
        torch.manual_seed(seed)
        dual = TTTLayer(H * f, H, form="dual", use_gate=kw["share_qk"], **kw)
        perturb(dual)
        primal = TTTLayer(H * f, H, form="primal", use_gate=kw["share_qk"], **kw)
        primal.load_state_dict(dual.state_dict())
        x = torch.randn(B, T, H * f, requires_grad=True)
        outs, grads = [], []
        for layer in (dual, primal):
            y = layer(x)
            g = torch.autograd.grad((y * torch.cos(y)).sum(), [x, *layer.parameters()])
            outs.append(y)
            grads.append(g)
        assert rel_err(outs[0], outs[1]) <= 1e-5, (kw, T)
        for name, a, b in zip(["x"] + [n for n, _ in dual.named_parameters()], *grads, strict=True):
            assert rel_err(a, b) <= 1e-5, (name, kw, T)


@pytest.mark.parametrize("learner", ["linear", "mlp"])
@pytest.mark.parametrize("ln_residual", [True, False])
@pytest.mark.parametrize(
    "mini_batch_size,T", [(1, 7), (4, 11), (16, 16), (128, 128)]
)  # online GD, mini-batch GD, batch GD (at 128: TTT-Linear's chunked batch-GD path)
def test_dual_equals_naive_per_token_loop(learner, ln_residual, mini_batch_size, T):
    torch.manual_seed(0)
    H, f, B = 2, 4, 2
    layer = TTTLayer(H * f, H, learner=learner, ln_residual=ln_residual, mini_batch_size=mini_batch_size)
    perturb(layer)
    xq, xk, xv = (torch.randn(B, H, T, f) for _ in range(3))
    lr = layer.inner_lr(torch.randn(B, T, H * f))
    z = layer._ttt(xq, xk, xv, lr, None)
    z_ref, _ = naive_ttt(
        layer.initial_params(B),
        xq,
        xk,
        xv,
        lr,
        layer.token_eta(0, mini_batch_size),
        mini_batch_size,
        layer.ln(),
    )
    assert rel_err(z, z_ref) <= 1e-10
    params = [
        p
        for n, p in layer.named_parameters()
        if not n.startswith(("q_proj", "k_proj", "v_proj", "o_proj", "post"))
    ]
    params.append(lr)
    g = torch.autograd.grad(z.square().sum(), params, retain_graph=True)
    g_ref = torch.autograd.grad(z_ref.square().sum(), params)
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) <= 1e-8


@pytest.mark.parametrize("seed", range(4))
def test_fast_dual_scans_equal_the_reference_dual_steps(seed):
    """dual_scan.py (hand-written backward, segments recomputed) against forms.dual_step over forms.scan
    (autograd through every op): outputs, final weights and every gradient, random sizes, both learners,
    with and without biases and LN, across segment boundaries and with checkpointing."""
    rng = random.Random(seed)
    for _ in range(3):
        learner_name, bias, ln = rng.choice(["linear", "mlp"]), rng.random() < 0.7, rng.random() < 0.7
        B, H, b, f = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 5), rng.choice([4, 6])
        N = rng.choice([rng.randint(1, 5), rng.randint(15, 35)])  # SEGMENT is 16
        torch.manual_seed(rng.randint(0, 10**6))
        r = lambda *shape, scale=1.0: (scale * torch.randn(*shape)).requires_grad_()
        XQ, XK, XV = r(B, H, N, b, f), r(B, H, N, b, f), r(B, H, N, b, f)
        eta = ((0.3 if ln else 0.02) * torch.rand(B, H, N, b, b)).requires_grad_()
        dims = [f, f] if learner_name == "linear" else [f, 4 * f, f]
        params = []
        for k in range(len(dims) - 1):
            W = r(B, H, dims[k], dims[k + 1], scale=0.3)
            params += [W, r(B, H, 1, dims[k + 1], scale=0.3) if bias else None]
        lnw, lnb = (r(H, 1, f), r(H, 1, f)) if ln else (None, None)
        fast = dual_scan.ttt_linear_dual if learner_name == "linear" else dual_scan.ttt_mlp_dual
        Z, *last = fast(XQ, XK, XV, eta, *params, lnw, lnb, checkpoint_every=rng.choice([0, 0, 3]))
        Z_ref, last_ref = ttt_scan("dual", tuple(params), XQ, XK, XV, eta, (lnw, lnb) if ln else None)
        assert rel_err(Z, Z_ref) <= 1e-10
        for a, c in zip(last, last_ref, strict=True):
            assert (a is None and c is None) or rel_err(a, c) <= 1e-10
        inputs = [t for t in (XQ, XK, XV, eta, *params, lnw, lnb) if t is not None]
        loss = lambda z, ws: z.sin().sum() + sum((w**2).sum() for w in ws if w is not None)
        for a, c in zip(torch.autograd.grad(loss(Z, last), inputs),
                        torch.autograd.grad(loss(Z_ref, last_ref), inputs), strict=True):
            assert rel_err(a, c) <= 1e-8, (learner_name, bias, ln, N)


@pytest.mark.skipif(not shutil.which("c++"), reason="torch.compile on CPU needs a C++ compiler (c++)")
def test_fused_dual_form_equals_the_eager_one():
    """fused=True (dual_scan's batched parts and the gate compiled by torch.compile, fusion.py) computes
    what the eager code computes: outputs and every gradient, with and without LN, through a whole layer."""
    torch.manual_seed(0)
    B, H, N, b, f = 2, 2, 3, 4, 8
    r = lambda *shape, scale=1.0: (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_()
    for ln in (True, False):
        XQ, XK, XV = (r(B, N, b, H, f).permute(0, 3, 1, 2, 4) for _ in range(3))  # the layer's layout
        eta = (0.1 * torch.rand(B, H, N, b, b, dtype=torch.float64)).requires_grad_()
        inputs = [XQ, XK, XV, eta, r(B, H, f, f, scale=0.3), r(B, H, 1, f, scale=0.3)]
        inputs += [r(H, 1, f), r(H, 1, f)] if ln else [None, None]
        eager, fused = ttt_linear_dual(*inputs), ttt_linear_dual(*inputs, fused=True)
        assert fused[0].stride() == eager[0].stride()  # token-major, as the projections read it
        grads = [torch.autograd.grad(out[0].sin().sum() + out[1].sum(), [t for t in inputs if t is not None])
                 for out in (eager, fused)]
        for a, c in zip([*eager, *grads[0]], [*fused, *grads[1]], strict=True):
            assert rel_err(c, a) <= 1e-12, ln
    layers = [TTTLayer(16, 2, mini_batch_size=4, share_qk=True, use_gate=True, fused=fused).double()
              for fused in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    g = [torch.autograd.grad(layer(x).sin().sum(), list(layer.parameters())) for layer in layers]
    assert all(rel_err(c, a) <= 1e-12 for a, c in zip(*g, strict=True))


def test_fused_ttt_mlp_equals_the_eager_one():
    """TTT-MLP with fused=True (each mini-batch's state compiled, issue 49) computes what the eager code
    computes, outputs and every gradient, through a whole layer (float64: the compiled code may reorder)."""
    torch.manual_seed(0)
    layers = [TTTLayer(16, 2, learner="mlp", mini_batch_size=4, fused=fused).double()
              for fused in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    outs = [layer(x) for layer in layers]
    g = [torch.autograd.grad(out.sin().sum(), list(layer.parameters())) for out, layer in zip(outs, layers)]
    assert rel_err(outs[1], outs[0]) <= 1e-12
    assert all(rel_err(c, a) <= 1e-12 for a, c in zip(*g, strict=True))


def test_ttt_linear_dual_signature_and_shapes():
    B, H, N, b, f = 2, 3, 4, 5, 6
    XQ, XK, XV = (torch.randn(B, H, N, b, f) for _ in range(3))
    eta = torch.rand(B, H, N, b, b)
    W, bias = torch.randn(B, H, f, f) * 0.1, torch.zeros(B, H, 1, f)
    Z, W_last, b_last = ttt_linear_dual(XQ, XK, XV, eta, W, bias, torch.ones(H, 1, f), torch.zeros(H, 1, f))
    assert Z.shape == (B, H, N, b, f) and W_last.shape == W.shape and b_last.shape == bias.shape
    Z2, W2, _ = ttt_linear_dual(XQ, XK, XV, eta, W, bias, None, None)  # plain linear learner
    assert Z2.shape == Z.shape and not torch.allclose(Z, Z2)
    with torch.no_grad():  # inference computes Z mini-batch by mini-batch: the same numbers
        for ln, ref in ((torch.ones(H, 1, f), (Z, W_last, b_last)), (None, (Z2, W2, _))):
            out = ttt_linear_dual(XQ, XK, XV, eta, W, bias, ln, None if ln is None else torch.zeros(H, 1, f))
            assert all(rel_err(a, r) <= 1e-12 for a, r in zip(out, ref, strict=True))


def test_gradient_checkpointing_through_time_same_gradients():
    """The same gradients up to the order of float64 sums over mini-batches (which groups change)."""
    torch.manual_seed(0)
    for learner in ("linear", "mlp"):
        a = TTTLayer(8, 2, learner=learner, mini_batch_size=2)
        b = TTTLayer(8, 2, learner=learner, mini_batch_size=2, checkpoint_every=3)
        b.load_state_dict(a.state_dict())
        x = torch.randn(2, 21, 8)
        ga = torch.autograd.grad(a(x).sin().sum(), list(a.parameters()))
        gb = torch.autograd.grad(b(x).sin().sum(), list(b.parameters()))
        for u, v in zip(ga, gb, strict=True):
            assert rel_err(u, v) <= 1e-12


class PeakLiveTensors(TorchDispatchMode):
    """Bytes of the tensor storages allocated inside the context and alive (`live`), and their peak after
    every aten op: forward, backward and the recomputation of checkpointed segments all count.
    Deterministic on CPU."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.seen:
                storage = t.untyped_storage()
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_gradient_checkpointing_through_time_halves_activation_memory_at_4k():
    """Activation memory: what the forward keeps alive for the backward (its peak, reached when the forward
    ends); the overall peak, gradients included, drops too."""
    torch.manual_seed(0)
    B, H, T, b, f = 1, 1, 4096, 16, 64
    N = T // b
    XQ, XK, XV = (torch.randn(B, H, N, b, f, requires_grad=True) for _ in range(3))
    eta = (0.01 * torch.rand(B, H, N, b, b)).requires_grad_()
    W = (0.1 * torch.randn(B, H, f, f)).requires_grad_()
    bias = torch.zeros(B, H, 1, f, requires_grad=True)
    ln_w, ln_b = torch.ones(H, 1, f, requires_grad=True), torch.zeros(H, 1, f, requires_grad=True)
    inputs = (XQ, XK, XV, eta, W, bias, ln_w, ln_b)

    def run(k):
        with PeakLiveTensors() as mem:
            Z, W_last, _ = ttt_linear_dual(*inputs, checkpoint_every=k)
            activations = mem.live
            grads = torch.autograd.grad(Z.sin().sum() + W_last.sum(), inputs)
        return activations, mem.peak, grads

    act_full, peak_full, g_full = run(0)
    act_ckpt, peak_ckpt, g_ckpt = run(16)
    for u, v in zip(g_full, g_ckpt, strict=True):
        assert rel_err(u, v) <= 1e-12
    print(f"T={T}: activations {act_full} bytes without, {act_ckpt} with checkpointing; overall peak "
          f"{peak_full} and {peak_ckpt}")
    assert act_full >= 2 * act_ckpt, (act_full, act_ckpt)
    assert peak_full > peak_ckpt, (peak_full, peak_ckpt)


@pytest.mark.parametrize("T,chunk", [(96, 32), (50, 16)])  # 50: not a multiple of the chunk, one piece
@pytest.mark.parametrize("bias,ln", [(True, True), (False, False), (True, False)])
def test_chunked_batch_gd_equals_the_reference_dual_step(T, chunk, bias, ln):
    """dual_scan.ttt_linear_batch_gd (b = T, chunked) against forms.dual_step with eta[t, s] =
    token_eta[t] lr[s]: outputs, final weights and the gradients of every input, in float64."""
    from ttt_bench.kernels.ttt import forms

    torch.manual_seed(T + chunk)
    B, H, f = 2, 3, 4
    leaf = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    XQ, XK, XV, W = leaf(B, H, T, f), leaf(B, H, T, f), leaf(B, H, T, f), leaf(B, H, f, f)
    b = leaf(B, H, 1, f) if bias else None
    lns = (leaf(H, 1, f), leaf(H, 1, f)) if ln else None
    te = (1 / torch.arange(1.0, T + 1, dtype=torch.float64)).requires_grad_()
    lr = torch.rand(B, H, T, dtype=torch.float64).requires_grad_()
    Z, W_T, b_T = dual_scan.ttt_linear_batch_gd(XQ, XK, XV, te, lr, W, b, lns, chunk=chunk)
    Z_ref, (W_ref, b_ref) = forms.dual_step((W, b), XQ, XK, XV, te[:, None] * lr[..., None, :], lns)
    assert rel_err(Z, Z_ref) <= 1e-12 and rel_err(W_T, W_ref) <= 1e-12
    inputs = [t for t in (XQ, XK, XV, W, b, te, lr, *(lns or ())) if t is not None]
    loss = lambda z, w: (z * torch.cos(z)).sum() + w.square().sum()
    grads, grads_ref = (torch.autograd.grad(loss(z, w), inputs) for z, w in ((Z, W_T), (Z_ref, W_ref)))
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert rel_err(g, g_ref) <= 1e-10


def test_theorem_1_linear_learner_batch_gd_is_linear_attention():
    """f(x) = xW, batch GD (b = T), eta = 1/2 for l = ||.||^2 (1 for our l/2), W_0 = 0: linear attention."""
    torch.manual_seed(0)
    B, H, T, f = 2, 3, 9, 4
    q, k, v = (torch.randn(B, H, T, f) for _ in range(3))
    eta = torch.ones(B, H, 1, T, T)
    Z, _, _ = ttt_linear_dual(
        q[:, :, None], k[:, :, None], v[:, :, None], eta, torch.zeros(B, H, f, f), None, None, None
    )
    z_la, _, _ = causal_linear_attention(q, k, v)
    assert rel_err(Z[:, :, 0], z_la) <= 1e-12
    z_naive = torch.stack(
        [
            sum((q[:, :, t] * k[:, :, s]).sum(-1, keepdim=True) * v[:, :, s] for s in range(t + 1))
            for t in range(T)
        ],
        2,
    )  # sum_s v_s k_s^T q_t
    assert rel_err(z_la, z_naive) <= 1e-12


def test_theorem_2_nadaraya_watson_is_causal_softmax_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8) for _ in range(3))
    z = nadaraya_watson(q, k, v, scale=8**-0.5)
    assert rel_err(z, F.scaled_dot_product_attention(q, k, v, is_causal=True)) <= 1e-12
    # the last 4 queries against all 10 keys (decoding with a cache of 6)
    assert rel_err(nadaraya_watson(q[:, :, 6:], k, v, 8**-0.5), z[:, :, 6:]) <= 1e-12


def test_ttt_linear_dual_without_outputs_gives_the_same_final_weights():
    torch.manual_seed(0)
    B, H, N, b, f = 2, 2, 5, 3, 4
    XQ, XK, XV = (torch.randn(B, H, N, b, f) for _ in range(3))
    eta, W, bias = 0.1 * torch.rand(B, H, N, b, b), 0.3 * torch.randn(B, H, f, f), torch.randn(B, H, 1, f)
    ln = (torch.rand(H, 1, f) + 0.5, torch.randn(H, 1, f))
    _, W_last, b_last = ttt_linear_dual(XQ, XK, XV, eta, W, bias, *ln)
    Z, W_only, b_only = ttt_linear_dual(XQ, XK, XV, eta, W, bias, *ln, outputs=False)
    assert Z is None and torch.equal(W_only, W_last) and torch.equal(b_only, b_last)
