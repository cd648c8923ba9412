"""Analytic training FLOPs per token for every model of conf/model/, and matched-FLOPs configs.

Conventions (PaLM's 6N + 12LHQT and torch.utils.flop_counter's, with causal attention as Kaplan et al.):
  * a matmul of [m, k] x [k, n] costs 2mkn FLOPs; elementwise ops, norms and softmax cost nothing,
    except Mamba's selective scan, counted as 9 E N per token (mamba-ssm's own count);
  * attention is causal: token t (1..T) attends to t positions, (T+1)/2 on average, and each costs
    2 d for Q K^T and 2 d for A V, so the T-dependent term is 4 d (T+1)/2 = 2 d (T+1) FLOPs per token
    and layer (forward), half of the full T x T matrices that FlopCounterMode sees in SDPA's math
    backend (Kaplan et al.'s 2 n_layer n_ctx d_attn, up to the +1); the same for the TTT kernel learner;
  * training = forward + backward = 3x forward (backward computes the gradients of both matmul inputs),
    plus one more forward of the inner loop when TTT checkpoints through time.
The embedding lookup is free; the (tied) LM head costs 2 d V per token.

`flops_per_token(model, seq_len, vocab_size)` returns the terms per token:
  dense      projections and MLPs (proportional to the non-embedding parameters),
  sequence   the mixing across time: attention scores, linear attention's chunks and state, and the TTT
             inner loop (gradients, weight updates, outputs: O(d f) + O(b d) per token),
  scan       Mamba's selective scan (elementwise, invisible to FlopCounterMode),
  lm_head,   and their sums: forward and train.
"""

import inspect
import math
from collections.abc import Mapping

from .errors import UserError

SCAN_FLOPS_PER_STATE = 9  # mamba-ssm: 9 * batch * length * d_inner * d_state for the selective scan


def _block_kind(block: Mapping) -> str:
    return str(block["_target_"]).rsplit(".", 1)[-1]


def _mlp(d: int, hidden: int) -> float:
    return 6.0 * d * hidden  # SwiGLU: w1, w3 [d, h] and w2 [h, d]


def _causal_attention(d: int, T: int) -> float:
    """Q K^T and A V over the (T+1)/2 positions a token attends to on average: 4 d (T+1)/2 per token."""
    return 2.0 * d * (T + 1)


def _transformer(block: Mapping, T: int) -> dict:
    d = block["d_model"]
    return {"dense": 8.0 * d * d + _mlp(d, block["mlp_hidden"]), "sequence": _causal_attention(d, T)}


def _linear_attention(block: Mapping, T: int) -> dict:
    from .models.linear_attention import causal_linear_attention

    d, H = block["d_model"], block["n_heads"]
    f = d // H
    chunk = inspect.signature(causal_linear_attention).parameters["chunk"].default
    sizes = [min(chunk, T - lo) for lo in range(0, T, chunk)]
    # per chunk of c tokens and head: q k^T and a v (2 c^2 f each), q S and k^T v (2 c f^2 each)
    per_head = sum(4.0 * c * c * f + 4.0 * c * f * f for c in sizes)
    if block.get("variant", "improved") == "katharopoulos":
        per_head += 2.0 * f * T  # the normalizer q n^T
    return {"dense": 8.0 * d * d + _mlp(d, block["mlp_hidden"]), "sequence": H * per_head / T}


def _ttt_chunk(dims: list[tuple[int, int]], c: int, form: str, bias: bool) -> float:
    """Inner-loop FLOPs of one head for a chunk of c tokens (forms.py): gradients at W_{t'}, then the
    dual form's outputs and end-of-mini-batch weights, or the primal form's per-token weights."""
    flops = sum(2.0 * c * i * o for i, o in dims)  # forward of f on the training view
    flops += sum(2.0 * c * i * o for i, o in dims[1:])  # backward through the upper layers
    for i, o in dims:
        if form == "dual":
            # x W and W - X^T G for the next mini-batch, then x X^T, (eta * x X^T) G and [eta G]
            flops += 4.0 * c * i * o + 2.0 * c * c * i + 2.0 * c * c * o * (2 if bias else 1)
        else:
            # W_t = W - eta G_t for every token (c x c by c x (i o)), [b_t], then f(x_t; W_t)
            flops += 2.0 * c * c * i * o + (2.0 * c * c * o if bias else 0.0) + 2.0 * c * i * o
    return flops


def _ttt(block: Mapping, T: int) -> dict:
    d, H = block["d_model"], block["n_heads"]
    f = d // H
    mamba = block.get("backbone", "mamba") == "mamba"
    k = block.get("conv_kernel", 4)
    # views: Q, V, O (+ K in the Transformer backbone, + the gate G in the Mamba backbone)
    dense = 4 * 2.0 * d * d + _mlp(d, block["mlp_hidden"])
    if mamba:  # pre-conv and the two convs after the shared Q/K projection
        dense += 3 * 2.0 * d * k
    learner = block.get("learner", "linear")
    if learner == "kernel":
        return {"dense": dense, "sequence": _causal_attention(d, T)}
    if learner == "linear":
        dims = [(f, f)]
    else:
        hidden = block.get("mlp_expansion", 4) * f
        dims = [(f, hidden), (hidden, f)]
    b = min(block.get("mini_batch_size", 16), T)
    form, bias = block.get("form", "dual"), block.get("inner_bias", True)
    n, rest = divmod(T, b)
    per_head = n * _ttt_chunk(dims, b, form, bias) + (_ttt_chunk(dims, rest, form, bias) if rest else 0.0)
    sequence = H * per_head / T
    if block.get("learnable_lr", True):
        sequence += 2.0 * d * H  # eta(x) = eta_base sigmoid(theta_lr . x), one per head
    return {"dense": dense, "sequence": sequence}


def _mamba(block: Mapping, T: int) -> dict:
    d = block["d_model"]
    E = block.get("expand", 2) * d
    N = block.get("d_state", 16)
    R = math.ceil(d / 16) if block.get("dt_rank", "auto") == "auto" else block["dt_rank"]
    k = block.get("d_conv", 4)
    # in_proj [d, 2E], depthwise conv, x_proj [E, R + 2N], dt_proj [R, E], out_proj [E, d]
    dense = 2.0 * d * 2 * E + 2.0 * E * k + 2.0 * E * (R + 2 * N) + 2.0 * R * E + 2.0 * E * d
    return {"dense": dense, "scan": SCAN_FLOPS_PER_STATE * E * N}


BLOCKS = {
    "TransformerBlock": _transformer,
    "LinearAttentionBlock": _linear_attention,
    "TTTBlock": _ttt,
    "MambaBlock": _mamba,
}


def flops_per_token(model: Mapping, seq_len: int, vocab_size: int) -> dict:
    """FLOPs per token of a resolved model config (conf/model/*.yaml) at context `seq_len`, by term."""
    block = model["block"]
    kind = _block_kind(block)
    if kind not in BLOCKS:
        raise UserError(f"no FLOPs formula for block {block['_target_']}; add one to ttt_bench/flops.py")
    per_block = BLOCKS[kind](block, seq_len)
    L = model["n_layers"]
    out = {term: L * per_block.get(term, 0.0) for term in ("dense", "sequence", "scan")}
    out["lm_head"] = 2.0 * model["d_model"] * vocab_size
    out["forward"] = sum(out.values())
    recompute = out["sequence"] if kind == "TTTBlock" and block.get("checkpoint_every", 0) else 0.0
    out["train"] = 3.0 * out["forward"] + recompute
    return out


def train_flops(cfg, vocab_size: int, tokens: int) -> float:
    """Training FLOPs of a run: the composed config (cfg.model, cfg.data.seq_len) over `tokens` tokens."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(cfg.model, resolve=True)
    return flops_per_token(model, int(cfg.data.seq_len), vocab_size)["train"] * tokens


def schedule_train_flops(model: Mapping, schedule: list[tuple[int, float]], vocab_size: int) -> float:
    """Training FLOPs per token of a token budget spent on a mix of contexts: `schedule` lists
    (context, tokens as a fraction of the budget), e.g. TF finetune: [(2048, 1.0), (32768, 0.2)]."""
    return sum(frac * flops_per_token(model, T, vocab_size)["train"] for T, frac in schedule)


def match_flops(
    model: Mapping,
    reference: Mapping,
    seq_len: int,
    vocab_size: int,
    by: str = "depth",
    multiple_of: int = 16,
    schedule: list[tuple[int, float]] | None = None,
) -> tuple[dict, float]:
    """Change `model`'s depth (by="depth") or MLP width (by="width", a multiple of `multiple_of`) so that
    its training FLOPs match `reference`'s, trained at `seq_len` on a token budget; `model` spends that
    budget per `schedule`, [(context, fraction of the reference's tokens)], by default [(seq_len, 1.0)].
    Returns the config overrides and the achieved ratio model / reference.

    Appendix C (Figures 2 right and 14): every method matches Mamba 1.4B trained at 32k; TF finetune is
    pretrained on the Chinchilla budget at 2k, then finetuned on 20% more tokens at 32k, so
    schedule=[(2048, 1.0), (32768, 0.2)]. The paper: Transformer 24 -> 19 blocks, TTT MLP hidden
    5504 -> 5808 (TTT-Linear) and 5248 (TTT-MLP)."""
    schedule = schedule or [(seq_len, 1.0)]
    target = flops_per_token(reference, seq_len, vocab_size)["train"]

    def ratio(m: Mapping) -> float:
        return schedule_train_flops(m, schedule, vocab_size) / target

    if by == "depth":
        per_layer = ratio({**model, "n_layers": 1}) - ratio({**model, "n_layers": 0})
        base = ratio({**model, "n_layers": 0})
        n = max(1, round((1 - base) / per_layer))
        return {"model.n_layers": n}, ratio({**model, "n_layers": n})
    if by == "width":
        with_width = lambda h: {**model, "block": {**model["block"], "mlp_hidden": h}}
        slope = ratio(with_width(1)) - ratio(with_width(0))
        h = max(multiple_of, multiple_of * round((1 - ratio(with_width(0))) / slope / multiple_of))
        return {"model.block.mlp_hidden": h}, ratio(with_width(h))
    raise UserError(f"match_flops by={by!r}: use 'depth' or 'width'")
