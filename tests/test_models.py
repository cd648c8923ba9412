"""Model-level tests that hold for every registered model (conf/model/*.yaml)."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from ttt_bench.config import compose

# the language models (the image models of task=image, ViTClassifier configs, are tested in test_mttt.py)
MODELS = sorted(
    p.stem
    for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")
    if not p.stem.startswith(("mttt_", "vit_"))
)
NOMINAL = {"125m": 125e6, "350m": 350e6, "760m": 760e6, "1.3b": 1.3e9}
# Table 3 "reproduces Table 12 of the Mamba paper", whose counts use a GPT-NeoX-sized vocabulary.
PAPER_VOCAB = 50277


def tiny_model(name: str, **overrides) -> torch.nn.Module:
    cfg = compose(
        "train", [f"model={name}", "size=xs", "data.seq_len=64", *[f"{k}={v}" for k, v in overrides.items()]]
    )
    torch.manual_seed(0)
    return instantiate(cfg.model, vocab_size=97).double().eval()


@pytest.mark.parametrize("name", MODELS)
def test_causal(name):
    """Changing token t never changes the outputs before t."""
    model = tiny_model(name)
    x = torch.randint(0, 97, (2, 40))
    y = x.clone()
    y[:, 23] = (y[:, 23] + 1) % 97
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :23], b[:, :23], atol=1e-10)
    assert not torch.allclose(a[:, 23:], b[:, 23:])


@pytest.mark.parametrize("name", MODELS)
def test_decode_matches_full_forward(name):
    """Prefill a prompt, then decode token by token from the cache: same logits as one forward pass."""
    model = tiny_model(name)
    x = torch.randint(0, 97, (2, 37))
    full = model(x)
    caches = model.init_caches(2)
    steps = [model(x[:, :19], caches)] + [model(x[:, t : t + 1], caches) for t in range(19, 37)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("max_len,grows_at,capacity", [(37, [], 37), (8, [9, 17, 33], 64),
                                                        (None, [5, 9, 11, 21], 40)])
def test_transformer_decodes_in_place_into_its_preallocated_kv_cache(max_len, grows_at, capacity,
                                                                     monkeypatch):
    """The KV cache is written in place (issue 48): prefill, a chunk of 4 tokens after the cache (causal
    among themselves), then one token at a time give the logits of one forward pass. Its buffers move only
    where they outgrow their capacity, doubling (from 8: at lengths 9, 17 and 33; from none, the prompt's
    5 first), never when given the final length: no per-step copy of the cache. A single new token attends
    without a mask."""
    from ttt_bench.models import transformer

    model = tiny_model("transformer")
    x = torch.randint(0, 97, (2, 37))
    full = model(x)
    masks = []  # (queries, attn_mask) of every attention call
    sdpa = transformer.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        masks.append((q.shape[2], attn_mask))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", spy)
    caches = model.init_caches(2, max_len=max_len)
    kv = caches[0]
    steps, buffers, moved = [], kv.keys.data_ptr(), []
    for start, end in [(0, 5), (5, 9), *((t, t + 1) for t in range(9, 37))]:
        steps.append(model(x[:, start:end], caches))
        if kv.keys.data_ptr() != buffers:
            buffers = kv.keys.data_ptr()
            moved.append(end)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-7, atol=1e-9)
    assert moved == grows_at and kv.length == 37 and kv.keys.shape[2] == capacity
    assert all(mask is None for queries, mask in masks if queries == 1)
    assert any(mask is not None for queries, mask in masks if queries == 4)


@pytest.mark.parametrize("size", list(NOMINAL))
@pytest.mark.parametrize("name", [m for m in MODELS if m != "linear_attention"])
def test_paper_sizes_have_nominal_parameter_counts(name, size):
    cfg = compose("train", [f"model={name}", f"size={size}", "data.seq_len=2048"])
    with torch.device("meta"):
        model = instantiate(cfg.model, vocab_size=PAPER_VOCAB)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / NOMINAL[size] - 1) <= 0.10, f"{name} {size}: {n / 1e6:.1f}M parameters"


def test_cpu_ladder_spans_16x():
    counts = []
    for size in ["xs", "s", "m", "l"]:
        with torch.device("meta"):
            model = instantiate(compose("train", [f"size={size}"]).model, vocab_size=257)
        counts.append(model.num_params(non_embedding=True))
    assert counts == sorted(counts) and counts[-1] / counts[0] >= 16 and 0.1e6 < counts[0] < 0.4e6


@pytest.mark.parametrize("backbone", ["mamba", "transformer"])
def test_the_authors_flags_are_options_with_backbone_defaults(backbone):
    """pre_conv, share_qk and use_gate default to the backbone's (all on in Mamba's, off in the
    Transformer's) and each can be set on its own (test_ttt_faithfulness.py: the same function as theirs)."""
    def block(*flags):
        cfg = compose("train", ["model=ttt_linear", "size=xs", f"model.block.backbone={backbone}", *flags])
        return instantiate(cfg.model, vocab_size=64).blocks[0]

    flags = lambda b: (b.pre_conv is not None, b.ttt.share_qk, b.ttt.g_proj is not None)
    mamba = backbone == "mamba"
    assert flags(block()) == (mamba,) * 3
    mixed = block(f"model.block.share_qk={not mamba}", f"model.block.use_gate={not mamba}")
    assert flags(mixed) == (mamba, not mamba, not mamba)
