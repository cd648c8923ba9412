"""Size of each method's recurrent decoding state, in floats for batch size 1: what a block carries from
one token to the next when it decodes after `seq_len` tokens (the quantity recall capacity is measured
against; docs/recall.md). Per layer, by component:

- attention (Transformer++; the TTT layer with the kernel learner, Theorem 2, is attention too):
  KV cache, 2 x seq_len x d_model (keys and values of every token seen), growing with the context;
- linear attention: S, H x f x f (f = d_model / H), and for the Katharopoulos variant the normaliser
  n = sum phi(k), H x f (the improved variant has none);
- TTT-Linear: W (H x f x f) and b (H x f, with inner_bias); TTT-MLP: W1 (H x f x m f), b1 (H x m f),
  W2 (H x m f x f), b2 (H x f), m = mlp_expansion. Besides the weights W_t', a TTT cache holds
  * the pending gradient sums of an unfinished mini-batch (same shapes as the weights): counted, as the
    cache keeps them, when seq_len is not a multiple of the mini-batch size b (between mini-batch ends a
    decoder carries W_t' and the sums, up to twice the weights);
  * in the Mamba backbone, the last conv_kernel - 1 inputs of its three causal convolutions (the block's
    pre-conv, and the Q and K convs of the shared projection): 3 x (conv_kernel - 1) x d_model;
- Mamba: the SSM state, d_inner x d_state, and the conv state, d_inner x (d_conv - 1), d_inner = expand x
  d_model.

Positions (integers) are not counted. Every count is checked against the tensors of the real caches after a
prefill of seq_len tokens (tests/test_state_size.py).
"""

from omegaconf import DictConfig, OmegaConf


def _ttt_weights(H: int, f: int, learner: str, inner_bias: bool, expansion: int) -> dict:
    dims = [f, f] if learner == "linear" else [f, expansion * f, f]
    out = {}
    for k in range(len(dims) - 1):
        out[f"W{k + 1}"] = H * dims[k] * dims[k + 1]
        if inner_bias:
            out[f"b{k + 1}"] = H * dims[k + 1]
    return out


def block_state_floats(block: dict, d_model: int, seq_len: int) -> dict:
    """{component: floats} of one block's decoding state after seq_len tokens (batch size 1)."""
    kind = block["_target_"].rsplit(".", 1)[-1]
    if kind == "TransformerBlock":
        return {"kv_cache": 2 * seq_len * d_model}
    if kind == "LinearAttentionBlock":
        H = block["n_heads"]
        f = d_model // H
        out = {"S": H * f * f}
        if block.get("variant", "improved") == "katharopoulos":
            out["normaliser"] = H * f
        return out
    if kind == "TTTBlock":
        H = block["n_heads"]
        f = d_model // H
        learner = block.get("learner", "linear")
        if learner == "kernel":
            out = {"kv_cache": 2 * seq_len * d_model}
        else:
            bias, expansion = block.get("inner_bias", True), block.get("mlp_expansion", 4)
            weights = _ttt_weights(H, f, learner, bias, expansion)
            out = dict(weights)
            if seq_len % block.get("mini_batch_size", 16):
                out.update({f"pending_{k}": v for k, v in weights.items()})
        if block.get("backbone", "mamba") == "mamba":
            out["conv"] = 3 * (block.get("conv_kernel", 4) - 1) * d_model
        return out
    if kind == "MambaBlock":
        d_inner = block.get("expand", 2) * d_model
        return {"ssm": d_inner * block.get("d_state", 16), "conv": d_inner * (block.get("d_conv", 4) - 1)}
    raise ValueError(f"no state size known for block {block['_target_']!r}")


def state_floats(model_cfg: dict | DictConfig, seq_len: int) -> dict:
    """The decoding state of a model config (`cfg.model`) after seq_len tokens, batch size 1:
    {"per_layer": {component: floats}, "layer": floats per layer, "n_layers": ..., "total": all layers}."""
    if isinstance(model_cfg, DictConfig):
        model_cfg = OmegaConf.to_container(model_cfg, resolve=True)
    d_model, n_layers = model_cfg["d_model"], model_cfg["n_layers"]
    per_layer = block_state_floats(model_cfg["block"], d_model, seq_len)
    layer = sum(per_layer.values())
    return {"per_layer": per_layer, "layer": layer, "n_layers": n_layers, "total": layer * n_layers}
