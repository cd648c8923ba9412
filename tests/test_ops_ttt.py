"""Every backend of the TTT ops (kernels/ttt/ops.py) against the token-by-token reference (`naive`) in
float64, outputs, final weights and the gradient of every input, over a grid of learners, inner models and
lengths; the Triton backend in float32 (Triton's interpreter here, the GPU on a lease) where its kernel
takes the inputs. `step` (decoding) continues a mini-batch as the whole op runs it."""

import pytest
import torch
from ttt_bench.kernels import ttt

from tests.conftest import rel_err
from ttt_bench import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = {"linear": ttt.linear, "mlp": ttt.mlp}


def _inputs(learner: str, T: int, b: int, ln: bool, bias: bool, B=1, H=2, f=16, seed=0):
    """xq, xk, xv [B, H, T, f], lr [B, H, T], token_eta [b], the weights W_0 and the inner LN, float64,
    every weight off its init."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: shift + scale * torch.randn(*s, generator=g, dtype=torch.float64)
    dims = [f, f] if learner == "linear" else [f, 4 * f, f]
    params = []
    for i, o in zip(dims, dims[1:], strict=False):
        params += [r(B, H, i, o, scale=0.3), r(B, H, 1, o, scale=0.3) if bias else None]
    norm = (r(H, 1, f, scale=0.2, shift=1.0), r(H, 1, f, scale=0.2)) if ln else None
    lr = 0.3 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    token_eta = 1 / torch.arange(1, b + 1, dtype=torch.float64) + 0.1 * torch.rand(b, generator=g)
    return [r(B, H, T, f), r(B, H, T, f), r(B, H, T, f), lr, token_eta], tuple(params), norm


def _leaves(xs, params, ln):
    return [t for t in [*xs, *params, *(ln or ())] if t is not None]


def _run(op, xs, params, ln, dtype, **kw):
    """z, final weights and the gradients of every input of a loss on both, with inputs cast to dtype."""
    cast = lambda t: None if t is None else t.detach().to(DEVICE, dtype).requires_grad_()
    xs, params = [cast(t) for t in xs], tuple(cast(p) for p in params)
    ln = None if ln is None else tuple(cast(t) for t in ln)
    z, final = op(*xs, params, ln, **kw)
    g = torch.Generator().manual_seed(1)
    weight = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    loss = (z * weight(z)).sum() + sum((w * weight(w)).sum() for w in final if w is not None)
    grads = torch.autograd.grad(loss, _leaves(xs, params, ln), allow_unused=True)
    return z, final, grads


def _close(got, want, tol):
    z, final, grads = got
    z_ref, final_ref, grads_ref = want
    assert rel_err(z.double().cpu(), z_ref) <= tol
    for w, w_ref in zip(final, final_ref, strict=True):
        assert (w is None) == (w_ref is None) and (w is None or rel_err(w.double().cpu(), w_ref) <= tol)
    for i, (gr, gr_ref) in enumerate(zip(grads, grads_ref, strict=True)):
        assert rel_err(gr.double().cpu(), gr_ref) <= tol, f"gradient of input {i}"


@pytest.mark.parametrize("learner", ["linear", "mlp"])
@pytest.mark.parametrize("T,b", [(32, 16), (20, 8), (6, 8)])  # whole mini-batches; a short last one; none
@pytest.mark.parametrize("ln,bias", [(True, True), (False, False)])
def test_the_pytorch_backends_equal_the_naive_reference(learner, T, b, ln, bias):
    xs, params, norm = _inputs(learner, T, b, ln, bias)
    ref = _run(OPS[learner], xs, params, norm, torch.float64, backend="naive")
    for backend in ("primal", "dual"):
        _close(_run(OPS[learner], xs, params, norm, torch.float64, backend=backend), ref, 1e-10)


def test_dual_runs_one_long_mini_batch_as_batch_gd():
    """b = T above dual_scan.BATCH_GD_CHUNK: the chunked batch GD, the same function."""
    xs, params, norm = _inputs("linear", 80, 80, True, True)
    _close(_run(ttt.linear, xs, params, norm, torch.float64, backend="dual"),
           _run(ttt.linear, xs, params, norm, torch.float64, backend="primal"), 1e-10)


@pytest.mark.parametrize("learner", ["linear", "mlp"])
@pytest.mark.parametrize("T", [32, 40])
def test_the_triton_backend_equals_the_naive_reference(learner, T):
    """float32 kernels (ieee matmuls), forward and backward, against float64, relative to the largest
    entry."""
    xs, params, norm = _inputs(learner, T, 16, True, True)
    ref = _run(OPS[learner], xs, params, norm, torch.float64, backend="naive")
    _close(_run(OPS[learner], xs, params, norm, torch.float32, backend="triton"), ref, 1e-4)


@pytest.mark.parametrize("learner", ["linear", "mlp"])
def test_step_continues_a_mini_batch_as_the_op_runs_it(learner):
    """Tokens fed to `step` one or a few at a time, the sums carried and the weights stepped at the end of
    each mini-batch (W = W_{t'} - token_eta[b] sums, Equation 6), give the op's outputs and weights."""
    b = 8
    xs, params, norm = _inputs(learner, 2 * b, b, True, True)
    xq, xk, xv, lr, token_eta = xs
    z_ref, final_ref = OPS[learner](*xs, params, norm, backend="naive")
    outs, weights, sums, t = [], params, None, 0
    for c in (1, 3, 4, 1, 2, 5):  # chunks within the two mini-batches
        pieces = [v[..., t : t + c, :] for v in (xq, xk, xv)] + [lr[..., t : t + c]]
        start = t % b
        z, sums = ttt.step(weights, sums, *pieces, token_eta[start : start + c], norm)
        outs.append(z)
        t += c
        if t % b == 0:
            weights = tuple(None if w is None else w - token_eta[-1] * s for w, s in zip(weights, sums,
                                                                                       strict=True))
            sums = None
    assert rel_err(torch.cat(outs, 2), z_ref) <= 1e-10
    for w, w_ref in zip(weights, final_ref, strict=True):
        assert rel_err(w, w_ref) <= 1e-10


@pytest.mark.parametrize("learner", ["linear", "mlp"])
def test_the_triton_step_equals_the_primal_step(learner):
    """One decoding token in the learner's decode kernel (float32) against the primal step (float64), the
    gradients of every input too (the kernels' backward is a PyTorch recomputation)."""
    xs, params, norm = _inputs(learner, 1, 16, True, True)
    g = torch.Generator().manual_seed(2)
    sums = tuple(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params)
    te, n = xs[4][5:6], len(params)

    def run(backend, dtype):
        cast = lambda t: t.detach().to(DEVICE, dtype).requires_grad_()
        leaves = [cast(t) for t in (*xs[:4], te, *params, *sums, *norm)]
        weights, state = tuple(leaves[5 : 5 + n]), tuple(leaves[5 + n : 5 + 2 * n])
        z, new = ttt.step(weights, state, *leaves[:5], tuple(leaves[-2:]), backend=backend)
        loss = z.sum() + sum(s.square().sum() for s in new)
        return [z, *new], torch.autograd.grad(loss, leaves)

    (outs, grads), (outs_ref, grads_ref) = run("triton", torch.float32), run("primal", torch.float64)
    for got, want in zip([*outs, *grads], [*outs_ref, *grads_ref], strict=True):
        assert rel_err(got.double().cpu(), want) <= 1e-4


def test_prefill_backends_agree():
    """linear_prefill, token-major: the Triton kernel (float32 inputs, ieee matmuls) and its PyTorch
    reference (float64) give the same outputs and final weights; both equal the op's naive reference."""
    xs, (W, bias), norm = _inputs("linear", 40, 16, True, True)
    xq, xk, xv, lr, token_eta = xs
    tokens = lambda t: t.transpose(1, 2)  # [B, T, H, f]
    ref = ttt.linear_prefill(*map(tokens, (xq, xk, xv)), lr, W, bias, *norm, token_eta, backend="torch")
    z_naive, final = ttt.linear(*xs, (W, bias), norm, backend="naive")
    assert rel_err(tokens(ref[0]), z_naive) <= 1e-10
    assert rel_err(ref[1], final[0]) <= 1e-10 and rel_err(ref[2], final[1]) <= 1e-10
    f32 = lambda t: t.to(DEVICE, torch.float32)
    got = ttt.linear_prefill(*(f32(tokens(t)) for t in (xq, xk, xv)), f32(lr), f32(W), f32(bias),
                             *map(f32, norm), f32(token_eta), backend="triton", precision="ieee")
    for g_, r_ in zip(got, ref, strict=True):
        assert rel_err(g_.double().cpu(), r_) <= 1e-4


def test_a_backend_the_op_lacks_says_which_it_has():
    xs, params, norm = _inputs("linear", 16, 16, True, True)
    for call, name in ((lambda: ttt.linear(*xs, params, norm, backend="fla"), "naive"),
                       (lambda: ttt.step(params, None, *xs[:4], xs[4], norm, backend="dual"), "primal"),
                       (lambda: ttt.linear_prefill(*xs[:4], *params, *norm, xs[4], backend="x"), "torch")):
        with pytest.raises(ValueError, match=f"backend must be one of .*{name}"):
            call()
    assert kernels.HAS_TRITON
