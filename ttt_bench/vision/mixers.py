"""Token mixers of the MTTT ViT: the TTT layer (MTTT-Linear, MTTT-MLP) and the attention layers it is compared
with (identity-map / Katharopoulos linear attention, softmax self-attention, the Nadaraya-Watson learner).

Every mixer maps x [B, N, d] (the LayerNorm'ed block input) to [B, N, d] and is non-causal: every token of an
image sees every other (the inner-loop dataset is the whole image, Section 2.1 of the MTTT paper).

The TTT layer (Sections 2-4, Appendix B; per head h = 1..H, d_h = d / H):

    inner loss  l(W; X) = 1/(2 n d_h) sum_i || LN_dec(g(f(phi(x_i); W))) - x_i ||^2          (Eq. 1)
    inner step  W_t = W_{t-1} - eta grad_W l(W_{t-1}; X_t),  eta = 1                          (Eq. 2)
    output      z_j = sum_h h_h(f(psi_h(x_j); W_T^h)) + b_h                                    (Eq. 3)

phi_h, psi_h: d -> d_h (with bias), g_h: d_h -> d (no bias, one bias g_b shared by the heads), h_h: d_h -> d
(summed over heads, one bias): the shapes of the authors' code. The loss is divided by n x d_h rather than
the paper's n: the authors' normaliser (`mean() * num_heads`), the same N x d/H by which identity-map linear
attention divides (`normalizer = 'constant'`), so that MTTT-Linear with T = 1 *is* that linear attention
(Section 4.1, tests/test_mttt.py). X_t is the whole image (full-batch GD) or, with `sgd`, the t-th of T
random disjoint mini-batches of n / T tokens (Section 5, "Inner-loop optimization").

The inner gradient is taken with autograd and `create_graph=True`, so the outer loss backpropagates through
the T inner steps (second order, Section 3); ttt_bench/vision/reference.py has a naive per-token version to
test it against.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ..errors import UserError


def uniform_(t: torch.Tensor, fan_in: int, fan_out: int | None = None) -> torch.Tensor:
    """Variance-scaling uniform init: fan_out given -> Xavier (Glorot) uniform, else 1/fan_in (LeCun)."""
    scale = 2.0 / (fan_in + fan_out) if fan_out else 1.0 / fan_in
    return nn.init.uniform_(t, -math.sqrt(3 * scale), math.sqrt(3 * scale))


class HeadLinear(nn.Module):
    """H independent linear maps in_dim -> out_dim applied to the same input: [B, N, in] -> [B, H, N, out]
    (phi and psi), or ([B, H, N, in] -> [B, H, N, out] with `per_head_input`: g and h)."""

    def __init__(
        self, heads: int, in_dim: int, out_dim: int, bias: bool, per_head_input: bool = False, fan: str = "in"
    ):
        super().__init__()
        self.per_head_input = per_head_input
        self.weight = nn.Parameter(torch.empty(heads, in_dim, out_dim))
        uniform_(self.weight, in_dim if fan == "in" else out_dim)  # the authors' vs_fan_in / vs_fan_out
        self.bias = nn.Parameter(torch.zeros(heads, out_dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eq = "bhni,hio->bhno" if self.per_head_input else "bni,hio->bhno"
        y = torch.einsum(eq, x, self.weight)
        return y if self.bias is None else y + self.bias[:, None, :]


class MTTTLayer(nn.Module):
    """The TTT layer of MTTT.

    - `encoder`: `linear` (f(x) = xW, MTTT-Linear) or `mlp` (f(x) = GELU(xW1 + b1)W2 + b2, hidden 4 d_h,
      MTTT-MLP);
    - `steps`: T inner steps; `sgd`: T random mini-batches of n / T tokens instead of T full-batch steps;
    - `decoder_ln`: LayerNorm (per head, over d) on g's output (Figure 2);
    - `learned_w0`: W_0 is an outer-loop parameter; otherwise a frozen buffer (zeros for `linear`, its
      random init for `mlp`).

    After every forward, `inner_losses` holds [T + 1] values (detached, mean over the batch, summed over
    heads as the authors log them): the loss of the data of step t at W_{t-1}, t = 1..T, then l(W_T; X) on
    all tokens."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        encoder: str = "mlp",
        steps: int = 1,
        sgd: bool = False,
        decoder_ln: bool = True,
        learned_w0: bool = True,
        inner_bias: bool | None = None,
        eta: float = 1.0,
        expansion: int = 4,
    ):
        super().__init__()
        if encoder not in ("linear", "mlp"):
            raise UserError(f"model.mixer.encoder={encoder!r} is not an inner learner; use linear or mlp")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise UserError(f"model.mixer.steps={steps!r} must be an integer >= 1 (T, the inner-loop steps)")
        if d_model % n_heads:
            raise UserError(f"size.n_heads={n_heads} does not divide size.d_model={d_model}")
        self.d, self.H, self.dh = d_model, n_heads, d_model // n_heads
        self.encoder, self.steps, self.sgd, self.eta = encoder, steps, sgd, eta
        self.inner_bias = encoder == "mlp" if inner_bias is None else inner_bias
        H, d, dh = self.H, self.d, self.dh
        self.psi = HeadLinear(H, d, dh, bias=True)
        self.phi = HeadLinear(H, d, dh, bias=True)
        self.g = HeadLinear(H, dh, d, bias=False, per_head_input=True, fan="out")
        self.g_bias = nn.Parameter(torch.zeros(d))
        self.h = HeadLinear(H, dh, d, bias=False, per_head_input=True, fan="out")
        self.h_bias = nn.Parameter(torch.zeros(d))
        self.decoder_ln = decoder_ln
        if decoder_ln:
            self.ln_weight, self.ln_bias = nn.Parameter(torch.ones(H, d)), nn.Parameter(torch.zeros(H, d))
        # W_0: the initial weights of f, one set per head
        shapes = (
            {"w1": (H, dh, dh)}
            if encoder == "linear"
            else {"w1": (H, dh, expansion * dh), "w2": (H, expansion * dh, dh)}
        )
        init = {}
        for name, shape in shapes.items():
            w = torch.zeros(shape)
            if encoder == "mlp":
                uniform_(w, shape[1], shape[2])  # Xavier uniform, the authors' inner_encoder_init
            init[name] = w
            if self.inner_bias:
                init[name.replace("w", "b")] = torch.zeros(H, shape[2])
        self.w0_names = list(init)
        for name, value in init.items():
            if learned_w0:
                self.register_parameter(name, nn.Parameter(value))
            else:
                self.register_buffer(name, value)
        self.learned_w0 = learned_w0
        self.inner_losses: torch.Tensor | None = None
        # weight decay on weight matrices only, as the authors' (`.*/kernel$`): not on the per-head biases,
        # the Decoder LN, nor W_0's biases, which are 2-d here only because they are stacked over heads
        for name, p in self.named_parameters():
            if name.endswith("bias") or name.startswith("ln_") or name in ("b1", "b2"):
                p._no_weight_decay = True

    # -- the inner model f, the decoder g, the inner loss --------------------------------------------------
    def f(self, z: torch.Tensor, W: dict) -> torch.Tensor:
        """f(z; W) for z [B, H, n, d_h] and per-example, per-head weights W[name] [B, H, ...]."""
        y = z @ W["w1"] + (W["b1"][:, :, None] if "b1" in W else 0)
        if self.encoder == "mlp":
            y = F.gelu(y) @ W["w2"] + (W["b2"][:, :, None] if "b2" in W else 0)
        return y

    def reconstruct(self, z: torch.Tensor, W: dict) -> torch.Tensor:
        """LN_dec(g(f(phi x; W))) [B, H, n, d] from the inner inputs z = phi(x) [B, H, n, d_h]."""
        y = self.g(self.f(z, W)) + self.g_bias
        if self.decoder_ln:
            y = F.layer_norm(y, (self.d,)) * self.ln_weight[:, None] + self.ln_bias[:, None]
        return y

    def inner_loss(self, z: torch.Tensor, x: torch.Tensor, W: dict) -> torch.Tensor:
        """Eq. 1 per example and head [B, H]: 1/(2 n d_h) sum_i ||LN_dec(g(f(z_i))) - x_i||^2,
        x [B, H, n, d]."""
        n = z.shape[2]
        return 0.5 * (self.reconstruct(z, W) - x).pow(2).sum((2, 3)) / (n * self.dh)

    def initial_weights(self, batch: int) -> dict:
        """W_0 for every example: [B, H, ...]. A frozen W_0 becomes a leaf that requires grad, for the inner
        gradient only (nothing flows back to it)."""
        W = {}
        for name in self.w0_names:
            w = getattr(self, name).unsqueeze(0).expand(batch, *getattr(self, name).shape)
            W[name] = w if self.learned_w0 else w.detach().clone().requires_grad_(True)
        return W

    def inner_batches(self, z: torch.Tensor, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The data (phi x, x) of each inner step: the whole image T times, or T random disjoint
        mini-batches (in training from the global generator, seeded per run; in evaluation from a fixed
        seed, so evaluating a checkpoint gives the same accuracy whatever ran before it)."""
        if not self.sgd:
            return [(z, x)] * self.steps
        B, H, n, _ = z.shape
        if n % self.steps:
            raise UserError(
                f"inner SGD splits the {n} tokens into model.mixer.steps={self.steps} mini-batches; "
                "pick steps that divide the number of tokens"
            )
        generator = None if self.training else torch.Generator(z.device).manual_seed(0)
        order = torch.argsort(  # one shuffle per example and head
            torch.rand(B, H, n, device=z.device, generator=generator), dim=-1
        )
        zs = torch.gather(z, 2, order[..., None].expand(-1, -1, -1, z.shape[-1])).chunk(self.steps, dim=2)
        xs = torch.gather(x, 2, order[..., None].expand(-1, -1, -1, x.shape[-1])).chunk(self.steps, dim=2)
        return list(zip(zs, xs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        z = self.phi(x)  # inner inputs phi(x_i) [B, H, n, d_h]
        target = x.unsqueeze(1).expand(B, self.H, *x.shape[1:])  # reconstruction targets x_i, per head
        losses = []
        outer_graph = torch.is_grad_enabled()  # training: keep the inner steps differentiable (second order)
        with torch.enable_grad():  # the inner loop takes gradients even under no_grad (evaluation)
            W = self.initial_weights(B)
            for zt, xt in self.inner_batches(z, target):
                loss = self.inner_loss(zt, xt, W)  # [B, H]
                grads = torch.autograd.grad(loss.sum(), list(W.values()), create_graph=outer_graph)
                W = {k: w - self.eta * gw for (k, w), gw in zip(W.items(), grads)}  # Eq. 2
                losses.append(loss.detach().sum(1).mean())
            if not outer_graph:
                W = {k: w.detach() for k, w in W.items()}
        with torch.no_grad():
            losses.append(self.inner_loss(z, target, W).sum(1).mean())
        self.inner_losses = torch.stack(losses)
        out = self.h(self.f(self.psi(x), W))  # Eq. 3, [B, H, n, d]
        return out.sum(1) + self.h_bias


class LinearAttention(nn.Module):
    """Non-causal linear attention (Katharopoulos et al., 2020; Appendix A of the MTTT paper), per head:

        z_j = q_j (sum_i k_i^T v_i) / normaliser

    `feature_map`: `identity` or `elu` (elu + 1 on q and k). `normalizer`: `constant` (N x d/H, the authors'
    identity-map baseline, the one MTTT-Linear equals) or `adaptive` (q_j . sum_i k_i, Katharopoulos')."""

    def __init__(
        self, d_model: int, n_heads: int, feature_map: str = "identity", normalizer: str = "constant"
    ):
        super().__init__()
        if feature_map not in ("identity", "elu") or normalizer not in ("constant", "adaptive"):
            raise UserError(
                f"linear attention takes feature_map identity|elu and normalizer constant|adaptive, "
                f"got {feature_map!r}, {normalizer!r}"
            )
        self.H, self.feature_map, self.normalizer = n_heads, feature_map, normalizer
        d, H, dh = d_model, n_heads, d_model // n_heads
        self.q, self.k, self.v, self.proj = (skip_init(nn.Linear, d, d) for _ in range(4))
        # MTTTLayer's draws (psi, phi, g, h: the same order, shapes and bounds, laid out as q, k, v, proj as
        # in Eq. 11), so that with one seed the identity map starts from MTTT-Linear's function and the two
        # rows of MTTT Table 1 are paired (tests/test_mttt.py); Xavier uniform on each d x d matrix, as before
        with torch.no_grad():
            self.q.weight.copy_(uniform_(torch.empty(H, d, dh), d).permute(0, 2, 1).reshape(d, d))
            self.k.weight.copy_(uniform_(torch.empty(H, d, dh), d).permute(0, 2, 1).reshape(d, d))
            self.v.weight.copy_(uniform_(torch.empty(H, dh, d), d).reshape(d, d))
            self.proj.weight.copy_(uniform_(torch.empty(H, dh, d), d).reshape(d, d).T)
            for lin in (self.q, self.k, self.v, self.proj):
                lin.bias.zero_()

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.H, -1)).transpose(1, 2)  # [B, H, N, d_h]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.feature_map == "elu":
            q, k = F.elu(q) + 1, F.elu(k) + 1
        q, k, v = self.heads(q), self.heads(k), self.heads(v)
        y = q @ (k.transpose(-1, -2) @ v)  # [B, H, N, d_h]: the k^T v sum once, linear in N
        if self.normalizer == "constant":
            y = y / (v.shape[-2] * v.shape[-1])
        else:
            y = y / (q @ k.sum(-2, keepdim=True).transpose(-1, -2))
        return self.proj(y.transpose(1, 2).flatten(2))


class SelfAttention(nn.Module):
    """Softmax self-attention, non-causal (the ViT's), through scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.H = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        for lin in (self.qkv, self.proj):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.H, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(self.mix(q, k, v).transpose(1, 2).flatten(2))


class NadarayaWatson(SelfAttention):
    """TTT with the Nadaraya-Watson estimator as the inner learner (Section 4.2, Eqs. 12-13): labels
    z_i = theta_V x_i and f(x) = sum_i kappa(x, x_i) z_i / sum_i kappa(x, x_i), with the asymmetric kernel
    kappa(x, x') = exp((theta_K x')^T theta_Q x / sqrt(d_h)) over every token of the image. Written as the
    estimator, without softmax; the same parameters and function as `SelfAttention` (tests/test_mttt.py)."""

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        kernel = torch.exp(logits - logits.amax(-1, keepdim=True).detach())  # kappa up to a constant per x
        return (kernel @ v) / kernel.sum(-1, keepdim=True)
