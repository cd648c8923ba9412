from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ttt_bench.config import compose

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {
    g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
    for g in ["model", "size", "data", "recipe", "trainer"]
}


@pytest.mark.parametrize("size", GROUPS["size"])
@pytest.mark.parametrize("model", GROUPS["model"])
def test_every_model_and_size_composes_and_resolves(model, size):
    task = ["task=image"] if size.startswith("vit_") else []  # ViT sizes have no token budget: images only
    cfg = compose("train", [*task, f"model={model}", f"size={size}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["model"]["_target_"] and resolved["size"]["name"] == size


def test_every_experiment_preset_composes_with_every_model():
    experiments = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    assert experiments
    for experiment in experiments:
        for model in GROUPS["model"]:
            cfg = compose("train", [f"experiment={experiment}", f"model={model}"])
            resolved = OmegaConf.to_container(cfg, resolve=True)
            assert resolved["model"]["name"] == model and resolved["data"]["seq_len"] >= 256


@pytest.mark.parametrize("group", ["data", "recipe", "trainer"])
def test_every_option_of_other_groups_composes(group):
    for option in GROUPS[group]:
        cfg = compose(
            "train", [f"{group}={option}"] + (["data.corpus.train_files=x.txt"] if option == "text" else [])
        )
        OmegaConf.to_container(cfg[group], resolve=True)


def test_recipe_is_the_papers_improved_recipe():
    r = compose("train", ["size=125m", "recipe=paper"])
    assert tuple(r.recipe.optimizer.betas) == (0.9, 0.95) and r.recipe.optimizer.weight_decay == 0.1
    assert r.recipe.grad_clip == 1.0 and r.recipe.warmup_fraction == 0.1 and r.recipe.min_lr == 1e-5
    assert (
        r.recipe.tokens_per_batch == 2**19 and r.trainer.max_steps == 4769
    )  # Table 3: 4800 steps, 2.5B tokens
    assert r.recipe.lr == 3e-3


def test_trainer_configs_use_lightning_strategies():
    assert compose("train", ["trainer=ddp"]).trainer.strategy == "ddp"
    assert compose("train", ["trainer=fsdp"]).trainer.strategy._target_.endswith("fsdp_strategy")
    assert compose("train", ["trainer=gpu"]).trainer.precision == "bf16-mixed"
    # the multi-process trainers' precision follows the accelerator: float32 for CPU processes, as trainer=cpu
    for trainer in ("ddp", "fsdp", "slurm"):
        cfg = compose("train", [f"trainer={trainer}", "trainer.accelerator=cpu"])
        assert cfg.trainer.precision == "32-true"


def test_every_config_group_folder_is_an_installed_package():
    """conf/ installs as ttt_bench.conf: a config group folder missing from pyproject's package list is left
    out of a wheel (`pip install .`, a cluster's environment) and makes setuptools warn on every install."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    packages = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("ttt_bench", *d.relative_to(root).parts)) for d in (root / "conf").rglob("*")
               if d.is_dir() and any(d.rglob("*.yaml"))}
    assert folders <= packages, sorted(folders - packages)
