"""Analytic training FLOPs per token for every model of conf/model/, and matched-FLOPs configs.

Conventions (PaLM's 6N + 12LHQT and torch.utils.flop_counter's, with causal attention as Kaplan et al.):
  * a matmul of [m, k] x [k, n] costs 2mkn FLOPs; elementwise ops, norms and softmax cost nothing,
    except Mamba's selective scan, counted as 9 E N per token (mamba-ssm's own count);
  * attention is causal: token t (1..T) attends to t positions, (T+1)/2 on average, and each costs
    2 d for Q K^T and 2 d for A V, so the T-dependent term is 4 d (T+1)/2 = 2 d (T+1) FLOPs per token
    and layer (forward), half of the full T x T matrices that FlopCounterMode sees in SDPA's math
    backend (Kaplan et al.'s 2 n_layer n_ctx d_attn, up to the +1); the same for the TTT kernel learner;
  * training = forward + backward = 3x forward (backward computes the gradients of both matmul inputs),
    plus the forward FLOPs a block recomputes in the backward (the TTT inner loop's when it checkpoints
    through time).
The embedding lookup is free; the (tied) LM head costs 2 d V per token.

Each block class counts its own FLOPs by these conventions (models/cost.py); `flops_per_token(model,
seq_len, vocab_size)` sums them over the layers and returns the terms per token:
  dense      projections and MLPs (proportional to the non-embedding parameters),
  sequence   the mixing across time: attention scores, linear attention's chunks and state, and the TTT
             inner loop (gradients, weight updates, outputs: O(d f) + O(b d) per token),
  scan       Mamba's selective scan (elementwise, invisible to FlopCounterMode),
  lm_head,   and their sums: forward and train.
"""

from collections.abc import Mapping

from .errors import UserError
from .models.cost import block_cost


def flops_per_token(model: Mapping, seq_len: int, vocab_size: int) -> dict:
    """FLOPs per token of a resolved model config (conf/model/*.yaml) at context `seq_len`, by term."""
    per_block = block_cost(model["block"], "flops_per_token", seq_len)
    L = model["n_layers"]
    out = {term: L * per_block.get(term, 0.0) for term in ("dense", "sequence", "scan")}
    out["lm_head"] = 2.0 * model["d_model"] * vocab_size
    out["forward"] = sum(out.values())
    out["train"] = 3.0 * out["forward"] + L * per_block.get("recompute", 0.0)
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
