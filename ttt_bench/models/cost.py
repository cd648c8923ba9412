"""What a block costs, asked of the block class itself (as nanoGPT's estimate_mfu asks the model).

Besides `forward` and `init_cache` (lm.py), every block class, the `_target_` of a config's `model.block`,
implements two static (or class) methods of its constructor's arguments, passed by keyword:

    flops_per_token(seq_len, **args) -> {term: FLOPs}
        forward FLOPs of one block per token at context seq_len, by the terms and conventions of flops.py:
        "dense", "sequence", "scan" (a term it lacks is 0), and "recompute", the forward FLOPs that
        training runs again in the backward (checkpointing through time);
    state_floats(seq_len, **args) -> {component: floats}
        its decoding state after seq_len tokens at batch size 1 (state_size.py).

`args` are the arguments the block is built with: the config's over the defaults of its `__init__`
(`arguments`), so a default is written once, in the signature; a block that passes `**kwargs` on to its
mixer gets them as one dict under that name and asks the mixer's class (TTTBlock, MambaBlock). A method
names the arguments it uses and takes the rest as `**_`. flops.py and state_size.py sum these over the
layers: a new block needs its own file and its config, nothing else.
"""

import inspect
from collections.abc import Callable, Mapping

from hydra.utils import get_class

from ..errors import UserError

METHODS = ("flops_per_token", "state_floats")


def arguments(cls: Callable, config: Mapping) -> dict:
    """{name: value} of the arguments `cls(**config)` receives, its defaults filled in (a **kwargs
    parameter as one dict under its name). Hydra's keys (_target_, _partial_) are not arguments."""
    bound = inspect.signature(cls).bind_partial(**{k: v for k, v in config.items() if not k.startswith("_")})
    bound.apply_defaults()
    return dict(bound.arguments)


def block_cost(block: Mapping, method: str, seq_len: int) -> dict:
    """`method` (one of METHODS) of the class of a config's `model.block`, at context seq_len."""
    cls = get_class(block["_target_"])
    missing = [m for m in METHODS if not hasattr(cls, m)]
    if missing:
        raise UserError(f"block {block['_target_']} does not say what it costs: give it the static methods "
                        f"{' and '.join(missing)} (ttt_bench/models/cost.py)")
    return getattr(cls, method)(seq_len, **arguments(cls, block))


def swiglu_flops(d: int, hidden: int) -> float:
    """The SwiGLU MLP: w1, w3 [d, hidden] and w2 [hidden, d]."""
    return 6.0 * d * hidden


def causal_attention_flops(d: int, T: int) -> float:
    """Q K^T and A V over the (T+1)/2 positions a token attends to on average: 4 d (T+1)/2 per token."""
    return 2.0 * d * (T + 1)
