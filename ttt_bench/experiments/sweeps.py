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

import copy
import functools
import json
import logging
import shlex
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

import pandas as pd
import yaml

from ..errors import UserError
from ..flops import match_flops
from ..io import write_atomic, write_json
from ..training.run_folder import in_use

log = logging.getLogger(__name__)
SWEEPS = ("table1", "minibatch", "scaling", "recall", "longrange")
PROFILES = ("smoke", "quick", "cpu", "paper")


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


def corpus_name(role: str, data_dir: str | None) -> str:
    """The corpus a run actually reads, for tables and figure titles."""
    return "synthetic" if data_dir is None else f"{role}-mini"


def _run(overrides: list[str], **info) -> dict:
    """A planned run: its overrides and what the tables need to know of it (its context among them)."""
    seq_len = [o.split("=", 1)[1] for o in overrides if o.startswith("data.seq_len=")]
    if seq_len and seq_len[-1].isdigit():
        info.setdefault("seq_len", int(seq_len[-1]))
    return {"overrides": list(overrides), "after": None, **info}


def _merge(overrides: list[str], change: list[str]) -> list[str]:
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


def plan_table1(sweep: dict, profile: str, data_dir: str | None) -> dict:
    """The ladder: a row with `change` is the row above with that change; references follow the rows."""
    base = data_overrides(sweep["data"], data_dir) + sweep["profiles"][profile]["overrides"]
    runs, model = {}, []
    for i, row in enumerate(sweep["runs"]):
        model = list(row["overrides"]) if "overrides" in row else _merge(model, row["change"])
        runs[f"{i + 1}-{row['name']}"] = _run(
            base + model,
            label=row["label"],
            row=i + 1,
            paper_ppl=row.get("paper_ppl"),
            change=" ".join(row.get("change", [])),
        )
    for ref in sweep.get("references", []):
        runs[ref["name"]] = _run(base + ref["overrides"], label=ref["label"], row=None, paper_ppl=None)
    return runs


def plan_minibatch(sweep: dict, profile: str, data_dir: str | None) -> dict:
    p = sweep["profiles"][profile]
    base = data_overrides(sweep["data"], data_dir) + p["overrides"] + sweep["model"]
    runs = {}
    for b in p.get("mini_batch_sizes", sweep["mini_batch_sizes"]):
        value = "${data.seq_len}" if b == "T" else b
        runs[f"b{b}"] = _run(
            base + [f"model.block.mini_batch_size={value}"],
            label=f"b={b}",
            mini_batch=str(b),
            paper_ppl=sweep["paper_ppl"].get(b),
        )
    return runs


def _model_cfg(overrides: list[str]) -> tuple[dict, int]:
    model, seq_len = _composed_model(_without_seed(overrides))
    return copy.deepcopy(model), seq_len


@functools.cache
def _composed_model(overrides: tuple[str, ...]) -> tuple[dict, int]:
    from omegaconf import OmegaConf

    from ..config import compose

    cfg = compose("train", list(overrides))
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

    def finetune(size, T, extra=(), suffix=""):
        """TF finetune (Section 3.2): the Transformer pretrained at finetune_base, +20% tokens at T."""
        lr = ft["lr_smallest"] if size == p["sizes"][0] else ft["lr"]
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
                tokens(ft["token_fraction"] * p["token_scale"]),
                *extra,
            ],
            suffix,
        )
        runs[name]["after"] = f"books-{ft['from']}-{size}-T{p['finetune_base']}{suffix}"
        # the finetune recipe replaces the profile's (its recipe.* keys, e.g. tokens per batch, still apply)
        runs[name]["overrides"] = [
            o for o in runs[name]["overrides"] if not o.startswith("recipe=") or o == "recipe=finetune"
        ]
        return name

    for role in ("pile", "books"):
        for size in p["sizes"]:
            for T in p[role]:
                for key in p.get(f"{role}_methods", sweep[role]):
                    add(role, key, methods[key]["label"], size, T, methods[key]["overrides"])
    ft = sweep["finetune"]
    for size in p["sizes"]:
        for T in (T for T in p["books"] if T >= 2 * p["finetune_base"]):
            finetune(size, T)
    # matched training FLOPs (Figures 2 right, 14): the largest size at the longest Books context, every
    # method matched to Mamba: TF finetune (pretrain at finetune_base + 20% at T) by depth, TTT by MLP width
    # (a profile's `matched_in_grid`: the matched runs replace those grid points instead of joining them)
    m = sweep["matched"]
    size, T, base = p["sizes"][-1], p.get("matched_context", p["books"][-1]), p["finetune_base"]
    suffix = "" if p.get("matched_in_grid") else "-matched"
    ref_name = f"books-{m['reference']}-{size}-T{T}"
    reference, _ = _model_cfg(runs[ref_name]["overrides"])
    for key, by in m["methods"].items():
        info = {"matched": by, "reference": ref_name}
        if key == "tf_finetune":
            model, _ = _model_cfg(runs[f"books-{ft['from']}-{size}-T{base}"]["overrides"])
            new, ratio = match_flops(
                model, reference, T, vocab_size, by=by, schedule=[(base, 1.0), (T, ft["token_fraction"])]
            )
            extra = [f"{k}={v}" for k, v in new.items()]
            label = methods[ft["from"]]["label"]
            add(
                "books",
                ft["from"],
                f"{label} (pretraining of the matched TF finetune)" if suffix else label,
                size,
                base,
                [*methods[ft["from"]]["overrides"], *extra],
                suffix=suffix,
            )
            name = finetune(size, T, extra, suffix=suffix)
        else:
            new, ratio = match_flops(
                _model_cfg(runs[f"books-{key}-{size}-T{T}"]["overrides"])[0], reference, T, vocab_size, by=by
            )
            name = add(
                "books",
                key,
                methods[key]["label"],
                size,
                T,
                [*methods[key]["overrides"], *(f"{k}={v}" for k, v in new.items())],
                suffix=suffix,
            )
        runs[name] |= {**info, "flops_ratio": round(ratio, 4)}
    # the key comparisons (the largest size at the longest Books context, TF finetune, matched FLOPs) take
    # the profile's seeds; every other grid point takes `other_seeds`
    for spec in runs.values():
        key = (
            spec["size"] == size
            and spec["role"] == "books"
            and (spec["seq_len"] == T or (spec["seq_len"] == base and spec["method"] == ft["from"]))
        )
        if not key and "other_seeds" in p:
            spec["seeds"] = p["other_seeds"]
    return runs


def plan_recall(sweep: dict, profile: str, data_dir: str | None, lrs: dict | None = None) -> dict:
    """MQAR: methods x widths x numbers of pairs at each method's learning rate `lrs[method]`; without
    `lrs` (and with more than one lr in the profile), the calibration grid: every lr of the profile for
    every method at its calibration width and number of pairs, one seed."""
    from ..models.state_size import state_floats

    p, methods = sweep["profiles"][profile], sweep["methods"]
    tokens = p["steps"] * _value(sweep["recipe"] + p["overrides"], "recipe.tokens_per_batch")
    base = [
        f"data={sweep['data']}",
        *sweep["recipe"],
        *p["overrides"],
        f"data.seq_len={p['seq_len']}",
        f"recipe.total_tokens={tokens}",
    ]
    grid = [(w, n) for w in p["widths"] for n in p["pairs"]]
    calibrating = lrs is None and len(p["lrs"]) > 1
    if calibrating:
        cal = p["calibration"]
        grid = [(cal["width"], cal["pairs"])]
    runs = {}
    for key in p.get("methods", methods):
        for width, pairs in grid:
            for lr in p["lrs"] if calibrating else [(lrs or {}).get(key, p["lrs"][0])]:
                overrides = [
                    *base,
                    *methods[key]["overrides"],
                    f"size.d_model={width}",
                    f"size.mlp_hidden={width}",
                    f"data.num_kv_pairs={pairs}",
                    f"size.lr={lr:g}",
                ]
                model, seq_len = _model_cfg(overrides)
                name = f"{key}-d{width}-n{pairs}" + (f"-lr{lr:g}" if calibrating else "")
                runs[name] = _run(
                    overrides,
                    label=methods[key]["label"],
                    method=key,
                    width=width,
                    pairs=pairs,
                    lr=lr,
                    state_floats=state_floats(model, seq_len)["total"],
                    role="mqar",
                )
                if calibrating:
                    runs[name]["seeds"] = 1
    return runs


def plan_longrange(sweep: dict, profile: str, data_dir: str | None) -> dict:
    """The main models at one long context on the synthetic corpus (its facts are labelled), whatever
    `data_dir` says."""
    p = sweep["profiles"][profile]
    return {
        key: _run([f"data={sweep['data']}", *p["overrides"], *m["overrides"]], label=m["label"], method=key,
                  role=sweep["data"])
        for key, m in sweep["methods"].items()
    }


def _value(overrides: list[str], key: str) -> int:
    """The last value given to `key` in a list of overrides, as an integer."""
    return int([o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")][-1])


def best_lrs(calibration: pd.DataFrame) -> dict:
    """Each method's learning rate from a calibration registry: the highest answer accuracy, ties broken by
    the lower answer loss (Zoology keeps the best lr per model)."""
    df = calibration[calibration["status"] == "finished"].copy()
    df = df.sort_values(["val_accuracy", "val_loss"], ascending=[False, True])
    return {m: float(g["lr"].iloc[0]) for m, g in df.groupby("method", sort=False)}


PLANNERS = {
    "table1": plan_table1,
    "minibatch": plan_minibatch,
    "scaling": plan_scaling,
    "recall": plan_recall,
    "longrange": plan_longrange,
}

# MTTT image classification (experiments/mttt.py, docs/mttt.md)
from .mttt import MTTT_SWEEPS, plan_mttt  # noqa: E402

SWEEPS += MTTT_SWEEPS
PLANNERS.update(dict.fromkeys(MTTT_SWEEPS, plan_mttt))


def seeds_of(sweep: dict, profile: str) -> int:
    return int(sweep["profiles"][profile].get("seeds", 1))


def plan_sweep(name: str, profile: str, data_dir: str | None = None, **options) -> dict:
    """Every run of a sweep: each configuration of the planner once per seed (`<config>-s<seed>`).
    `options` go to the planner (the recall sweep's chosen learning rates)."""
    if profile not in PROFILES:
        raise UserError(f"unknown profile '{profile}'; use one of {', '.join(PROFILES)}")
    sweep = load_sweep(name)
    role = sweep.get("data")
    runs = {}
    configs = PLANNERS[name](sweep, profile, data_dir, **options)
    # seed-major: an interrupted sweep has every configuration at its first seeds
    for seed, (config, spec) in ((s, c) for s in range(seeds_of(sweep, profile)) for c in configs.items()):
        if seed >= spec.get("seeds", seed + 1):
            continue
        run = {k: v for k, v in spec.items() if k != "seeds"} | {"config": config, "seed": seed}
        run["role"] = spec.get("role", role)
        run["corpus"] = corpus_name(run["role"], data_dir)
        # sweep logs stay readable
        run["overrides"] = [*spec["overrides"], f"seed={seed}", "trainer.enable_progress_bar=false"]
        if spec["after"] is not None:
            run["after"] = f"{spec['after']}-s{seed}"
        runs[f"{config}-s{seed}"] = run
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


class Progress:
    """The whole pipeline's progress line, "run k/N, elapsed, ETA": `make reproduce` plans it over every
    sweep; a sweep run alone counts its own runs. It lives in a file (`path`), so that every process that
    trains the pipeline's runs (Hydra's joblib workers, a second `make reproduce`) reports the same line; the
    run folders say which runs have finished. The ETA scales the time spent so far by the planned tokens
    still to train (composed here, before Hydra's multirun holds the global config)."""

    def __init__(self, path: Path, tokens: dict | None = None, finished_before: list | None = None,
                 start: float | None = None):
        self.path = Path(path)
        self.tokens: dict[str, float] = tokens or {}  # run folder -> planned tokens
        self.finished_before = set(finished_before or ())  # finished when planned: not this session's work
        self.start = start or time.time()

    def plan(self, runs: dict, out: Path) -> None:
        from ..config import compose

        for name, spec in runs.items():
            run_dir = str(Path(out) / name)
            if finished(run_dir):
                self.finished_before.add(run_dir)
                self.tokens[run_dir] = 0.0
                continue
            try:
                self.tokens[run_dir] = float(compose("train", spec["overrides"]).recipe.total_tokens)
            except Exception:  # noqa: BLE001  (a config that does not compose is recorded as failed)
                self.tokens[run_dir] = 0.0
        write_json(self.path, {"tokens": self.tokens, "finished_before": sorted(self.finished_before),
                               "start": self.start})

    @classmethod
    def load(cls, path: Path) -> "Progress":
        try:
            return cls(path, **json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError):
            return cls(path)

    def begin(self, name: str) -> None:
        done = {d for d in self.tokens if finished(d)}
        trained = sum(t for d, t in self.tokens.items() if d in done and d not in self.finished_before)
        left = sum(t for d, t in self.tokens.items() if d not in done)
        elapsed = time.time() - self.start
        eta = f"ETA {elapsed / trained * left / 60:.0f} min" if trained else "ETA after a run"
        log.info("run %d/%d (%s): elapsed %.1f min, %s", len(done) + 1, len(self.tokens), name, elapsed / 60,
                 eta)


def run_one(name: str, spec: dict, run_dir: Path, progress: Progress) -> None:
    """Train one run of a plan unless it has finished; record a failure instead of raising."""
    import hydra

    from ..training.run_folder import RunFolderInUse
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
    progress.begin(name)
    try:
        cfg = hydra.compose(config_name="train", overrides=spec["overrides"])
        train(cfg, run_dir)
    except RunFolderInUse:  # another process of the same sweep trains it: two processes share a sweep
        log.info("run %s is being trained by another process; skipped here", name)
    except Exception as e:  # noqa: BLE001  (a failed run is data, not the end of the sweep)
        log.exception("run %s failed", name)
        record_failure(run_dir, one_line(e))


def _job(cfg) -> None:
    """The Hydra task of a sweep's multirun: one run of the plan, picked by `+run=<name>`."""
    plan = json.loads(Path(cfg.sweep_plan).read_text())
    run_one(cfg.run, plan["runs"][cfg.run], Path(plan["dir"]) / cfg.run, Progress.load(plan["progress"]))


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
    name: str,
    profile: str,
    out: Path,
    data_dir: str | None = None,
    launcher: list[str] = (),
    pipeline: Progress | None = None,
    committed: Path | None = None,
    train: bool = True,
    options: dict | None = None,
) -> pd.DataFrame:
    """Plan, run (skipping finished runs) and tabulate a sweep, with its n-gram floors; returns the
    registry. `pipeline`: the progress of a whole pipeline this sweep is part of (else its own);
    `committed`: a registry of earlier sessions whose finished runs count as done (see `restore`);
    `train=False` tabulates the runs finished so far and trains nothing; `options` go to the planner."""
    out = Path(out).resolve()
    runs = plan_sweep(name, profile, data_dir, **(options or {}))
    if committed is not None:
        restore(out, runs, committed)
    if pipeline is None:
        pipeline = Progress(out / "progress.json")
        pipeline.plan(runs, out)
    for spec in runs.values():  # TF finetune starts from the weights of the run it depends on
        if spec["after"] is not None:
            ckpt = out / spec["after"] / "checkpoints" / "last.ckpt"
            spec["overrides"].append(f"recipe.init_from='{ckpt}'")
    plan_path = out / "plan.json"
    plan = {"sweep": name, "profile": profile, "dir": str(out), "order": list(runs), "runs": runs,
            "progress": str(pipeline.path)}
    write_json(plan_path, plan)
    valid = check_configs(runs, out)
    for stage in (False, True):  # runs without dependencies, then those that start from another run
        todo = []
        for n in valid:
            if (runs[n]["after"] is not None) != stage or finished(out / n):
                continue
            if stage and not finished(out / runs[n]["after"]):
                if in_use(out / runs[n]["after"]):  # another process of this sweep trains it: its turn
                    log.info("run %s waits for %s, trained by another process", n, runs[n]["after"])
                else:
                    record_failure(out / n, f"the run it starts from ({runs[n]['after']}) did not finish")
                continue
            todo.append(n)
        log.info("sweep %s (%s): %d runs to train%s", name, profile, len(todo), "" if stage else " first")
        if todo and train:
            launch(plan_path, todo, list(launcher))
    write_floors(out, runs)
    return write_registry(out)


# Training FLOP/s of the small CPU models on the 2-core reference machine (a Transformer at size=xs: ~30
# GFLOP/s by flops.py's count, `ttt-bench bench models`): what `ablate --plan` divides by.
CPU_TRAIN_FLOPS = 30e9


def estimate(spec: dict) -> dict:
    """A planned run's tokens, training FLOPs (flops.py) and minutes at CPU_TRAIN_FLOPS."""
    return dict(_estimate(_without_seed(spec["overrides"])))


def _without_seed(overrides: list[str]) -> tuple[str, ...]:
    """The overrides that set a run's cost and model (the seed sets neither): a key for composing once per
    group of seeds."""
    return tuple(o for o in overrides if not o.startswith("seed="))


@functools.cache
def _estimate(overrides: tuple[str, ...]) -> dict:
    from omegaconf import OmegaConf

    from ..config import compose
    from ..flops import flops_per_token

    cfg = compose("train", list(overrides))
    if cfg.get("task", {}).get("name") == "image":  # MTTT: images, FLOPs counted (experiments/mttt.py)
        from .mttt import estimate_image

        return estimate_image(cfg, CPU_TRAIN_FLOPS)
    tokenizer = cfg.data.get("tokenizer") or {}
    vocab = cfg.data.get("vocab_size") or tokenizer.get("vocab_size") or 257  # byte-level by default
    tokens = float(cfg.recipe.total_tokens)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    flops = flops_per_token(model, int(cfg.data.seq_len), int(vocab))["train"] * tokens
    return {"tokens": tokens, "train_flops": flops, "minutes": flops / CPU_TRAIN_FLOPS / 60}


def calibrates(profile: str) -> bool:
    """Whether the recall sweep picks learning rates on a calibration grid in this profile."""
    return len(load_sweep("recall")["profiles"][profile]["lrs"]) > 1


def run_recall(
    profile: str,
    out: Path,
    data_dir: str | None = None,
    launcher: list[str] = (),
    pipeline: Progress | None = None,
    committed: Path | None = None,
    train: bool = True,
) -> tuple[pd.DataFrame, pd.DataFrame | None, dict]:
    """The recall sweep's two stages: the calibration grid in <out>/calibration, each method's best learning
    rate from it (`best_lrs`), then the whole grid at those rates in <out>. `committed`: a folder with an
    earlier session's registry.csv and calibration.csv. Returns (registry, calibration registry, lrs)."""
    out = Path(out)
    kw = {"launcher": launcher, "pipeline": pipeline, "train": train}
    cal, lrs = None, {}
    if calibrates(profile):
        cal = run_sweep(
            "recall",
            profile,
            out / "calibration",
            data_dir,
            committed=committed and Path(committed) / "calibration.csv",
            **kw,
        )
        lrs = best_lrs(cal)
    reg = run_sweep(
        "recall",
        profile,
        out,
        data_dir,
        committed=committed and Path(committed) / "registry.csv",
        options={"lrs": lrs},
        **kw,
    )
    return reg, cal, lrs


FLOOR_ORDERS = (1, 2, 3, 4, 5)  # every table lists them all
DRAWN_FLOORS = ("unigram", "bigram", "5-gram (Witten-Bell)")  # the figures draw these


def write_floors(out: Path, runs: dict) -> pd.DataFrame:
    """The byte n-gram floors (ttt_bench/ngram.py) of every (corpus, context) the sweep's runs validate on,
    as <out>/floors.csv, and per corpus role at its longest context as <out>/floors.json (the figures)."""
    from ..config import compose
    from ..ngram import floors_for

    rows, seen = [], set()
    for spec in runs.values():
        try:
            cfg = compose("train", spec["overrides"])
        except Exception:  # noqa: BLE001  (recorded as a failed run by check_configs)
            continue
        role = spec.get("role", cfg.data.name)
        if cfg.get("task", {}).get("name") == "image":  # MTTT: images, no text floors
            continue
        if cfg.data.name == "mqar":  # synthetic recall: no text to model, chance is in the recall table
            continue
        key = (role, int(cfg.data.seq_len), cfg.data.val_tokens)
        if key in seen:
            continue
        seen.add(key)
        for floor, ppl in floors_for(cfg, orders=FLOOR_ORDERS).items():
            rows.append(
                {
                    "role": role,
                    "corpus": spec.get("corpus"),
                    "seq_len": key[1],
                    "floor": floor,
                    "val_ppl": ppl,
                }
            )
    df = pd.DataFrame(rows, columns=["role", "corpus", "seq_len", "floor", "val_ppl"])
    write_atomic(out / "floors.csv", df.to_csv(index=False))
    longest = df[
        (df["seq_len"] == df.groupby("role")["seq_len"].transform("max")) & df["floor"].isin(DRAWN_FLOORS)
    ]
    write_json(
        out / "floors.json",
        {r: dict(zip(g["floor"], g["val_ppl"], strict=True)) for r, g in longest.groupby("role")},
    )
    return df


def _identity(overrides) -> list[str]:
    """What makes two runs the same run across machines: the overrides without paths."""
    items = overrides.split() if isinstance(overrides, str) else overrides
    return [o for o in items if not o.startswith(("paths.", "recipe.init_from="))]


def restore(out: Path, runs: dict, registry: Path) -> int:
    """Count the finished runs of a committed registry (an earlier session's, whose run folders are gone)
    as done: their metrics.json is written back, unless another run starts from their checkpoint. Returns
    how many were restored."""
    if not Path(registry).is_file():
        return 0
    parents = {spec["after"] for spec in runs.values()}
    old = pd.read_csv(registry)
    n = 0
    for row in old[old["status"] == "finished"].to_dict("records"):
        name = row["run"]
        if name not in runs or name in parents or finished(out / name):
            continue
        if _identity(row["overrides"]) != _identity(runs[name]["overrides"]):
            continue
        plan_keys = set(runs[name]) | {"run", "sweep", "profile", "after", "overrides", "total_train_flops"}
        metrics = {k: v for k, v in row.items() if k not in plan_keys and not pd.isna(v)}
        write_json(out / name / "metrics.json", {**metrics, "restored_from": str(registry)})
        n += 1
    if n:
        log.info("%d finished runs restored from %s", n, registry)
    return n


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
