"""state_floats (ttt_bench/models/state_size.py) against the floats in the real decoding caches."""

import dataclasses

import pytest
import torch
from hydra.utils import instantiate

from ttt_bench.config import compose
from ttt_bench.models.state_size import state_floats

VOCAB = 32

MODELS = {  # name: overrides
    "transformer": ["model=transformer"],
    "ttt_linear": ["model=ttt_linear"],
    "ttt_linear_transformer_backbone": ["model=ttt_linear", "model.block.backbone=transformer"],
    "ttt_mlp": ["model=ttt_mlp"],
    "mamba": ["model=mamba"],
    "linear_attention": ["model=linear_attention"],
    "linear_attention_katharopoulos": ["model=linear_attention", "model.block.variant=katharopoulos"],
    "ttt_kernel": ["model=ttt_kernel"],
}


def cache_floats(cache, skip: tuple[str, ...] = ()) -> int:
    """Floats in the tensors of a cache: dataclass fields, tuples, lists and dicts walked recursively."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() if cache.is_floating_point() else 0
    if dataclasses.is_dataclass(cache):
        fields = [f.name for f in dataclasses.fields(cache) if f.name not in skip]
        return sum(cache_floats(getattr(cache, name)) for name in fields)
    if isinstance(cache, (tuple, list)):
        return sum(cache_floats(c) for c in cache)
    if isinstance(cache, dict):
        return sum(cache_floats(c) for c in cache.values())
    return 0  # None, positions


def prefilled_caches(cfg, tokens: int) -> list:
    torch.manual_seed(0)
    model = instantiate(cfg.model, vocab_size=VOCAB).eval()
    caches = model.init_caches(1)
    with torch.no_grad():
        model(torch.randint(VOCAB, (1, tokens)), caches)
    return caches


# after 60 tokens, an unfinished TTT mini-batch (b = 16): the cache holds the pending gradient sums too
CASES = [(name, 64) for name in MODELS] + [(name, 60) for name in ("ttt_linear", "ttt_mlp")]


@pytest.mark.parametrize("name,tokens", CASES)
def test_state_floats_match_the_decoding_caches(name, tokens, one_thread):
    cfg = compose("train", [*MODELS[name], "size=xs", "data.seq_len=64"])
    if name == "ttt_kernel":  # its mini-batch is the context: one mini-batch of all tokens seen
        assert cfg.model.block.mini_batch_size == 64
    expected = state_floats(cfg.model, tokens)
    caches = prefilled_caches(cfg, tokens)
    # improved linear attention computes n = sum k into its cache but never reads it (normalize=False)
    skip = ("norm",) if name == "linear_attention" else ()
    counted = [cache_floats(c, skip) for c in caches]
    assert counted == [expected["layer"]] * expected["n_layers"], (expected, counted)
    assert expected["total"] == sum(counted)


def test_state_floats_by_component_at_size_xs():
    d, H, f, T = 64, 4, 16, 64
    s = lambda *o: state_floats(compose("train", [*o, "size=xs", f"data.seq_len={T}"]).model, T)
    assert s("model=transformer")["per_layer"] == {"kv_cache": 2 * T * d}
    assert s("model=transformer")["n_layers"] == 4 and s("model=mamba")["n_layers"] == 8
    assert s("model=linear_attention")["per_layer"] == {"S": H * f * f}
    assert s("model=linear_attention", "model.block.variant=katharopoulos")["per_layer"] == {
        "S": H * f * f, "normaliser": H * f}
    assert s("model=ttt_linear")["per_layer"] == {"W1": H * f * f, "b1": H * f, "conv": 3 * 3 * d}
    assert s("model=ttt_linear", "model.block.backbone=transformer")["per_layer"] == {
        "W1": H * f * f, "b1": H * f}
    assert s("model=ttt_mlp")["per_layer"] == {
        "W1": H * f * 4 * f, "b1": H * 4 * f, "W2": H * 4 * f * f, "b2": H * f, "conv": 3 * 3 * d}
    assert s("model=mamba")["per_layer"] == {"ssm": 2 * d * 16, "conv": 2 * d * 3}
    assert s("model=ttt_kernel")["per_layer"] == {"kv_cache": 2 * T * d}
    cfg = compose("train", ["model=ttt_linear", "size=xs", f"data.seq_len={T}"]).model
    assert state_floats(cfg, 70)["per_layer"]["pending_W1"] == H * f * f  # mid-mini-batch: the sums too
