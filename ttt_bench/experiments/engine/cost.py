"""What a planned run costs, from its composed config alone (nothing is trained or read): its token or image
budget and training FLOPs, and the minutes that take on the 2-core reference CPU or the GPU-hours on an
A100. One estimator for `ablate --plan`, the reproduce plan and the paper profile's GPU budget.

Language models: flops.py's analytic count per token over the token budget. Image models (MTTT):
FlopCounterMode over one image, forward and backward (vision/flops.py), over the recipe's images.
"""

import json
from dataclasses import dataclass

from omegaconf import OmegaConf

from ...config import task_name
from ...flops import flops_per_token
from ...vision.flops import count_flops

# Training FLOP/s of the small CPU models on the 2-core reference machine (a Transformer at size=xs: ~30
# GFLOP/s by flops.py's count, `ttt-bench bench models`)
CPU_TRAIN_FLOPS = 30e9
A100_BF16_FLOPS, ASSUMED_MFU = 312e12, 0.4
LLAMA_VOCAB = 32000  # the paper's tokenizer (data.tokenizer.name of the paper profile)


@dataclass
class Cost:
    tokens: float  # NaN for image runs
    images: float  # NaN for language models
    train_flops: float
    seq_len: int  # tokens per sequence (image: tokens per image)
    tokenizer: str | None

    @property
    def budget(self) -> float:
        """What the run trains on: tokens, or images."""
        return self.images if self.tokens != self.tokens else self.tokens

    @property
    def cpu_minutes(self) -> float:
        return self.train_flops / CPU_TRAIN_FLOPS / 60

    @property
    def gpu_hours(self) -> float:
        return self.train_flops / (A100_BF16_FLOPS * ASSUMED_MFU) / 3600


def vocab_size(cfg) -> int:
    """The vocabulary a language-model run trains with, from its config alone (no tokenizer is loaded): a
    data config's own token range (synthetic tasks such as MQAR), the paper's Llama tokenizer for Hugging
    Face tokenizers (the paper profile's only one), a BPE's trained size, 256 bytes + end of document."""
    data = cfg.data
    if "vocab_size" in data:
        return int(data.vocab_size)
    kind = data.tokenizer.get("kind")
    if kind == "hf":
        return LLAMA_VOCAB
    return int(data.tokenizer.vocab_size) if kind == "bpe" else 257


_per_unit: dict[str, float] = {}  # FLOPs per token or image, by model and geometry (seeds share them)


def run_cost(cfg) -> Cost:
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if task_name(cfg) == "image":
        from hydra.utils import instantiate

        dm = instantiate(cfg.data)  # the geometry only: no image is read
        key = json.dumps([model, dm.token_dim, dm.num_tokens, dm.num_classes], sort_keys=True, default=str)
        if key not in _per_unit:
            net = instantiate(cfg.model, num_classes=dm.num_classes, token_dim=dm.token_dim,
                              num_tokens=dm.num_tokens)
            _per_unit[key] = count_flops(net, dm.token_dim, dm.num_tokens, backward=True)
        images = float(cfg.trainer.max_steps) * int(cfg.recipe.batch_size)  # as trained (--scale)
        return Cost(float("nan"), images, _per_unit[key] * images, int(dm.num_tokens), None)
    tokens = float(cfg.trainer.max_steps) * int(cfg.recipe.tokens_per_batch)  # as trained (--scale)
    seq_len, vocab = int(cfg.data.seq_len), vocab_size(cfg)
    key = json.dumps([model, seq_len, vocab], sort_keys=True, default=str)
    if key not in _per_unit:
        _per_unit[key] = flops_per_token(model, seq_len, vocab)["train"]
    tokenizer = cfg.data.tokenizer.get("name") if "tokenizer" in cfg.data else None
    return Cost(tokens, float("nan"), _per_unit[key] * tokens, seq_len, tokenizer)
