"""A sweep's plan: the typed `Run`s it expands into, each a list of `ttt-bench train` overrides.

An experiment's planner turns its sweep definition (conf/sweep/<name>.yaml) into named configurations;
`expand` makes one `Run` per configuration and seed (`<config>-s<seed>`, seed-major, so an interrupted
sweep has every configuration at its first seeds). `composed` composes a run's config once per process and
hands out copies: the planner's checks, costs and floors and the training job share one composition.
"""

import copy
import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from ...config import compose
from ...errors import UserError

PROFILES = ("smoke", "quick", "cpu", "gpu", "paper")  # gpu: one GPU for minutes (a lent H100/H200)
SEEDLESS = ("seed=", "trainer.enable_progress_bar=")  # overrides that change neither a run's model nor cost


@dataclass
class Run:
    """One planned training run. `info` holds what the experiment's tables and claims need to know of it
    (a Table 1 row number, a mini-batch size, a width, the paper's number...): registry columns."""

    config: str  # the configuration: the run's name without its seed
    overrides: list[str]
    label: str
    seed: int = 0
    role: str | None = None  # the validation text's role: pile, books, mqar, images, synthetic
    corpus: str | None = None  # the corpus it actually reads (tables and figure titles)
    seq_len: int | None = None
    after: str | None = None  # the run it starts from (TF finetune)
    seeds: int | None = None  # a configuration's own number of seeds (else the profile's)
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.config}-s{self.seed}"

    def columns(self) -> dict:
        """The run as registry columns, without its overrides and dependency (the registry adds them)."""
        core = {"label": self.label, **self.info, "config": self.config, "seed": self.seed, "role": self.role,
                "corpus": self.corpus}
        return core if self.seq_len is None else {**core, "seq_len": self.seq_len}

    def to_json(self) -> dict:
        return {"config": self.config, "overrides": self.overrides, "label": self.label, "seed": self.seed,
                "role": self.role, "corpus": self.corpus, "seq_len": self.seq_len, "after": self.after,
                "info": self.info}

    @classmethod
    def from_json(cls, d: dict) -> "Run":
        return cls(**d)


def configuration(config: str, overrides: list[str], label: str, **info) -> Run:
    """A planned configuration (before seeds): its context is read off its overrides when they set it."""
    seq_len = [o.split("=", 1)[1] for o in overrides if o.startswith("data.seq_len=")]
    fields = {k: info.pop(k) for k in ("role", "seq_len", "seeds") if k in info}
    if seq_len and seq_len[-1].isdigit():
        fields.setdefault("seq_len", int(seq_len[-1]))
    return Run(config=config, overrides=list(overrides), label=label, **fields, info=info)


def expand(configs: list[Run], seeds: int, role: str | None, data_dir: str | None) -> dict[str, Run]:
    """Every configuration once per seed (seed-major), named `<config>-s<seed>`."""
    runs = {}
    for seed in range(seeds):
        for c in configs:
            if seed >= (c.seeds if c.seeds is not None else seeds):
                continue
            run = copy.deepcopy(c)
            run.seed, run.seeds = seed, None
            run.role = c.role or role
            run.corpus = corpus_name(run.role, data_dir)
            # sweep logs stay readable
            run.overrides = [*c.overrides, f"seed={seed}", "trainer.enable_progress_bar=false"]
            if c.after is not None:
                run.after = f"{c.after}-s{seed}"
            runs[run.name] = run
    return runs


def load_sweep(name: str, known: tuple[str, ...] = ()) -> dict:
    """A sweep definition (conf/sweep/<name>.yaml) as plain data (interpolations stay strings)."""
    path = resources.files("ttt_bench.conf") / "sweep" / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown sweep '{name}'; use one of {', '.join(known)}")
    return yaml.safe_load(path.read_text())


def check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise UserError(f"unknown profile '{profile}'; use one of {', '.join(PROFILES)}")


def identity(overrides: str | list[str]) -> list[str]:
    """What makes two runs the same run across machines: the overrides (a list, or space-joined as
    registries hold them) without paths, which differ from machine to machine."""
    items = overrides.split() if isinstance(overrides, str) else overrides
    return [o for o in items if not o.startswith(("paths.", "recipe.init_from="))]


def data_overrides(role: str, data_dir: str | None) -> list[str]:
    """Pile-like or Books-like data: the real corpora under `data_dir`, else the embedded synthetic corpus."""
    if data_dir is None:
        return ["data=synthetic"]
    return [f"data={role}", f"paths.data_dir={Path(data_dir).resolve()}"]


def corpus_name(role: str | None, data_dir: str | None) -> str:
    """The corpus a run actually reads, for tables and figure titles."""
    return "synthetic" if data_dir is None else f"{role}-mini"


def merge(overrides: list[str], change: list[str]) -> list[str]:
    """`overrides` with `change` applied: a key set again takes its new value in place (Hydra refuses a
    key given twice)."""
    keys = {o.split("=", 1)[0]: i for i, o in enumerate(overrides)}
    out = list(overrides)
    for c in change:
        k = c.split("=", 1)[0]
        if k in keys:
            out[keys[k]] = c
        else:
            keys[k] = len(out)
            out.append(c)
    return out


def value(overrides: list[str], key: str) -> int:
    """The last value given to `key` in a list of overrides, as an integer."""
    return int([o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")][-1])


def seedless(overrides) -> tuple[str, ...]:
    """What sets a run's model and cost: its overrides without the seed and logging switches (the key runs
    of several seeds share a composition by)."""
    return tuple(o for o in overrides if not o.startswith(SEEDLESS))


def composed(overrides: list[str]):
    """The run's composed config (a copy: callers may change it), composed once per process."""
    return copy.deepcopy(_compose(tuple(overrides)))


@functools.cache
def _compose(overrides: tuple[str, ...]):
    return compose("train", list(overrides))


def composed_model(overrides: list[str]) -> tuple[dict, int]:
    """The resolved model config and context of a run (the seed sets neither)."""
    from omegaconf import OmegaConf

    cfg = _compose(seedless(overrides))
    return OmegaConf.to_container(cfg.model, resolve=True), int(cfg.data.seq_len)
