"""Size of each method's recurrent decoding state, in floats for batch size 1: what a block carries from
one token to the next when it decodes after `seq_len` tokens (the quantity recall capacity is measured
against; docs/recall.md). Each block class states its own, by component, in its `state_floats` (cost.py):
the KV cache of attention grows with the context; linear attention's S, the TTT layer's inner weights
(and pending gradient sums) and Mamba's SSM state do not, nor the conv states.

Positions (integers) are not counted. Every count is checked against the tensors of the real caches after a
prefill of seq_len tokens (tests/test_state_size.py).
"""

from omegaconf import DictConfig, OmegaConf

from .cost import block_cost


def state_floats(model_cfg: dict | DictConfig, seq_len: int) -> dict:
    """The decoding state of a model config (`cfg.model`) after seq_len tokens, batch size 1:
    {"per_layer": {component: floats}, "layer": floats per layer, "n_layers": ..., "total": all layers}."""
    if isinstance(model_cfg, DictConfig):
        model_cfg = OmegaConf.to_container(model_cfg, resolve=True)
    per_layer = block_cost(model_cfg["block"], "state_floats", seq_len)
    layer, n_layers = sum(per_layer.values()), model_cfg["n_layers"]
    return {"per_layer": per_layer, "layer": layer, "n_layers": n_layers, "total": layer * n_layers}
