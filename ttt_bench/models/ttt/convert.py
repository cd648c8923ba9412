"""State dicts between ttt-bench and the authors' PyTorch code (test-time-training/ttt-lm-pytorch, ttt.py).

    ours = from_authors(their_model.state_dict());  model.load_state_dict(ours)
    theirs = to_authors(model.state_dict());        their_model.load_state_dict(theirs)

Every tensor keeps its shape; only names change:

    ours                                   theirs (TTTForCausalLM)
    embed.weight                           model.embed_tokens.weight
    norm.weight                            model.norm.weight
    lm_head.weight                         lm_head.weight (tied to the embedding in both)
    blocks.{i}.pre_conv_norm.weight        model.layers.{i}.conv.norm.weight        (Mamba backbone)
    blocks.{i}.pre_conv.{weight,bias}      model.layers.{i}.conv.conv.{weight,bias} (Mamba backbone)
    blocks.{i}.seq_norm.weight             model.layers.{i}.seq_norm.weight
    blocks.{i}.ttt.lr_weight               model.layers.{i}.seq_modeling_block.learnable_ttt_lr_weight
    blocks.{i}.ttt.lr_bias                 model.layers.{i}.seq_modeling_block.learnable_ttt_lr_bias
    blocks.{i}.ttt.token_idx_offset        model.layers.{i}.seq_modeling_block.learnable_token_idx
    blocks.{i}.ttt.{name}                  model.layers.{i}.seq_modeling_block.{name}
        for q_proj, k_proj, v_proj, o_proj, g_proj, conv_q, conv_k, post_norm, ttt_norm_weight,
        ttt_norm_bias, W1, b1, W2, b2
    blocks.{i}.mlp_norm.weight             model.layers.{i}.ffn_norm.weight
    blocks.{i}.mlp.{w1,w3,w2}.weight       model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight

Their configuration for one of our TTT models is `authors_config(...)`: the Mamba backbone is their
pre_conv=True, share_qk=True, use_gate=True; the Transformer backbone all three False; each can be set.
"""

import re

_TOP = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]
_BLOCK = [  # (ours, theirs) prefixes inside a block; specific names before the general ones
    ("pre_conv_norm.", "conv.norm."),
    ("pre_conv.", "conv.conv."),
    ("seq_norm.", "seq_norm."),
    ("ttt.lr_weight", "seq_modeling_block.learnable_ttt_lr_weight"),
    ("ttt.lr_bias", "seq_modeling_block.learnable_ttt_lr_bias"),
    ("ttt.token_idx_offset", "seq_modeling_block.learnable_token_idx"),
    ("ttt.", "seq_modeling_block."),
    ("mlp_norm.", "ffn_norm."),
    ("mlp.w1.", "mlp.gate_proj."),
    ("mlp.w3.", "mlp.up_proj."),
    ("mlp.w2.", "mlp.down_proj."),
]
_OURS_BLOCK, _THEIRS_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)"), re.compile(r"model\.layers\.(\d+)\.(.+)")


def _rename(state_dict: dict, block_re, block_prefix: str, pairs: list, top: dict) -> dict:
    out = {}
    for key, value in state_dict.items():
        m = block_re.fullmatch(key)
        if m is None:
            if key not in top:
                raise KeyError(f"no counterpart for {key!r}")
            out[top[key]] = value
            continue
        i, rest = m.groups()
        src, dst = next(((s, d) for s, d in pairs if rest.startswith(s)), (None, None))
        if src is None:
            raise KeyError(f"no counterpart for {key!r}")
        out[f"{block_prefix}{i}.{dst}{rest[len(src) :]}"] = value
    return out


def to_authors(state_dict: dict) -> dict:
    """Our LanguageModel's state dict -> the authors' TTTForCausalLM's."""
    return _rename(state_dict, _OURS_BLOCK, "model.layers.", _BLOCK, dict(_TOP))


def from_authors(state_dict: dict) -> dict:
    """The authors' TTTForCausalLM's state dict -> our LanguageModel's."""
    return _rename(state_dict, _THEIRS_BLOCK, "blocks.", [(t, o) for o, t in _BLOCK], {t: o for o, t in _TOP})


def authors_config(
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    mlp_hidden: int,
    learner: str = "linear",
    backbone: str = "mamba",
    mini_batch_size: int = 16,
    eta_base: float = 1.0,
    rope_theta: float = 10_000.0,
    conv_kernel: int = 4,
    pre_conv: bool | None = None,
    share_qk: bool | None = None,
    use_gate: bool | None = None,
) -> dict:
    """Keyword arguments of their TTTConfig for the model our configuration builds (the flags: as TTTBlock's,
    the backbone's defaults unless set)."""
    mamba = backbone == "mamba"
    return dict(
        vocab_size=vocab_size,
        hidden_size=d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        intermediate_size=mlp_hidden,
        ttt_layer_type=learner,
        mini_batch_size=mini_batch_size,
        ttt_base_lr=eta_base,
        rope_theta=rope_theta,
        pre_conv=mamba if pre_conv is None else pre_conv,
        share_qk=mamba if share_qk is None else share_qk,
        use_gate=mamba if use_gate is None else use_gate,
        conv_kernel=conv_kernel,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
