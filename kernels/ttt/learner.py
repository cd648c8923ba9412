"""Learners of a TTT layer (Figure 9): an inner model f with weights W, and its self-supervised loss.

Parametric learners are stacks of K layers acting on row vectors (tokens are rows, so the paper's Wx is
`x @ W` here), as in Appendix A.1:

    Z^k = X^k W^k + b^k,    X^{k+1} = gelu(Z^k) for k < K,    f_res(x) = Z^K

K=1 is TTT-Linear (f_lin, W square per head) and K=2 is TTT-MLP (hidden 4x, GELU). With `ln_residual`,
f(x) = x + LN(f_res(x)) (Section 2.7). Weights are a flat tuple `params = (W^1, b^1, ..., W^K, b^K)` with
shapes [B, H, d_in, d_out] and [B, H, 1, d_out]; a bias may be None (the plain f(x) = Wx of Theorem 1).
`ln` is the pair (weight, bias) of the per-head LayerNorm, each [H, 1, f], or None without LN-and-residual.

Inner loss, Equation 4: l(W; x_t) = ||f(theta_K x_t; W) - theta_V x_t||^2. Gradients use l/2 as in
Appendix A; the 1/2 and the authors' division of eta by the head dimension live in the learning rate
(see layer.py). With the residual form of f, the label of f_res is theta_V x_t - theta_K x_t.

The nonparametric learner (Theorem 2) is `nadaraya_watson`: its hidden state is the list of (k, v).
"""

import copy
import math

import torch
import torch.nn.functional as F

from ..fusion import fuse

Params = tuple  # (W^1, b^1, ..., W^K, b^K)
LN_EPS = 1e-6


GELU_C = 2 * math.sqrt(2.0 / math.pi)  # gelu(x) = x sigmoid(GELU_C (x + GELU_A x^3))
GELU_A = 0.044715


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, as the authors' code: 0.5 x (1 + tanh(c (x + 0.044715 x^3))), computed as
    x sigmoid(2 c (x + 0.044715 x^3)), the same function, which is 2x faster than F.gelu(approximate="tanh")
    on CPUs."""
    return x * torch.sigmoid(x * (GELU_C + GELU_A * GELU_C * x * x))


def gelu_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu(x) and gelu'(x) from one sigmoid s = sigmoid(v), v = C (x + A x^3): gelu' = s + x s (1 - s) v'.
    For the dual scans' hand-written backward (in-place ops on its temporaries: not differentiable)."""
    xx = x * x
    s = torch.sigmoid(xx.mul(GELU_A * GELU_C).add_(GELU_C).mul_(x))
    ds = s - s * s
    return x * s, xx.mul_(3 * GELU_A * GELU_C).add_(GELU_C).mul_(ds).mul_(x).add_(s)


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d gelu(x) / dx, written out so that it can itself be differentiated by the outer loop."""
    c = math.sqrt(2.0 / math.pi)
    tanh = torch.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * (1 + tanh) + 0.5 * x * (1 - tanh**2) * c * (1 + 3 * 0.044715 * x**2)


def gelu_grad2(x: torch.Tensor) -> torch.Tensor:
    """d^2 gelu(x) / dx^2 (the TTT-MLP dual form's backward needs it): with t = tanh(u),
    u = c (x + 0.044715 x^3), it is (1 - t^2) (u' - x t u'^2 + x u'' / 2). In-place ops on its temporaries:
    not differentiable."""
    c, a = math.sqrt(2.0 / math.pi), GELU_A
    xx = x * x
    tanh = torch.tanh(xx.mul(a * c).add_(c).mul_(x))
    du = xx.mul(3 * a * c).add_(c)
    rest = (x * tanh).mul_(du).mul_(du).neg_().add_(du).add_(xx, alpha=3 * a * c)
    return tanh.square_().neg_().add_(1).mul_(rest)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the last axis with per-head weight and bias [H, 1, f]."""
    return torch.addcmul(bias, weight, F.layer_norm(x, x.shape[-1:], eps=LN_EPS))


def layer_norm_l2_grad(z: torch.Tensor, target: torch.Tensor, weight, bias) -> torch.Tensor:
    """Gradient wrt z of 1/2 ||LN(z) - target||^2: LayerNorm's backward fused with the L2 loss, written out
    (differentiable by autograd; `ln_l2_grad` is the fast equivalent)."""
    z = z - z.mean(-1, keepdim=True)
    rstd = torch.rsqrt(z.square().mean(-1, keepdim=True) + LN_EPS)
    z_hat = z * rstd
    g0 = (weight * z_hat + bias - target) * weight  # d loss / d z_hat
    return (g0 - g0.mean(-1, keepdim=True) - z_hat * (g0 * z_hat).mean(-1, keepdim=True)) * rstd


def ln_backward(dy, z, mean, rstd):
    """LayerNorm's backward without affine parameters, rstd (dy - mean(dy) - z_hat mean(dy z_hat)): the
    Jacobian of z -> z_hat, which is symmetric."""
    return torch.ops.aten.native_layer_norm_backward(
        dy, z, z.shape[-1:], mean, rstd, None, None, [True, False, False]
    )[0]


def ln_l2_grad(z: torch.Tensor, w2: torch.Tensor | None, c: torch.Tensor) -> torch.Tensor:
    """`layer_norm_l2_grad` from LayerNorm's own kernels, with its z-independent parts given: w2 = weight^2
    and c = (bias - target) * weight. Without LN (w2 None) the plain L2 gradient z - c."""
    if w2 is None:
        return z - c
    z_hat, mean, rstd = torch.native_layer_norm(z, z.shape[-1:], None, None, LN_EPS)
    return ln_backward(torch.addcmul(c, w2, z_hat), z, mean, rstd)  # g0 = d loss / d z_hat


class LNL2GradBackward:
    """The backward of g = ln_l2_grad(z, w2, c): the gradients of <dg, g> wrt z and c, and the elementwise
    terms dc * z_hat of the gradient wrt w2 (summed by the caller).

    With J the LN Jacobian (`ln_backward`), g = J g0 and g0 = c + w2 z_hat, so dc = J dg and
    dz = J (w2 dc - s <z_hat, g0> dg - s <dg, z_hat> g0) - s <dg, g> z_hat with s = rstd / f: the first
    term through g0, the others through J's own dependence on z. What does not depend on dg is computed once
    here, for z of any leading shape; `rows()` splits it along the leading axis (the fast dual scan builds
    it for all mini-batches and back-propagates one at a time). Without LN (w2 None), g = z - c."""

    def __init__(self, z, g, w2, c, fused: bool = False):
        self.z, self.g, self.w2 = z, g, w2
        if w2 is not None:  # fused: compiled by torch.compile (fusion.fuse)
            stats = fuse(LNL2GradBackward.statistics, fused)(z, w2, c)
            self.z_hat, self.mean, self.rstd, self.g0, self.s_z_hat, self.k = stats

    @staticmethod
    def statistics(z, w2, c):
        """z_hat, mean, rstd of LN at z, g0, s z_hat and k = s <z_hat, g0>."""
        z_hat, mean, rstd = torch.native_layer_norm(z, z.shape[-1:], None, None, LN_EPS)
        g0 = torch.addcmul(c, w2, z_hat)
        s_z_hat = z_hat * (rstd / z.shape[-1])
        return z_hat, mean, rstd, g0, s_z_hat, torch.linalg.vecdot(s_z_hat, g0).unsqueeze(-1)

    def rows(self) -> list["LNL2GradBackward"]:
        """One per index of the leading axis, its tensors' views made at once (a loop indexing each tensor
        per step pays Python's indexing every time)."""
        names = [name for name in vars(self) if name != "w2"]
        rows = []
        for views in zip(*(getattr(self, name).unbind(0) for name in names), strict=True):
            row = copy.copy(self)  # the statistics as they are, not computed again: only their rows
            vars(row).update(zip(names, views, strict=True))
            rows.append(row)
        return rows

    def dc(self, dg):
        return -dg if self.w2 is None else ln_backward(dg, self.z, self.mean, self.rstd)

    def dz(self, dg, dc=None):
        if self.w2 is None:
            return dg
        dot = lambda a, b: torch.linalg.vecdot(a, b).unsqueeze(-1)
        v = (self.w2 * (self.dc(dg) if dc is None else dc)).addcmul_(self.k, dg, value=-1)
        v.addcmul_(dot(dg, self.s_z_hat), self.g0, value=-1)
        dz = ln_backward(v, self.z, self.mean, self.rstd)
        return dz.addcmul_(dot(dg, self.g), self.s_z_hat, value=-1)

    def dw2_terms(self, dc):
        return None if self.w2 is None else dc * self.z_hat


def n_layers(params: Params) -> int:
    return len(params) // 2


def forward(params: Params, x: torch.Tensor, per_token: bool = False) -> tuple[list, list]:
    """Appendix A.1: the inputs X^k and pre-activations Z^k of every layer. With `per_token`, weights
    carry an extra token axis ([B, H, c, d_in, d_out], the primal form's W_t) matching x's [B, H, c, d_in]."""
    xs, zs = [], []
    for k in range(n_layers(params)):
        W, b = params[2 * k], params[2 * k + 1]
        z = torch.einsum("...ti,...tio->...to", x, W) if per_token else x @ W
        if b is not None:
            z = z + b
        xs.append(x)
        zs.append(z)
        x = gelu(z)
    return xs, zs


def predict(params: Params, x: torch.Tensor, ln, per_token: bool = False) -> torch.Tensor:
    """f(x; W): Equation 5's output rule when x is the test view."""
    z = forward(params, x, per_token)[1][-1]
    return x + layer_norm(z, *ln) if ln is not None else z


def loss(params: Params, xk: torch.Tensor, xv: torch.Tensor, ln, per_token: bool = False) -> torch.Tensor:
    """Equation 4 per token, summed over features: [B, H, c]."""
    return (predict(params, xk, ln, per_token) - xv).pow(2).sum(-1)


def grads(params: Params, xk: torch.Tensor, xv: torch.Tensor, ln) -> tuple[list, list]:
    """Per-token gradient factors of l/2 at `params` (Appendix A.3, the standard backward pass).

    Returns X^k and G^k = dl/dZ^k for every layer, each [B, H, c, .]: token t's gradient wrt W^k is the
    outer product x_t^k (g_t^k)^T and wrt b^k it is g_t^k. The dual form never forms those products.
    """
    xs, zs = forward(params, xk)
    if ln is not None:  # f(x) = x + LN(f_res(x)), so f_res learns the label theta_V x - theta_K x
        g = layer_norm_l2_grad(zs[-1], xv - xk, *ln)
    else:
        g = zs[-1] - xv
    gs = [g]
    for k in range(n_layers(params) - 1, 0, -1):
        g = (g @ params[2 * k].transpose(-1, -2)) * gelu_grad(zs[k - 1])
        gs.insert(0, g)
    return xs, gs


def nadaraya_watson(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Equations 9-10: z_t = sum_s kappa(q_t, k_s) y_s / sum_s kappa(q_t, k_s) over the tokens s seen so far,
    with the kernel kappa(q, k) = exp(scale * q.k) and labels y_s = v_s. The queries q [B, H, T, f] are the
    last T tokens of the S keys k and values v [B, H, S, f]."""
    logits = scale * q @ k.transpose(-1, -2)  # [B, H, T, S]
    T, S = logits.shape[-2:]
    visible = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    logits = logits.masked_fill(~visible, float("-inf"))
    kappa = torch.exp(logits - logits.amax(-1, keepdim=True))  # the kernel up to a per-query constant
    return (kappa @ v) / kappa.sum(-1, keepdim=True)
