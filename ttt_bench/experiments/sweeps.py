"""Sweeps as data: a sweep (conf/sweep/<name>.yaml) expands into named runs, each a list of `ttt-bench train`
overrides, launched as one Hydra multirun (basic launcher by default; hydra/launcher=joblib or
submitit_slurm by override) into one folder:

    <out>/plan.json              the expanded runs: name -> overrides, labels, paper numbers, dependencies
    <out>/<run>/metrics.json     written by train(), or {"status": "failed", "error": ...}
    <out>/<run>/run.json         the run's overrides and the command that reproduces it
    <out>/<run>/hydra/           Hydra's job files and log
    <out>/registry.csv           every run's metrics, merged on read from the metrics.json files

Re-running a sweep skips finished runs and resumes interrupted ones (train() resumes from last.ckpt); a
failed run is recorded and does not stop the sweep. Runs with `after` (TF finetune) start once the run
they depend on has finished.
"""

import json
import logging
import shlex
import shutil
import sys
from importlib import resources
from pathlib import Path

import pandas as pd
import yaml

from ..errors import UserError
from ..flops import match_flops
from ..io import write_atomic, write_json

log = logging.getLogger(__name__)
SWEEPS = ("table1", "minibatch", "scaling")
PROFILES = ("smoke", "cpu", "paper")


def load_sweep(name: str) -> dict:
    """The sweep definition as plain data (interpolations such as ${data.seq_len} stay strings)."""
    path = resources.files("ttt_bench.conf") / "sweep" / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown sweep '{name}'; use one of {', '.join(SWEEPS)}")
    return yaml.safe_load(path.read_text())


def data_overrides(role: str, data_dir: str | None) -> list[str]:
    """Pile-like or Books-like data: the real corpora under `data_dir`, else the embedded synthetic corpus."""
    if data_dir is None:
        return ["data=synthetic"]
    return [f"data={role}", f"paths.data_dir={Path(data_dir).resolve()}"]


def _run(overrides: list[str], **info) -> dict:
    return {"overrides": list(overrides), "after": None, **info}


def plan_table1(sweep: dict, profile: str, data_dir: str | None) -> dict:
    base = data_overrides(sweep["data"], data_dir) + sweep["profiles"][profile]
    return {
        f"{i + 1}-{row['name']}": _run(
            base + row["overrides"], label=row["label"], row=i + 1, paper_ppl=row["paper_ppl"]
        )
        for i, row in enumerate(sweep["runs"])
    }


def plan_minibatch(sweep: dict, profile: str, data_dir: str | None) -> dict:
    base = data_overrides(sweep["data"], data_dir) + sweep["profiles"][profile] + sweep["model"]
    runs = {}
    for b in sweep["mini_batch_sizes"]:
        value = "${data.seq_len}" if b == "T" else b
        runs[f"b{b}"] = _run(
            base + [f"model.block.mini_batch_size={value}"],
            label=f"b={b}",
            mini_batch=str(b),
            paper_ppl=sweep["paper_ppl"].get(b),
        )
    return runs


def _model_cfg(overrides: list[str]) -> tuple[dict, int]:
    from omegaconf import OmegaConf

    from ..config import compose

    cfg = compose("train", overrides)
    return OmegaConf.to_container(cfg.model, resolve=True), int(cfg.data.seq_len)


def plan_scaling(sweep: dict, profile: str, data_dir: str | None, vocab_size: int = 256) -> dict:
    p, methods = sweep["profiles"][profile], sweep["methods"]
    tokens = lambda scale: f"recipe.total_tokens='${{ttt.mul:${{size.tokens}},{scale:g}}}'"
    runs = {}

    def fit_micro_batch(override: str, T: int) -> str:
        """A micro-batch of at most the step's sequences: long contexts under a fixed tokens-per-batch
        have few of them."""
        key, _, value = override.partition("=")
        if key != "data.micro_batch_size":
            return override
        tokens = [o.split("=")[1] for o in p["overrides"] if o.startswith("recipe.tokens_per_batch=")]
        return override if not tokens else f"{key}={min(int(value), max(1, int(tokens[0]) // T))}"

    def add(role, key, label, size, T, extra=(), suffix=""):
        overrides = [
            *data_overrides(role, data_dir),
            *(fit_micro_batch(o, T) for o in p["overrides"]),
            f"size={size}",
            f"data.seq_len={T}",
            tokens(p["token_scale"]),
            *extra,
        ]
        if key in ("transformer", "tf_finetune") and T >= p["rope_500k_from"]:
            overrides.append("model.block.rope_theta=500000")
        name = f"{role}-{key}-{size}-T{T}{suffix}"
        runs[name] = _run(overrides, label=label, method=key, role=role, size=size, seq_len=T)
        return name

    for role in ("pile", "books"):
        for size in p["sizes"]:
            for T in p[role]:
                for key in sweep[role]:
                    add(role, key, methods[key]["label"], size, T, methods[key]["overrides"])
    ft = sweep["finetune"]
    for i, size in enumerate(p["sizes"]):
        parent = f"books-{ft['from']}-{size}-T{p['finetune_base']}"
        for T in (T for T in p["books"] if T >= 2 * p["finetune_base"]):
            lr = ft["lr_smallest"] if i == 0 else ft["lr"]
            name = add(
                "books",
                "tf_finetune",
                ft["label"],
                size,
                T,
                [
                    *methods[ft["from"]]["overrides"],
                    "recipe=finetune",
                    f"recipe.lr={lr}",
                    tokens(0.2 * p["token_scale"]),
                ],
            )
            runs[name]["after"] = parent
    # matched training FLOPs (Figures 2 right, 14): the largest size at the longest Books context
    m = sweep["matched"]
    size, T = p["sizes"][-1], p.get("matched_context", p["books"][-1])
    ref_name = f"books-{m['reference']}-{size}-T{T}"
    reference, _ = _model_cfg(runs[ref_name]["overrides"])
    for key, by in m["methods"].items():
        base = runs[f"books-{key}-{size}-T{T}"]["overrides"]
        new, ratio = match_flops(_model_cfg(base)[0], reference, T, vocab_size, by=by)
        name = add(
            "books",
            key,
            methods[key]["label"],
            size,
            T,
            [*methods[key]["overrides"], *(f"{k}={v}" for k, v in new.items())],
            suffix="-matched",
        )
        runs[name] |= {"matched": by, "flops_ratio": round(ratio, 4), "reference": ref_name}
    return runs


PLANNERS = {"table1": plan_table1, "minibatch": plan_minibatch, "scaling": plan_scaling}


def plan_sweep(name: str, profile: str, data_dir: str | None = None) -> dict:
    if profile not in PROFILES:
        raise UserError(f"unknown profile '{profile}'; use one of {', '.join(PROFILES)}")
    runs = PLANNERS[name](load_sweep(name), profile, data_dir)
    for spec in runs.values():  # sweep logs stay readable
        spec["overrides"].append("trainer.enable_progress_bar=false")
    return runs


# ---- running ----


def read_metrics(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def finished(run_dir: Path) -> bool:
    return (read_metrics(run_dir) or {}).get("status") == "finished"


def record_failure(run_dir: Path, error: str) -> None:
    write_json(Path(run_dir) / "metrics.json", {"status": "failed", "error": error, "run_dir": str(run_dir)})


def one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("full_key")]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def run_one(name: str, spec: dict, run_dir: Path) -> None:
    """Train one run of a plan unless it has finished; record a failure instead of raising."""
    import hydra

    from ..training.train import train

    try:
        recorded = json.loads((Path(run_dir) / "run.json").read_text())["overrides"]
    except (OSError, ValueError, KeyError):
        recorded = None
    if recorded is not None and recorded != spec["overrides"]:  # planned anew with other settings: stale
        log.info("run %s was made with other overrides; training it again", name)
        shutil.rmtree(run_dir)
    elif finished(run_dir):
        return
    command = "ttt-bench train " + " ".join(shlex.quote(o) for o in spec["overrides"])
    write_json(run_dir / "run.json", {"name": name, **spec, "command": command})
    try:
        cfg = hydra.compose(config_name="train", overrides=spec["overrides"])
        train(cfg, run_dir)
    except Exception as e:  # noqa: BLE001  (a failed run is data, not the end of the sweep)
        log.exception("run %s failed", name)
        record_failure(run_dir, one_line(e))


def _job(cfg) -> None:
    """The Hydra task of a sweep's multirun: one run of the plan, picked by `+run=<name>`."""
    plan = json.loads(Path(cfg.sweep_plan).read_text())
    run_one(cfg.run, plan["runs"][cfg.run], Path(plan["dir"]) / cfg.run)


def launch(plan_path: Path, names: list[str], launcher: list[str]) -> None:
    """One Hydra multirun over the runs `names` of a written plan (e.g. hydra/launcher=joblib)."""
    import hydra

    import ttt_bench.config  # noqa: F401  (registers resolvers)

    out = plan_path.parent
    argv = [
        "--multirun",
        f"+sweep_plan='{plan_path}'",
        "+run=" + ",".join(f"'{n}'" for n in names),
        f"hydra.sweep.dir='{out}'",
        "hydra.sweep.subdir=${run}/hydra",
        *launcher,
    ]
    saved = sys.argv
    sys.argv = ["ttt-bench ablate", *argv]
    try:
        hydra.main(config_path="pkg://ttt_bench.conf", config_name="train", version_base="1.3")(_job)()
    finally:
        sys.argv = saved


def check_configs(runs: dict, out: Path) -> list[str]:
    """Compose every run's config up front: a run whose config does not compose (a model config that does
    not exist yet, a bad override) is recorded as failed instead of stopping the multirun."""
    from ..config import compose

    ok = []
    for name, spec in runs.items():
        try:
            compose("train", spec["overrides"])
            ok.append(name)
        except Exception as e:  # noqa: BLE001
            record_failure(out / name, one_line(e))
    return ok


def run_sweep(
    name: str, profile: str, out: Path, data_dir: str | None = None, launcher: list[str] = ()
) -> pd.DataFrame:
    """Plan, run (skipping finished runs) and tabulate a sweep; returns the registry."""
    out = Path(out).resolve()
    runs = plan_sweep(name, profile, data_dir)
    for spec in runs.values():  # TF finetune starts from the weights of the run it depends on
        if spec["after"] is not None:
            ckpt = out / spec["after"] / "checkpoints" / "last.ckpt"
            spec["overrides"].append(f"recipe.init_from='{ckpt}'")
    plan_path = out / "plan.json"
    plan = {"sweep": name, "profile": profile, "dir": str(out), "order": list(runs), "runs": runs}
    write_json(plan_path, plan)
    valid = check_configs(runs, out)
    for stage in (False, True):  # runs without dependencies, then those that start from another run
        todo = []
        for n in valid:
            if (runs[n]["after"] is not None) != stage or finished(out / n):
                continue
            if stage and not finished(out / runs[n]["after"]):
                record_failure(out / n, f"the run it starts from ({runs[n]['after']}) did not finish")
                continue
            todo.append(n)
        log.info("sweep %s (%s): %d runs to train%s", name, profile, len(todo), "" if stage else " first")
        if todo:
            launch(plan_path, todo, list(launcher))
    return write_registry(out)


# ---- the registry ----


def collect(out: Path) -> pd.DataFrame:
    """Every run of a sweep folder as one row: plan info, then metrics (missing runs: status 'pending')."""
    out = Path(out)
    plan = json.loads((out / "plan.json").read_text())
    rows = []
    for name in plan["order"]:  # the plan's order (json keys are sorted)
        spec = plan["runs"][name]
        metrics = read_metrics(out / name) or {"status": "pending"}
        info = {k: v for k, v in spec.items() if k not in ("overrides", "after")}
        rows.append(
            {
                "run": name,
                "sweep": plan["sweep"],
                "profile": plan["profile"],
                **info,
                **metrics,
                "after": spec["after"],
                "overrides": " ".join(spec["overrides"]),
            }
        )
    df = pd.DataFrame(rows)
    if "train_flops" not in df:
        df["train_flops"] = float("nan")
    # TF finetune's budget includes its pretraining (the x axis of Figures 13 and 18)
    own = pd.to_numeric(df["train_flops"], errors="coerce")
    parent = df["after"].map(dict(zip(df["run"], own, strict=True)))
    df["total_train_flops"] = own + parent.fillna(0.0)
    return df


def write_registry(out: Path) -> pd.DataFrame:
    df = collect(out)
    write_atomic(Path(out) / "registry.csv", df.to_csv(index=False))
    return df


def read_registry(path: Path) -> pd.DataFrame:
    path = Path(path)
    if path.is_dir():
        return collect(path) if (path / "plan.json").is_file() else pd.read_csv(path / "registry.csv")
    if not path.is_file():
        raise UserError(f"no registry at {path}; run `ttt-bench ablate SWEEP --out DIR` first")
    return pd.read_csv(path)
