"""The TTT layer (Section 2) and its two backbones (Figure 16).

TTTLayer: multi-head views theta_K x, theta_V x, theta_Q x (Section 2.3), RoPE on Q/K over the position
within the mini-batch (as the authors' code), the inner loop of learner.py/forms.py with the learnable
inner learning rate eta(x) (Section 2.7), then LayerNorm (post-norm, the LN before O of NormFormer), an
optional GELU gate, and the output projection O.

TTTBlock: Transformer backbone  x + TTT(RMSNorm(x)), then x + SwiGLU(RMSNorm(x));
          Mamba backbone        first x + Conv(RMSNorm(x)) (a temporal causal conv), and in the TTT layer
                                theta_K, theta_Q share one projection followed by separate causal convs,
                                and the output is gated by GELU(theta_G x).

Decoding: a TTTCache holds W_{t'} (the weights at the end of the last complete mini-batch), the sums of
the gradients of the current incomplete mini-batch, the conv states and the position. Complete
mini-batches run in `form` (dual by default); the tokens of an incomplete one run in primal form.
"""

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ...errors import UserError
from ...kernels import ttt
from ...kernels.fusion import fuse
from ...kernels.ttt import forms, learner
from ..cost import arguments, causal_attention_flops, swiglu_flops
from ..graphs import StaticCache
from ..layers import CausalConv1d, RMSNorm, SwiGLU, apply_rope_pairs, rope_freq_table
from . import kernel_check

LEARNERS = ("linear", "mlp", "kernel")


@dataclass
class TTTCache(StaticCache):
    params: tuple | None = None  # W_{t'}, [B, H, ...] per weight; None: theta_init
    sums: tuple | None = None  # sum_s lr_s G_s over the tokens of the incomplete mini-batch
    pos: int = 0  # tokens seen
    conv: dict = field(default_factory=dict)  # the last conv_kernel - 1 inputs of each causal conv
    kv: tuple | None = None  # the kernel learner's training set: all keys and values seen
    mini_batch_size: int = 1

    def graph_key(self):
        """A step's path depends on the position in the mini-batch (a graph each) and on whether a state
        exists yet (models/graphs.py)."""
        if self.kv is not None:
            raise UserError("the kernel learner's training set grows with every token: "
                            "it decodes eagerly only")
        return self.pos % self.mini_batch_size, self.params is None, self.sums is None

    def advance(self, n: int) -> None:
        self.pos += n

    def period(self) -> int:
        return self.mini_batch_size


def gelu_gate(g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The output gate of the Mamba backbone, GELU(theta_G x) * z (GELU's tanh approximation)."""
    return F.gelu(g, approximate="tanh") * z


def at_least_f32(t: torch.Tensor) -> torch.Tensor:
    """The inner loop's state and step sizes in float32 at least, also in a model cast to bfloat16."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class TTTLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        learner: str = "linear",
        mini_batch_size: int = 16,
        form: str = "dual",
        ln_residual: bool = True,
        inner_bias: bool = True,
        learnable_w0: bool = True,
        learnable_lr: bool = True,
        eta_base: float = 1.0,
        eta_warmup: bool = False,
        token_scaling: str = "learnable",
        rope: bool = True,
        rope_theta: float = 10_000.0,
        checkpoint_every: int = 0,
        share_qk: bool = False,
        use_gate: bool = False,
        conv_kernel: int = 4,
        mlp_expansion: int = 4,
        kernel: str = "auto",
        fused: bool = False,
    ):
        super().__init__()
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model} into an even head dimension")
        if (
            learner not in LEARNERS
            or form not in forms.STEPS
            or token_scaling not in ("none", "fixed", "learnable")
        ):
            raise ValueError(f"unknown learner={learner!r}, form={form!r} or token_scaling={token_scaling!r}")
        if kernel not in kernel_check.BACKENDS:
            raise ValueError(f"kernel must be one of {kernel_check.BACKENDS}, got {kernel!r}")
        if mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be positive, got {mini_batch_size}")
        self.layer_idx = 0  # set by the block; names the layer in diagnostics
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.learner, self.form, self.mini_batch_size = learner, form, mini_batch_size
        self.ln_residual, self.learnable_w0, self.learnable_lr = ln_residual, learnable_w0, learnable_lr
        self.eta_base, self.eta_warmup, self.eta_scale = eta_base, eta_warmup, 1.0
        self.rope, self.rope_theta, self.checkpoint_every = rope, rope_theta, checkpoint_every
        self.share_qk, self.diagnostics = share_qk, None
        # auto | torch | triton: the Triton kernels of TTT-Linear (docs/speed.md), and TTT-MLP's forward
        self.kernel = kernel
        # torch.compile fuses elementwise work: the dual forms (TTT-MLP: a mini-batch's state), gate, convs
        self.fused = fused

        # The views of the self-supervised task (Section 2.3); with share_qk, one projection and two convs.
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        if share_qk:
            self.conv_q, self.conv_k = (CausalConv1d(d_model, conv_kernel, fused=fused) for _ in range(2))
        else:
            self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.g_proj = nn.Linear(d_model, d_model, bias=False) if use_gate else None
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.post_norm = nn.LayerNorm(d_model, eps=1e-6)

        H, f = n_heads, self.head_dim
        if learner != "kernel":
            # eta(x) = eta_base * sigmoid(theta_lr . x) per head (Section 2.7)
            self.lr_weight = nn.Parameter(torch.zeros(H, 1, d_model)) if learnable_lr else None
            self.lr_bias = nn.Parameter(torch.zeros(H, 1)) if learnable_lr else None
            # the i-th token of a mini-batch scales its summed gradients by 1/i (+ a learned offset, >= 0)
            scale = (
                1.0 / torch.arange(1, mini_batch_size + 1)
                if token_scaling != "none"
                else torch.ones(mini_batch_size)
            )
            self.register_buffer("token_idx", scale, persistent=False)
            self.token_idx_offset = (
                nn.Parameter(torch.zeros(mini_batch_size)) if token_scaling == "learnable" else None
            )
            self.ttt_norm_weight = nn.Parameter(torch.ones(H, f)) if ln_residual else None
            self.ttt_norm_bias = nn.Parameter(torch.zeros(H, f)) if ln_residual else None
            # W_0 = theta_init (Section 2.7), or 0; per head, one (W, b) per layer of f
            dims = self._dims(f, learner, mlp_expansion)
            for k in range(len(dims) - 1):
                W, b = (
                    torch.zeros(H, dims[k], dims[k + 1]),
                    torch.zeros(H, 1, dims[k + 1]) if inner_bias else None,
                )
                register = self.register_parameter if learnable_w0 else self.register_buffer
                register(f"W{k + 1}", nn.Parameter(W) if learnable_w0 else W)
                register(f"b{k + 1}", nn.Parameter(b) if learnable_w0 and inner_bias else b)
            # biases and norms stored as matrices (the authors' shapes) get no weight decay either
            for name in ("lr_bias", "ttt_norm_weight", "ttt_norm_bias", "b1", "b2"):
                if isinstance(getattr(self, name, None), nn.Parameter):
                    getattr(self, name)._no_weight_decay = True
        self.init_special_parameters()

    @staticmethod
    def _dims(head_dim: int, learner: str, mlp_expansion: int) -> list[int]:
        """The widths of the inner model f, per head: f -> f (linear), f -> m f -> f (mlp)."""
        return [head_dim, head_dim] if learner == "linear" else [head_dim, mlp_expansion * head_dim, head_dim]

    @staticmethod
    def flops_per_token(seq_len: int, d_model: int, n_heads: int, learner: str, mini_batch_size: int,
                        form: str, inner_bias: bool, learnable_lr: bool, checkpoint_every: int,
                        share_qk: bool, use_gate: bool, conv_kernel: int, mlp_expansion: int, **_) -> dict:
        """The views Q, V, O (+ K unless share_qk, + the gate G with use_gate) and share_qk's two convs;
        across time, the inner loop over mini-batches of b tokens, or for the kernel learner causal
        attention."""
        d, H = d_model, n_heads
        views = 3 + (not share_qk) + use_gate
        dense = views * 2.0 * d * d + (2 * 2.0 * d * conv_kernel if share_qk else 0.0)
        if learner == "kernel":
            return {"dense": dense, "sequence": causal_attention_flops(d, seq_len)}
        dims = TTTLayer._dims(d // H, learner, mlp_expansion)
        layers = list(zip(dims, dims[1:]))
        b = min(mini_batch_size, seq_len)
        n, rest = divmod(seq_len, b)
        per_head = n * forms.chunk_flops(layers, b, form, inner_bias)
        per_head += forms.chunk_flops(layers, rest, form, inner_bias) if rest else 0.0
        sequence = H * per_head / seq_len
        if learnable_lr:
            sequence += 2.0 * d * H  # eta(x) = eta_base sigmoid(theta_lr . x), one per head
        # checkpointing through time runs the inner loop's forward once more in the backward
        return {"dense": dense, "sequence": sequence, "recompute": sequence if checkpoint_every else 0.0}

    @staticmethod
    def state_floats(seq_len: int, d_model: int, n_heads: int, learner: str, mini_batch_size: int,
                     inner_bias: bool, share_qk: bool, conv_kernel: int, mlp_expansion: int, **_) -> dict:
        """The kernel learner (Theorem 2) is attention: its KV cache, 2 x seq_len x d_model. TTT-Linear:
        W1 (H x f x f) and b1 (H x f, with inner_bias); TTT-MLP: W1 (H x f x m f), b1 (H x m f),
        W2 (H x m f x f), b2 (H x f), m = mlp_expansion. Besides the weights W_t', the cache holds
          * the pending gradient sums of an unfinished mini-batch (same shapes as the weights): counted, as
            the cache keeps them, when seq_len is not a multiple of the mini-batch size b (between
            mini-batch ends a decoder carries W_t' and the sums, up to twice the weights);
          * with share_qk, the last conv_kernel - 1 inputs of the Q and K convs:
            2 x (conv_kernel - 1) x d_model.
        """
        if learner == "kernel":
            out = {"kv_cache": 2 * seq_len * d_model}
        else:
            dims = TTTLayer._dims(d_model // n_heads, learner, mlp_expansion)
            weights = {}
            for k in range(len(dims) - 1):
                weights[f"W{k + 1}"] = n_heads * dims[k] * dims[k + 1]
                if inner_bias:
                    weights[f"b{k + 1}"] = n_heads * dims[k + 1]
            out = dict(weights)
            if seq_len % mini_batch_size:
                out.update({f"pending_{k}": v for k, v in weights.items()})
        if share_qk:
            out["conv"] = 2 * (conv_kernel - 1) * d_model
        return out

    def init_special_parameters(self) -> None:
        """The authors' init: W_0 ~ N(0, 0.02), biases 0, LN 1/0, theta_lr ~ N(0, 0.02), convs as PyTorch."""
        with torch.no_grad():
            if self.learner != "kernel":
                for name, p in self.named_parameters(recurse=False):
                    if name.startswith("W") or name == "lr_weight":
                        nn.init.normal_(p, std=0.02)
                    elif name.startswith("b") or name in ("lr_bias", "ttt_norm_bias", "token_idx_offset"):
                        p.zero_()
                    elif name == "ttt_norm_weight":
                        p.fill_(1.0)
            if self.share_qk:
                self.conv_q.reset_parameters()
                self.conv_k.reset_parameters()
            self.post_norm.reset_parameters()

    # ---- the pieces of the inner loop ----

    def initial_params(self, batch_size: int) -> tuple:
        names = ("W1", "b1") if self.learner == "linear" else ("W1", "b1", "W2", "b2")
        return tuple(
            None if getattr(self, n) is None else at_least_f32(getattr(self, n)).expand(
                batch_size, *getattr(self, n).shape)
            for n in names
        )

    def ln(self):
        if not self.ln_residual:
            return None
        return (at_least_f32(self.ttt_norm_weight).view(self.n_heads, 1, -1),
                at_least_f32(self.ttt_norm_bias).view(self.n_heads, 1, -1))

    def inner_lr(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """lr of every token [B, H, T] of x [B, T, d]: eta_base * sigmoid(theta_lr . x + bias) / head_dim (the
        authors' scaling; the 1/2 of Appendix A's loss is folded in too), times the warmup of eta_base.
        logits: theta_lr . x [B, T, H] where the fused projection (`project`) computed them."""
        base = self.eta_base * self.eta_scale / self.head_dim
        if not self.learnable_lr:
            return at_least_f32(x).new_full((x.shape[0], self.n_heads, x.shape[1]), base)
        if logits is None:  # one [d, H] projection (an einsum over the [H, 1, d] weight would copy x)
            logits = F.linear(x, self.lr_weight.flatten(1).to(x.dtype))
        logits = at_least_f32(logits) + at_least_f32(self.lr_bias).flatten()
        return base * torch.sigmoid(logits).transpose(1, 2)

    def project(self, x: torch.Tensor, fused: bool | None = None) -> dict:
        """theta_Q x, theta_K x (not with share_qk: its one projection feeds both convs), theta_V x, the
        gate's theta_G x and the inner learning rate's logits theta_lr . x [B, T, H]: {"q", "k", "v", "g",
        "lr"}, each [B, T, .], None where the layer has no such part. fused (default: on CUDA) makes them one
        GEMM over the concatenated weights (the authors' fused `qkv_learnable_ttt_lr_proj`: x read once, one
        launch) and returns views of its output; on a CPU the concatenation and the strided views cost more
        than the GEMMs they merge (results/speed/fused_projection: a layer's fwd+bwd 3-12% slower)."""
        lr_weight = getattr(self, "lr_weight", None)
        parts = {"q": self.q_proj.weight, "k": None if self.share_qk else self.k_proj.weight,
                 "v": self.v_proj.weight, "g": None if self.g_proj is None else self.g_proj.weight,
                 "lr": None if lr_weight is None else lr_weight.flatten(1)}
        weights = [w for w in parts.values() if w is not None]
        if x.is_cuda if fused is None else fused:
            out = F.linear(x, torch.cat([w.to(weights[0].dtype) for w in weights]))
            views = iter(out.split([w.shape[0] for w in weights], -1))
        else:
            views = iter([F.linear(x, w.to(weights[0].dtype)) for w in weights])
        return {name: None if w is None else next(views) for name, w in parts.items()}

    def token_eta(self, start: int, length: int) -> torch.Tensor:
        scale = self.token_idx if self.token_idx_offset is None else self.token_idx + self.token_idx_offset
        return at_least_f32(scale).clamp_min(0.0)[start : start + length]

    def _triton(self, x: torch.Tensor, family: str = "dual") -> bool:
        """Whether this layer runs the Triton kernel `family` here (CUDA by default, once that family passed
        its check; docs/speed.md): TTT-Linear's dual, prefill and decode kernels, TTT-MLP's mlp and mlp_decode
        kernels; a family of the other learner never."""
        learner = "mlp" if family.startswith("mlp") else "linear"
        return self.learner == learner and kernel_check.use_triton(x, self.kernel, family)

    def _kernel_takes(self, what: str, x: torch.Tensor, bias, ln) -> bool:
        """Whether the Triton kernel `what` (dual, prefill or decode of TTT-Linear; mlp or mlp_decode of
        TTT-MLP) takes these inputs: bias the inner loop's bias, or TTT-MLP's weights (W1, b1, W2, b2). Logs
        once per shape which path it takes and why (head size 96, the 760m size, is outside the kernels)."""
        b = self.mini_batch_size
        why_not = {"dual": lambda *a: kernels.dual_why_not(*a, b), "decode": kernels.decode_why_not,
                   "prefill": lambda *a: kernels.prefill_why_not(*a, b),
                   "mlp": partial(_mlp_why_not, kernels.mlp_why_not),
                   "mlp_decode": partial(_mlp_why_not, kernels.mlp_decode_why_not)}[what]
        reason = why_not(x, bias, ln and ln[0])
        shape = f"head size {x.shape[-1]}" + ("" if what.endswith("decode") else f", mini-batch {b}")
        kernel_check.log_path_once(what, shape, reason)
        return not reason

    def dual_kernel(self, xq: torch.Tensor, bias, ln) -> str | None:
        """The matmul precision of the Triton dual-form kernel if the complete mini-batches xq [B, H, N b, f]
        (in the projections' dtype, with the bias and LN of the inner loop) run in it here, None if they run
        in PyTorch. Its one selection: `_ttt` runs what it says, `ttt-bench bench forms` labels its rows by
        it."""
        if self.form == "dual" and self._triton(xq) and self._kernel_takes("dual", xq, bias, ln):
            return kernel_check.precision()  # tf32 unless TTT_BENCH_KERNEL_PRECISION=ieee: PRECISION says why
        return None

    def mlp_kernel(self, XQ: torch.Tensor, params: tuple, ln, cache: TTTCache | None) -> str | None:
        """The matmul precision of TTT-MLP's Triton kernel (kernels/ttt_mlp.py, forward and backward) if the
        complete mini-batches XQ [B, H, N, b, f] (float32, from the weights `params` (W1, b1, W2, b2), with
        the LN of the inner loop) run in it here, None if they run in PyTorch (dual_scan): the dual form, no
        diagnostics; with a cache, from the start of a mini-batch with no pending gradient sums (`_ttt`
        finishes a mini-batch begun by an earlier call through `_continue` first, and runs a last short one
        there, so decoding carries on as after PyTorch). Its one selection: `_ttt` runs what it says."""
        if (self.form != "dual"
                or self.diagnostics is not None or (cache is not None and cache.sums is not None)
                or not self._triton(XQ, "mlp") or not self._kernel_takes("mlp", XQ, params, ln)):
            return None
        return kernel_check.precision()  # tf32 unless TTT_BENCH_KERNEL_PRECISION=ieee, as the dual kernel

    def prefill_kernel(self, xq: torch.Tensor, cache: TTTCache | None) -> str | None:
        """The matmul precision of the Triton prefill kernel if this call's TTT-Linear runs in it, None if it
        runs in `_ttt`: forward only (no gradient recorded, e.g. evaluation, generation's prompt), from the
        start of a mini-batch with at least one complete one when there is a cache (its sums are carried by
        `_continue`), no diagnostics. xq [B, T, H, f] as projected. 16-bit inputs multiply in their own dtype
        with float32 accumulation and float32 weights (the authors' prefill kernel is fp16); float32 inputs
        in the dual-form kernel's precision (kernel_check.precision)."""
        b = self.mini_batch_size
        if (torch.is_grad_enabled() or self.form != "dual"
                or self.diagnostics is not None or not self._triton(xq, "prefill")
                or (cache is not None and (cache.pos % b or cache.sums is not None or xq.shape[1] < b))):
            return None
        if not self._kernel_takes("prefill", xq, self.b1, self.ln()):
            return None
        return kernels.prefill_precision(xq.dtype) if xq.dtype != torch.float32 else kernel_check.precision()

    def _prefill(self, xq, xk, xv, lr, cache: TTTCache | None, precision: str) -> torch.Tensor:
        """TTT-Linear in the prefill kernel, on the projections' token-major [B, T, H, f] in their dtype (no
        transposes or float32 copies); with a cache, the complete mini-batches there and a last short one
        through `_continue`, whose gradient sums decoding carries on. Returns z [B, T, H, f] in xq's dtype."""
        B, T = xq.shape[:2]
        b = self.mini_batch_size
        params = cache.params if cache is not None and cache.params is not None else self.initial_params(B)
        full = T if cache is None else T - T % b  # without a cache the kernel also does a short last one
        head = lambda v: v[:, :full]
        z, *params = ttt.linear_prefill(
            head(xq), head(xk), head(xv), lr[..., :full], *params, *self.ln(), self.token_eta(0, b),
            mini_batch=b, precision=precision, final_state=cache is not None)
        if cache is None:
            return z
        if full < T:
            rest = [v[:, full:].transpose(1, 2) for v in (xq, xk, xv)]
            zr, params, cache.sums = self._continue(params, None, *rest, lr[..., full:], 0)
            z = torch.cat([z, zr.transpose(1, 2).to(z.dtype)], 1)
        cache.params = tuple(p.contiguous() for p in params)
        return z

    def _continue(self, params, sums, xq, xk, xv, lr, start: int):
        """Tokens of one mini-batch from its position `start`, carrying gradient sums (ttt.step; one token in
        the learner's Triton decode kernel where it runs here)."""
        c, ln = xq.shape[2], self.ln()
        xq, xk, xv = (at_least_f32(t) for t in (xq, xk, xv))
        te = self.token_eta(start, c)
        family, weights = ("decode", params[1]) if self.learner == "linear" else ("mlp_decode", params)
        kernel = c == 1 and self._triton(xq, family) and self._kernel_takes(family, xq, weights, ln)
        z, sums = ttt.step(params, sums, xq, xk, xv, lr, te, ln, backend="triton" if kernel else "primal")
        if start + c == self.mini_batch_size:  # complete: W_b = W_{t'} - token_eta[b] * sums   (Eq. 6)
            return (
                z,
                tuple(None if p is None else p - te[-1] * s for p, s in zip(params, sums, strict=True)),
                None,
            )
        return z, params, sums

    def _inner_loop(self, params, xq, xk, xv, lr, ln, cache: TTTCache | None):
        """The op of this layer's learner (kernels/ttt: `ttt.linear`, `ttt.mlp`) over xq, xk, xv [B, H, T, f]
        from the start of a mini-batch, a last short one included: in the Triton kernel where it runs here
        (`dual_kernel`, `mlp_kernel`), else in the layer's form. xq, xk, xv in the projections' dtype: read as
        they are by TTT-Linear's kernel, float32 at least elsewhere. Returns (z, the weights after it)."""
        B, H, T, f = xq.shape
        b, N = self.mini_batch_size, T // self.mini_batch_size
        precision = None
        if self.learner == "linear" and N:
            precision = self.dual_kernel(xq[:, :, : N * b], params[1], ln)
        if not precision:
            xq, xk, xv = (at_least_f32(t) for t in (xq, xk, xv))
            if self.learner == "mlp" and N:
                precision = self.mlp_kernel(xq[:, :, : N * b].reshape(B, H, N, b, f), params, ln, cache)
        op = ttt.linear if self.learner == "linear" else ttt.mlp
        return op(xq, xk, xv, lr, self.token_eta(0, b), params, ln, precision=precision,
                  backend="triton" if precision else self.form, checkpoint_every=self.checkpoint_every,
                  fused=self.fused)

    def _ttt(self, xq, xk, xv, lr, cache: TTTCache | None) -> torch.Tensor:
        T, b, ln = xq.shape[2], self.mini_batch_size, self.ln()
        fresh = cache is None or cache.params is None
        params = self.initial_params(xq.shape[0]) if fresh else cache.params
        outs, t = [], 0
        part = lambda v, start, end=None: v[..., start:end, :] if v.dim() == 4 else v[..., start:end]
        if cache is not None and cache.pos % b:  # finish the mini-batch begun by an earlier call
            start = cache.pos % b
            t = min(T, b - start)
            z, params, cache.sums = self._continue(
                params, cache.sums, *(part(v, 0, t) for v in (xq, xk, xv, lr)), start
            )
            outs.append(z)
        end = T if cache is None else t + (T - t) // b * b  # with a cache, a last short mini-batch: below
        if end > t:
            z, params = self._inner_loop(params, *(part(v, t, end) for v in (xq, xk, xv, lr)), ln, cache)
            outs.append(z)
            t = end
        if t < T:  # a last short mini-batch, whose gradient sums decoding carries on
            z, params, cache.sums = self._continue(params, None, *(part(v, t) for v in (xq, xk, xv, lr)), 0)
            outs.append(z)
        if cache is not None:  # contiguous: decoding steps read W_{t'} as is
            cache.params = tuple(None if p is None else p.contiguous() for p in params)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)  # as it is: no copy of one piece

    @torch.no_grad()
    def _record_inner_losses(self, xk, xv, lr) -> None:
        """l(W_0; x_t), l(W_{t-1}; x_t), l(W_t; x_t) per position, mean over heads and sequences (Fig. 5)."""
        B, H, T, f = xk.shape
        b, ln, params = self.mini_batch_size, self.ln(), self.initial_params(B)
        step = lambda p, k, v, e: forms.losses_step(p, k, v, e, params0=self.initial_params(B), ln=ln)
        N, outs = T // b, []
        if N:
            split = lambda v: v[:, :, : N * b].reshape(B, H, N, b, -1)
            eta = ttt.eta(self.token_eta(0, b), split(lr[..., None]).squeeze(-1))
            out, params = forms.scan(step, params, (split(xk), split(xv), eta))
            outs.append(out.reshape(B, H, N * b, 3))
        if T > N * b:
            outs.append(
                step(
                    params,
                    xk[:, :, N * b :],
                    xv[:, :, N * b :],
                    ttt.eta(self.token_eta(0, T - N * b), lr[..., N * b :]),
                )[0]
            )
        self.diagnostics.add(self.layer_idx, torch.cat(outs, 2).mean((0, 1)), B)

    def _heads(self, xq, xk, xv, lr, cache: TTTCache | None) -> torch.Tensor:
        """The inner loop on heads-major xq, xk, xv [B, H, T, f] (views of the projections, in their dtype:
        each path casts what it needs), with the inner learning rates lr [B, H, T]: [B, H, T, f]."""
        if self.learner == "kernel":  # Theorem 2: the training set is every (k, v) seen
            xq, xk, xv = (at_least_f32(t) for t in (xq, xk, xv))
            if cache is not None:
                if cache.kv is not None:
                    xk, xv = torch.cat([cache.kv[0], xk], 2), torch.cat([cache.kv[1], xv], 2)
                cache.kv = (xk, xv)
            return learner.nadaraya_watson(xq, xk, xv, 1.0 / math.sqrt(self.head_dim))
        if self.diagnostics is not None and cache is None:
            self._record_inner_losses(at_least_f32(xk), at_least_f32(xv), lr)
        return self._ttt(xq, xk, xv, lr, cache)

    # ---- forward ----

    def forward(self, x: torch.Tensor, cache: TTTCache | None = None) -> torch.Tensor:
        B, T, D = x.shape
        start = cache.pos if cache is not None else 0
        views = self.project(x)
        xq, xk, xv = views["q"], views["k"], views["v"]
        if self.share_qk:
            conv = cache.conv if cache is not None else {}
            xq, conv["q"] = self.conv_q(views["q"], conv.get("q"))
            xk, conv["k"] = self.conv_k(views["q"], conv.get("k"))
        xq, xk, xv = (t.view(B, T, self.n_heads, self.head_dim) for t in (xq, xk, xv))
        if self.rope:  # positions within the mini-batch; token-major, as the projections lay them out
            b, first = self.mini_batch_size, start % self.mini_batch_size
            table = rope_freq_table(b, self.head_dim, self.rope_theta, x.device)
            if first + T <= b:  # a slice of the table, else the rows of every position
                freqs = table[first : first + T]
            else:
                freqs = table[torch.arange(first, first + T, device=x.device) % b]
            freqs = freqs.unsqueeze(1)  # [T, 1, f / 2]
            xq, xk = apply_rope_pairs(xq, freqs), apply_rope_pairs(xk, freqs)
        # heads: [B, H, T, f] views; the inner loop in float32 at least (the kernels read 16-bit activations
        # and compute in float32) and outside autocast (mixed-precision training): its weights are float32
        # parameters, its gradient steps need the precision
        with torch.autocast(x.device.type, enabled=False):
            lr = None if self.learner == "kernel" else self.inner_lr(x, views["lr"])
            if precision := self.prefill_kernel(xq, cache):  # token-major, in the projections' dtype
                z = self._prefill(xq, xk, xv, lr, cache, precision).transpose(1, 2)
            else:
                z = self._heads(*(t.transpose(1, 2) for t in (xq, xk, xv)), lr, cache)

        # back to the parameters' dtype (a no-op unless the model itself is cast, e.g. to bfloat16)
        z = self.post_norm(z.transpose(1, 2).reshape(B, T, D).to(self.post_norm.weight.dtype))
        if self.g_proj is not None:
            z = fuse(gelu_gate, self.fused)(views["g"], z)
        if cache is not None:
            cache.pos += T
        return self.o_proj(z)


def _mlp_why_not(why_not, XQ: torch.Tensor, params: tuple, ln_weight) -> str:
    """Why TTT-MLP's inputs XQ (complete mini-batches [B, H, N, b, f], or a decoding token) with weights
    (W1, b1, W2, b2) are outside a Triton kernel's domain here ("" when inside): the layer's float32 inner
    loop (a float64 model keeps its float64 PyTorch forms; the kernels compute in float32), then the kernel's
    own `why_not` (kernels/ttt_mlp.py, kernels/ttt_mlp_decode.py)."""
    if XQ.dtype != torch.float32:
        return f"dtype {XQ.dtype} (the layer runs the TTT-MLP kernels on a float32 inner loop)"
    W1, b1, _, b2 = params
    return why_not(XQ, W1, b1, b2, ln_weight)


class TTTBlock(nn.Module):
    """A residual block with a TTT layer, in the Transformer or the Mamba backbone (Figure 16). The backbone
    sets the defaults of the authors' flags pre_conv (a causal conv before the TTT layer), share_qk (one
    projection for the training and test views, two convs) and use_gate (a gated output); each can be set.

    Every keyword argument beyond the block's own goes to TTTLayer (learner, mini_batch_size, form, ...).
    """

    def __init__(
        self,
        layer_idx: int,
        d_model: int,
        n_heads: int,
        mlp_hidden: int,
        backbone: str = "mamba",
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        pre_conv: bool | None = None,
        share_qk: bool | None = None,
        use_gate: bool | None = None,
        **ttt,
    ):
        super().__init__()
        if backbone not in ("mamba", "transformer"):
            raise ValueError(f"backbone must be 'mamba' or 'transformer', got {backbone!r}")
        self.layer_idx, self.backbone = layer_idx, backbone
        pre_conv, share_qk, use_gate = self._flags(backbone, pre_conv, share_qk, use_gate)
        self.pre_conv_norm = RMSNorm(d_model, norm_eps) if pre_conv else None
        self.pre_conv = CausalConv1d(d_model, conv_kernel) if pre_conv else None
        self.seq_norm = RMSNorm(d_model, norm_eps)
        self.ttt = TTTLayer(d_model, n_heads, share_qk=share_qk, use_gate=use_gate, conv_kernel=conv_kernel,
                            **ttt)
        self.ttt.layer_idx = layer_idx
        self.mlp_norm = RMSNorm(d_model, norm_eps)
        self.mlp = SwiGLU(d_model, mlp_hidden)

    @staticmethod
    def _flags(backbone: str, pre_conv: bool | None, share_qk: bool | None, use_gate: bool | None) -> tuple:
        """The authors' three flags, each on in the Mamba backbone and off in the Transformer's unless set."""
        return tuple(backbone == "mamba" if f is None else f for f in (pre_conv, share_qk, use_gate))

    @staticmethod
    def _parts(d_model: int, conv_kernel: int, n_heads: int, backbone: str, pre_conv: bool | None,
               share_qk: bool | None, use_gate: bool | None, ttt: dict, **_) -> tuple[bool, dict]:
        """Whether the block has its pre-conv, and its TTT layer's arguments, as __init__ builds them."""
        pre_conv, share_qk, use_gate = TTTBlock._flags(backbone, pre_conv, share_qk, use_gate)
        layer = dict(ttt, d_model=d_model, n_heads=n_heads, share_qk=share_qk, use_gate=use_gate,
                     conv_kernel=conv_kernel)
        return pre_conv, arguments(TTTLayer, layer)

    @staticmethod
    def flops_per_token(seq_len: int, d_model: int, mlp_hidden: int, conv_kernel: int, **block) -> dict:
        """The TTT layer's, the MLP's and the pre-conv's."""
        pre_conv, layer = TTTBlock._parts(d_model, conv_kernel, **block)
        out = TTTLayer.flops_per_token(seq_len, **layer)
        out["dense"] += swiglu_flops(d_model, mlp_hidden) + (2.0 * d_model * conv_kernel if pre_conv else 0.0)
        return out

    @staticmethod
    def state_floats(seq_len: int, d_model: int, conv_kernel: int, **block) -> dict:
        """The TTT layer's, and the last conv_kernel - 1 inputs of the pre-conv (counted with the layer's
        convs, as "conv")."""
        pre_conv, layer = TTTBlock._parts(d_model, conv_kernel, **block)
        out = TTTLayer.state_floats(seq_len, **layer)
        if pre_conv:
            out["conv"] = out.get("conv", 0) + (conv_kernel - 1) * d_model
        return out

    def init_special_parameters(self) -> None:
        self.ttt.init_special_parameters()
        if self.pre_conv is not None:
            self.pre_conv.reset_parameters()

    def on_train_step(self, step: int, warmup_steps: int) -> None:
        """With eta_warmup (TTT-MLP, Appendix C), eta_base warms up linearly over the outer warmup."""
        if self.ttt.eta_warmup:
            self.ttt.eta_scale = min(1.0, (step + 1) / max(1, warmup_steps))

    def forward(self, x: torch.Tensor, cache: TTTCache | None = None) -> torch.Tensor:
        if self.pre_conv is not None:
            y, state = self.pre_conv(self.pre_conv_norm(x), None if cache is None else cache.conv.get("pre"))
            if cache is not None:
                cache.conv["pre"] = state
            x = x + y
        x = x + self.ttt(self.seq_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))

    def init_cache(self, batch_size: int, device=None, dtype=None, max_len=None) -> TTTCache:
        # filled on the first call: W_{t'} starts at theta_init
        return TTTCache(mini_batch_size=self.ttt.mini_batch_size)
