"""What a planned run costs, from its composed config alone (nothing is trained): its token or image budget
and training FLOPs, the GPU-hours they take on an A100, and the minutes they take on the 2-core reference CPU
as measured there (`Throughput`: the committed cpu registries). One estimator for `ablate --plan`, the
reproduce plan and the paper profile's GPU budget.

Language models: flops.py's analytic count per token over the token budget. Image models (MTTT):
FlopCounterMode over one image, forward and backward (vision/flops.py), over the recipe's images.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from ...config import task_name
from ...flops import flops_per_token
from ...io import read_table
from ...vision.flops import count_flops
from .plan import identity

# Training FLOP/s a run of a model no committed registry measured is priced at: about the median of the
# measured runs, two at once on the 2-core reference machine (results/cpu/*/registry.csv: 9-40 GFLOP/s).
CPU_TRAIN_FLOPS = 15e9
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


@dataclass(frozen=True)
class Throughput:
    """Measured training speed from a folder's committed registries: every finished run's seconds by its
    overrides, and each model's FLOP/s (its runs' FLOPs over their seconds). The caller names the folder
    (the library does not know where the repository is): results/cpu, two runs at once (`JOBS=2`, one thread
    each) on the 2-core machine of results/cpu/RUN.md; results/gpu, the gpu profile's runs on a lent GPU,
    several at once (results/gpu/RUN.md). A folder that is not there measured nothing."""

    seconds: dict[str, float]  # a run's identity (plan.identity, space-joined) -> seconds
    rates: dict[str, float]  # model name -> FLOP/s

    @classmethod
    def committed(cls, folder: Path) -> "Throughput":
        runs = [read_table(path, numeric=("train_flops", "wall_time_s"))
                for path in sorted(Path(folder).glob("*/registry.csv"))]
        runs = [r for r in runs if {"status", "train_flops", "wall_time_s", "model", "overrides"} <= set(r)]
        if not runs:
            return cls({}, {})
        df = pd.concat(runs, ignore_index=True)
        df = df[(df["status"] == "finished") & (df["wall_time_s"] > 0) & (df["train_flops"] > 0)]
        by_model = df.groupby("model")[["train_flops", "wall_time_s"]].sum()
        names = df["overrides"].map(lambda o: " ".join(identity(o)))
        return cls(dict(zip(names, df["wall_time_s"], strict=True)),
                   (by_model["train_flops"] / by_model["wall_time_s"]).to_dict())

    def measured(self, overrides: list[str]) -> float | None:
        """The seconds the same run (its identity: overrides without paths) took, if a registry holds it."""
        return self.seconds.get(" ".join(identity(overrides)))

    def minutes(self, overrides: list[str], model: str, train_flops: float) -> tuple[float, str]:
        """A run's minutes on the reference CPU (two at once) and where the number comes from: the same run's
        measured time, else its FLOPs at its model's measured rate, else at CPU_TRAIN_FLOPS."""
        if (seconds := self.measured(overrides)) is not None:
            return seconds / 60, "measured"
        rate = self.rates.get(model)
        return (train_flops / (rate or CPU_TRAIN_FLOPS) / 60,
                f"{model} at {rate / 1e9:.0f} GFLOP/s" if rate else f"at {CPU_TRAIN_FLOPS / 1e9:.0f} GFLOP/s")
