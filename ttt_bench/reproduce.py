"""`make reproduce [PROFILE=quick|cpu|smoke|paper] [DATA_DIR=...]`: the whole pipeline into results/.

Each step is one sweep (Table 1, Figure 8 with Figures 5/17, the scaling grid) or the latency benchmark;
it writes its own folder `<out>/<profile>/<step>/` when it finishes (registry with every seed, n-gram
floors, tables, figures, `step.json` with its command, hardware and wall time), so a long run can be
committed sweep by sweep. `REPORT.md` is then assembled from every step folder present, judged by the
claim table (experiments/claims.py). Runs (with checkpoints) go to $TTT_BENCH_RUNS/reproduce-<profile>;
re-running resumes and skips finished runs. PROFILE=paper without a GPU prints the plan and stops.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from .bench.common import hardware
from .bench.models import summary as models_summary
from .experiments import figures
from .experiments.claims import Results, judge_all
from .experiments.longrange import checkpoint_fact_recall
from .experiments.measure import (
    fact_recall_table,
    inner_losses,
    recall_table,
    summary_table,
    table1,
    time_w_and_z,
)
from .experiments.sweeps import Progress, calibrates, load_sweep, plan_sweep, run_recall, run_sweep
from .io import write_atomic, write_json

log = logging.getLogger("ttt_bench.reproduce")
A100_BF16_FLOPS, ASSUMED_MFU = 312e12, 0.4
LLAMA_VOCAB = 32000  # the paper's tokenizer (data.tokenizer.name of the paper profile)
STEPS = ("table1", "minibatch", "scaling", "latency", "recall", "longrange")


def planned_runs(profile: str, data_dir: str | None, steps=None) -> list[tuple[str, str, dict]]:
    """(step, run folder, runs of plan_sweep) of every sweep that `make reproduce PROFILE=<profile>` trains,
    in its order: what `main` plans its progress over and the steps' runners then train (latency trains
    nothing; the recall step trains its calibration grid, then its grid at the chosen learning rates)."""
    return [(step, folder, plan_sweep(step, profile, data_dir, **options))
            for step in (STEPS if steps is None else steps) if step != "latency"
            for folder, options in sweep_folders(step, profile)]


def vocab_size(cfg) -> int:
    """The vocabulary a language-model run trains with, from its config alone (no tokenizer is loaded): the
    paper's Llama tokenizer for Hugging Face tokenizers (the paper profile's only one), MQAR's token range,
    a BPE's trained size, 256 bytes + end of document."""
    data = cfg.data
    if "MQARDataModule" in str(data.get("_target_", "")):
        return int(data.vocab_size)
    kind = data.tokenizer.get("kind")
    if kind == "hf":
        return LLAMA_VOCAB
    return int(data.tokenizer.vocab_size) if kind == "bpe" else 257


def run_cost(cfg, cache: dict | None = None) -> dict:
    """What one run trains and its FLOPs, from its composed config: language models by flops.py's analytic
    count per token over the token budget; image models (MTTT) by FlopCounterMode over one image, forward and
    backward (vision/flops.py), over the images of the recipe. `cache`: costs already computed, by the
    model and geometry (seeds share them)."""
    from omegaconf import OmegaConf

    from .flops import flops_per_token

    cache = {} if cache is None else cache
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if (OmegaConf.select(cfg, "task.name") or "lm") == "image":
        from hydra.utils import instantiate

        from .vision.flops import count_flops

        dm = instantiate(cfg.data)  # the geometry only: no image is read
        key = json.dumps([model, dm.token_dim, dm.num_tokens, dm.num_classes], sort_keys=True, default=str)
        if key not in cache:
            net = instantiate(cfg.model, num_classes=dm.num_classes, token_dim=dm.token_dim,
                              num_tokens=dm.num_tokens)
            cache[key] = count_flops(net, dm.token_dim, dm.num_tokens, backward=True)
        images = float(cfg.recipe.total_images)
        return {"tokens": float("nan"), "images": images, "train_flops": cache[key] * images,
                "seq_len": int(dm.num_tokens), "tokenizer": None}
    tokens, seq_len, vocab = float(cfg.recipe.total_tokens), int(cfg.data.seq_len), vocab_size(cfg)
    key = json.dumps([model, seq_len, vocab], sort_keys=True, default=str)
    if key not in cache:
        cache[key] = flops_per_token(model, seq_len, vocab)["train"]
    return {"tokens": tokens, "images": float("nan"), "train_flops": cache[key] * tokens, "seq_len": seq_len,
            "tokenizer": cfg.data.tokenizer.get("name") if "tokenizer" in cfg.data else None}


def paper_plan(data_dir: str | None) -> pd.DataFrame:
    """Every run that `make reproduce PROFILE=paper` trains (planned_runs: every step's sweeps), with the
    config it composes and its training cost."""
    from .config import compose

    rows, cache = [], {}
    for step, folder, runs in planned_runs("paper", data_dir):
        for name, spec in runs.items():
            cfg = compose("train", spec["overrides"])
            rows.append({"sweep": step, "folder": folder, "run": name, **run_cost(cfg, cache),
                         "precision": str(cfg.trainer.precision),
                         "tokens_per_batch": int(cfg.recipe.get("tokens_per_batch") or 0),
                         "overrides": spec["overrides"]})
    df = pd.DataFrame(rows)
    df["gpu_hours"] = df["train_flops"] / (A100_BF16_FLOPS * ASSUMED_MFU) / 3600
    return df


class Step:
    """One step's folder: what it measured and how (`step.json`), written when the step ends."""

    def __init__(self, out: Path, name: str, command: str, trains: bool = True):
        self.dir, self.name, self.command, self.start = out / name, name, command, time.perf_counter()
        self.trains = trains  # False: tabulated (--no-train) from runs trained by other processes
        self.dir.mkdir(parents=True, exist_ok=True)

    def csv(self, name: str, df: pd.DataFrame) -> None:
        write_atomic(self.dir / name, df.to_csv(index=False))

    def per_run(self, name: str, runs: pd.DataFrame, measure) -> pd.DataFrame | None:
        """The step's CSV `name` of a measurement of each run (`measure(run)`: a DataFrame, or None when
        the run's folder is not on this machine), with a `run` column. A run whose folder is gone (its
        registry row restored from the committed results, on a new machine) keeps its committed rows."""
        path = self.dir / name
        committed = pd.read_csv(path) if path.is_file() else None
        parts = []
        for r in runs.itertuples():
            df = measure(r)
            if df is not None:
                parts.append(df.assign(run=r.run))
            elif committed is not None and "run" in committed:
                parts.append(committed[committed["run"] == r.run])
            else:
                log.warning("%s: %s is not measured (its run folder is not here, nor in %s)", self.name,
                            r.run, path)
        parts = [p for p in parts if len(p)]
        if not parts:
            return None
        df = pd.concat(parts, ignore_index=True)
        self.csv(name, df)
        return df

    def restored_only(self, registry: pd.DataFrame) -> bool:
        """Every finished run of the registry was restored from the committed results (a new machine that
        trained nothing): what the step measured before still describes them."""
        finished = registry[registry["status"] == "finished"]
        return "restored_from" in finished and len(finished) > 0 and finished["restored_from"].notna().all()

    def done(self, registry: pd.DataFrame | None = None, **info) -> None:
        """Write step.json; a step that only restored its runs keeps the committed one (the command, hardware
        and wall time of the session that trained them)."""
        meta = self.dir / "step.json"
        if registry is not None and meta.is_file() and self.restored_only(registry) and not info.get("error"):
            log.info("%s: every run restored from the committed registry; step.json kept", self.name)
            return
        trained = (
            float(pd.to_numeric(registry["wall_time_s"], errors="coerce").sum())
            if (registry is not None and "wall_time_s" in registry)
            else None
        )
        write_json(
            self.dir / "step.json",
            {
                "step": self.name,
                "command": self.command,
                "hardware": hardware(),
                "wall_time_s": round(time.perf_counter() - self.start, 1),
                "trained_s": trained,
                "tabulated_only": not self.trains,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                **info,
            },
        )


def sweep_step(name: str, ctx: dict) -> tuple[Step, pd.DataFrame]:
    step = Step(ctx["out"], name, f"ttt-bench ablate {name}{ctx['flags']}", trains=ctx["train"])
    reg = run_sweep(
        name,
        ctx["profile"],
        ctx["runs"] / name,
        ctx["data_dir"],
        pipeline=ctx["progress"],
        launcher=ctx["launcher"],
        committed=step.dir / "registry.csv",
        train=ctx["train"],
    )
    step.csv("registry.csv", reg)
    floors = pd.read_csv(ctx["runs"] / name / "floors.csv")
    step.csv("floors.csv", floors)
    return step, reg


def step_table1(ctx: dict) -> None:
    step, reg = sweep_step("table1", ctx)
    floors = pd.read_csv(step.dir / "floors.csv")
    _, md = table1(reg, floors)
    write_atomic(step.dir / "table1.md", md)
    step.done(reg)


def step_minibatch(ctx: dict) -> None:
    step, reg = sweep_step("minibatch", ctx)
    sweep_dir = ctx["runs"] / "minibatch"
    t = load_sweep("minibatch")
    measured = step.dir / "timing.csv"
    # measured with the runs: tabulating (--no-train) or only restoring them keeps the committed timing
    if not measured.is_file() or (ctx["train"] and not step.restored_only(reg)):
        step.csv("timing.csv", time_w_and_z(t["mini_batch_sizes"], **t["timing"][ctx["profile"]]))
    timing = pd.read_csv(measured)
    floors = json.loads((sweep_dir / "floors.json").read_text())
    figures.minibatch(reg, timing, step.dir / "minibatch", floors=floors)
    # Figures 5/17: the inner losses of the b=1 networks of Figure 8, one per seed
    def measure(r):
        ckpt = sweep_dir / r.run / "checkpoints" / "last.ckpt"
        return inner_losses(str(ckpt)).assign(seed=r.seed) if ckpt.is_file() else None

    b1 = reg[(reg["mini_batch"].astype(str) == "1") & (reg["status"] == "finished")]
    df = step.per_run("inner_loss.csv", b1, measure)
    if df is not None:
        figures.inner_loss(df[df["seed"] == df["seed"].min()], step.dir / "inner_loss")
    write_atomic(
        step.dir / "minibatch.md", summary_table(reg, ["label"], pd.read_csv(step.dir / "floors.csv"))
    )
    step.done(reg)


def step_scaling(ctx: dict) -> None:
    step, reg = sweep_step("scaling", ctx)
    sweep_dir = ctx["runs"] / "scaling"
    floors = json.loads((sweep_dir / "floors.json").read_text())

    def measure(r):  # Figures 2 (right) and 14: the matched runs' token-index losses, kept in the step
        path = sweep_dir / r.run / "token_index.csv"
        return pd.read_csv(path) if path.is_file() else None

    curves = step.per_run("token_index.csv", figures.token_index_runs(reg), measure)
    for name, draw in (
        ("scaling", lambda s: figures.scaling(reg, s, floors=floors)),
        ("context", lambda s: figures.context(reg, s, floors=floors)),
        ("token_index", lambda s: figures.token_index(reg, curves, s, floors=floors)),
    ):
        try:
            if name == "token_index" and curves is None:
                raise ValueError("no token-index losses of the matched-FLOPs runs")
            draw(step.dir / name)
        except ValueError as e:
            log.warning("figure %s not drawn: %s", name, e)
    keys = ["role", "size", "seq_len", "label", "matched"]
    write_atomic(step.dir / "scaling.md", summary_table(reg, keys, pd.read_csv(step.dir / "floors.csv")))
    step.done(reg)


# Figures 3/15: the latency suite of `ttt-bench bench models` at the profile's size (smoke skips it)
LATENCY = {
    "quick": [
        "--preset",
        "cpu-ref",
        "--phases",
        "prefill,decode",
        "--contexts",
        "1024-4096",
        "--repeats",
        "1",
    ],
    "cpu": ["--preset", "cpu-ref", "--phases", "prefill,decode"],
    "paper": [
        "--size",
        "1.3b",
        "--batch",
        "16",
        "--decode-batch",
        "512",
        "--dtype",
        "bfloat16",
        "--contexts",
        "1024-32768",
        "--phases",
        "prefill,decode",
    ],
}


def step_latency(ctx: dict) -> None:
    cmd = [sys.executable, "-m", "ttt_bench.cli.main", "bench", "models", *LATENCY[ctx["profile"]]]
    step = Step(ctx["out"], "latency", " ".join(["ttt-bench bench models", *LATENCY[ctx["profile"]]]))
    csv = step.dir / "latency.csv"
    done = subprocess.run([*cmd, "--out", str(csv)], capture_output=True, text=True)
    if done.returncode:
        step.done(error=(done.stderr.strip().splitlines() or [""])[-1])
        return
    figures.latency(pd.read_csv(csv), step.dir / "latency")
    step.done()


def sweep_folders(step: str, profile: str) -> list[tuple[str, dict]]:
    """(run folder, planner options) of a step's sweeps: recall calibrates its learning rates first."""
    if step == "recall" and calibrates(profile):
        return [("recall/calibration", {}), ("recall", {"lrs": {}})]
    return [(step, {})]


def step_recall(ctx: dict) -> None:
    """MQAR: each method's learning rate from the calibration grid (where the profile has several), then
    the grid of widths x pairs x seeds at those rates."""
    step = Step(ctx["out"], "recall", f"ttt-bench ablate recall{ctx['flags']}", trains=ctx["train"])
    reg, cal, lrs = run_recall(
        ctx["profile"],
        ctx["runs"] / "recall",
        ctx["data_dir"],
        pipeline=ctx["progress"],
        launcher=ctx["launcher"],
        committed=step.dir,
        train=ctx["train"],
    )
    if cal is not None:
        step.csv("calibration.csv", cal)
    step.csv("registry.csv", reg)
    try:
        figures.recall(reg, step.dir / "recall")
    except ValueError as e:
        log.warning("figure recall not drawn: %s", e)
    write_atomic(step.dir / "recall.md", recall_table(reg, lrs))
    step.done(reg, lrs=lrs)


def step_longrange(ctx: dict) -> None:
    """The main models at a long context on the synthetic corpus, then each checkpoint's loss on restated
    facts by distance to their first mention (experiments/longrange.py)."""
    step, reg = sweep_step("longrange", ctx)
    docs = load_sweep("longrange")["profiles"][ctx["profile"]]["docs"]
    def measure(r):
        ckpt = ctx["runs"] / "longrange" / r.run / "checkpoints" / "last.ckpt"
        if not ckpt.is_file():
            return None
        return checkpoint_fact_recall(ckpt, docs).assign(method=r.method, label=r.label, seed=r.seed,
                                                         seq_len=r.seq_len)

    df = step.per_run("fact_recall.csv", reg[reg["status"] == "finished"], measure)
    if df is not None:
        figures.fact_recall(df, step.dir / "fact_recall")
        floors = pd.read_csv(step.dir / "floors.csv") if (step.dir / "floors.csv").is_file() else None
        write_atomic(step.dir / "fact_recall.md", fact_recall_table(df, reg, floors))
    step.done(reg)


RUNNERS = {
    "longrange": step_longrange,
    "recall": step_recall,
    "table1": step_table1,
    "minibatch": step_minibatch,
    "scaling": step_scaling,
    "latency": step_latency,
}

# MTTT (experiments/mttt.py, docs/mttt.md): one step per table
from .experiments.mttt import MTTT_SECTIONS, MTTT_SWEEPS, step_mttt  # noqa: E402

STEPS += MTTT_SWEEPS
RUNNERS.update({m: (lambda ctx, m=m: step_mttt(m, ctx, sweep_step)) for m in MTTT_SWEEPS})


# ---- the report, from the step folders ----

SECTIONS = {  # step -> (title, what the paper found, figures and tables of the step folder)
    "table1": (
        "Table 1: from linear attention to TTT-Linear",
        "Each design lowers perplexity except learnable W0 (+0.04); the biggest gain is mini-batch TTT "
        "(b = T -> 16, -1.70), then LN and residual in f (-1.22); TTT-Linear (M) ends at 11.09 vs 15.91 "
        "for linear attention (125M, Pile 2k, Llama tokens).",
        ["table1.md"],
        ["Table 1"],
    ),
    "minibatch": (
        "Figure 8 and Figures 5/17: TTT mini-batch size, inner losses",
        "Smaller b gives lower perplexity (more GD steps); dual-form forward time falls with b, then the "
        "z's (O(T b d)) dominate. One GD step lowers the inner loss, and l(W_t; x_t) improves further "
        "from l(W_0; x_t) as t grows.",
        ["minibatch.md", "minibatch.png", "inner_loss.png"],
        ["Figure 8", "Figures 5/17"],
    ),
    "scaling": (
        "Figures 11-14, 18: scaling, context length, token index",
        "At short context TTT-Linear (M), Mamba and the Transformer are comparable; at long context "
        "(Pile 8k, Books 32k) TTT-Linear/MLP (M) beat Mamba. TF finetune beats TF pretrain. With matched "
        "FLOPs, the Transformer and TTT keep improving with token index while Mamba plateaus after 16k.",
        ["scaling.md", "scaling.png", "context.png", "token_index.png"],
        ["Figures 11-14, 18"],
    ),
    "recall": (
        "Does the expressive hidden state help at long range? Recall (MQAR)",
        "The paper's thesis (Sections 1-2, Figures 2 right and 14): a hidden state that is itself a model, "
        "trained at test time, compresses long context better than a fixed-size vector or matrix state, so "
        "TTT layers keep using context where Mamba plateaus, and TTT-MLP is more expressive than "
        "TTT-Linear. The paper has no recall benchmark; multi-query associative recall (Zoology, Arora et "
        "al. 2023) tests how many key-value associations a state holds, against its size.",
        ["recall.md", "recall.png"],
        ["Recall (MQAR)"],
    ),
    "longrange": (
        "Long range in text-like data: recalling facts from far back",
        "Figures 2 (right) and 14: with matched FLOPs, TTT-Linear and TTT-MLP keep lowering their loss late "
        "in a long context while Mamba plateaus, i.e. they use what they read long ago. Here the same models "
        "are trained at a long context on the synthetic corpus, where a code is predictable only from its "
        "first mention, and the loss on the code's digits is measured by distance to that mention.",
        ["fact_recall.md", "fact_recall.png"],
        ["Long range (synthetic facts)"],
    ),
    "latency": (
        "Figures 3/15: latency",
        "Forward latency per token grows with context for the Transformer and stays flat for TTT-Linear "
        "and Mamba; TTT-Linear is faster than the Transformer from 8k context.",
        ["latency.png"],
        ["Figures 3/15"],
    ),
}
SECTIONS.update(MTTT_SECTIONS)


def read_results(out: Path) -> Results:
    def csv(step, name):
        path = out / step / name
        return pd.read_csv(path) if path.is_file() else None

    floors = [
        f.assign(sweep=s)
        for s in ("table1", "minibatch", "scaling", "longrange")
        if (f := csv(s, "floors.csv")) is not None
    ]
    return Results(
        table1=csv("table1", "registry.csv"),
        minibatch=csv("minibatch", "registry.csv"),
        scaling=csv("scaling", "registry.csv"),
        timing=csv("minibatch", "timing.csv"),
        inner_loss=csv("minibatch", "inner_loss.csv"),
        token_index=csv("scaling", "token_index.csv"),
        latency=csv("latency", "latency.csv"),
        recall=csv("recall", "registry.csv"),
        fact_recall=csv("longrange", "fact_recall.csv"),
        longrange=csv("longrange", "registry.csv"),
        mttt={m: csv(m, "registry.csv") for m in MTTT_SWEEPS},
        mttt_inner={m: csv(m, "inner_loss.csv") for m in MTTT_SWEEPS},
        mttt_floors={m: csv(m, "image_floors.csv") for m in MTTT_SWEEPS},
        floors=pd.concat(floors, ignore_index=True).drop_duplicates(["role", "seq_len", "floor"])
        if floors
        else None,
    )


def write_report(out: Path, profile: str, data_dir: str | None, make: str) -> Path:
    results = read_results(out)
    verdicts = judge_all(results)
    write_atomic(out / "claims.csv", verdicts.to_csv(index=False))
    data = (
        "real corpora (pile-mini as the Pile, books-mini as Books)"
        if data_dir
        else "the embedded synthetic corpus (it stands in for both the Pile and Books)"
    )
    parts = [
        f"# ttt-bench results ({profile} profile)\n",
        f"Produced by `{make}` on {data}. Perplexities are per byte (the paper's are per Llama token), so "
        "only orderings and trends compare with the paper, not values. Every verdict below is computed by "
        "`ttt_bench/experiments/claims.py` from the registries in this folder: a difference whose 95% "
        "interval over seeds contains 0, or that uses a run that does not beat the byte-bigram floor, is "
        "inconclusive. Each step's folder holds its registry (every seed), floors, tables and figures.\n",
        "## Verdicts\n",
        "| claim | verdict |",
        "|---|---|",
    ]
    parts += [f"| {r.figure}: {r.claim} | **{r.verdict}** |" for r in verdicts.itertuples()]
    parts.append("")
    for step, (title, paper, files, figs) in SECTIONS.items():
        meta_path = out / step / "step.json"
        parts.append(f"## {title}\n\n**Paper.** {paper}\n")
        if not meta_path.is_file():
            parts.append(f"**Not run yet in this profile.** `{make} STEPS={step}` runs it.\n")
            continue
        meta = json.loads(meta_path.read_text())
        if meta.get("error"):
            parts.append(f"**Failed:** {meta['error']}\n")
        for f in files:
            path = out / step / f
            if path.suffix == ".md" and path.is_file():
                parts.append(path.read_text())
            elif path.is_file():
                parts.append(f"![{f}]({step}/{f})\n")
        if results.latency is not None and step == "latency":
            parts.append(
                "; ".join(
                    line for line in models_summary(results.latency) if line.startswith(("prefill", "decode"))
                )
                + "\n"
            )
        for r in verdicts[verdicts["figure"].isin(figs)].itertuples():
            parts.append(f"- **{r.verdict}** — {r.claim} {r.evidence}.")
        trained = f"; its runs trained for {meta['trained_s'] / 60:.1f} min" if meta.get("trained_s") else ""
        wall = ("Tabulated with `--no-train` from runs trained by other processes"
                if meta.get("tabulated_only") else f"Wall time {meta['wall_time_s'] / 60:.1f} min")
        parts.append(
            f"\n**Command.** `{meta['command']}` (part of `{make}`). Hardware: {meta['hardware']}. "
            f"{wall}{trained}; finished {meta['finished']}.\n"
        )
    write_atomic(out / "REPORT.md", "\n".join(parts))
    return out / "REPORT.md"


README_BLOCK = ("<!-- results:begin -->", "<!-- results:end -->")


def update_readme(readme: Path, out: Path, make: str) -> None:
    """The README's current results, made from the committed folder's step files and verdicts (the same
    claims.csv as REPORT.md), between the README_BLOCK markers."""
    text = readme.read_text()
    if README_BLOCK[0] not in text:
        return
    verdicts = pd.read_csv(out / "claims.csv")
    rel = out.resolve().relative_to(readme.parent.resolve()).as_posix()
    lines = [
        f"From `{make}`; [{rel}/REPORT.md]({rel}/REPORT.md) has every table, "
        "figure and number"
        + (f"; [{rel}/RUN.md]({rel}/RUN.md) says how the run went" if (out / "RUN.md").is_file() else "")
        + ". Steps run so far:",
        "",
    ]
    for step in SECTIONS:
        meta = out / step / "step.json"
        if meta.is_file():
            m = json.loads(meta.read_text())
            trained = f" (its runs trained {m['trained_s'] / 60:.0f} min)" if m.get("trained_s") else ""
            minutes = f"{m['wall_time_s'] / 60:.0f} min"
            wall = "tabulated with `--no-train`" if m.get("tabulated_only") else minutes
            lines.append(
                f"- `{step}`: `{m['command']}`, {wall}{trained} on {m['hardware']}, "
                f"finished {m['finished']}"
            )
        else:
            lines.append(f"- `{step}`: not run yet (`{make} STEPS={step}`)")
    if (out / "table1" / "table1.md").is_file():
        head = "Table 1 (pile-mini, context 128, size `xs`; perplexity per byte, mean +- std over seeds):"
        lines += ["", head, "", (out / "table1" / "table1.md").read_text().strip()]
    lines += ["", "| claim | verdict | evidence |", "|---|---|---|"]
    lines += [
        f"| {r.figure}: {r.claim} | **{r.verdict}** | {r.evidence} |"
        for r in verdicts.itertuples()
        if r.verdict != "not measured"
    ]
    missing = verdicts[verdicts["verdict"] == "not measured"]
    if len(missing):
        todo = "; ".join(f"{r.figure}: {r.claim}" for r in missing.itertuples())
        lines += ["", f"Not measured yet: {todo}"]
    start, end = text.index(README_BLOCK[0]), text.index(README_BLOCK[1])
    write_atomic(readme, text[: start + len(README_BLOCK[0])] + "\n" + "\n".join(lines) + "\n" + text[end:])


def output_dir(results: Path, profile: str, data_dir: str | None) -> Path:
    """results/<profile> for real data, results/<profile>-synthetic without: runs of another profile or
    corpus never overwrite the committed results/cpu."""
    return results / (profile if data_dir else f"{profile}-synthetic")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ttt_bench.reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("smoke", "quick", "cpu", "paper"), default="quick")
    p.add_argument("--data-dir", help="folder with pile-mini/ and books-mini/ (default: synthetic data)")
    p.add_argument("--out", type=Path, default=Path("results"), help="results root (default results/)")
    p.add_argument("--runs", type=Path, help="run folders (default: $TTT_BENCH_RUNS/reproduce-PROFILE)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once (Hydra's joblib launcher, a thread each); latency runs alone")
    p.add_argument("--report-only", action="store_true", help="assemble REPORT.md from the step folders")
    p.add_argument(
        "--no-train",
        action="store_true",
        help="write the steps' folders from the runs finished so far, training nothing",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    steps = [s for s in a.steps.split(",") if s]
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, got {a.jobs}")
    if unknown := set(steps) - set(STEPS):
        p.error(f"unknown step(s) {', '.join(sorted(unknown))}; use {','.join(STEPS)}")
    if a.profile == "paper" and not torch.cuda.is_available():
        plan = paper_plan(a.data_dir)
        print(
            plan.groupby("sweep")[["tokens", "images", "train_flops", "gpu_hours"]]
            .sum(min_count=1)
            .assign(runs=plan.groupby("sweep").size())
            .to_string(float_format="{:.3g}".format)
        )
        print(
            f"total: {len(plan)} runs, {plan['tokens'].sum():.3g} tokens and {plan['images'].sum():.3g} "
            f"images, {plan['train_flops'].sum():.3g} FLOPs, ~{plan['gpu_hours'].sum():.0f} A100-hours at "
            f"{ASSUMED_MFU:.0%} MFU. "
            "No GPU here: nothing was run."
        )
        return
    out = output_dir(a.out, a.profile, a.data_dir)
    data = f" DATA_DIR={a.data_dir}" if a.data_dir else ""
    make = f"make reproduce PROFILE={a.profile}{data}"
    if not a.report_only:
        runs = a.runs or Path(os.environ.get("TTT_BENCH_RUNS", "runs")) / f"reproduce-{a.profile}"
        progress = Progress(runs / "progress.json")
        for _, folder, planned in planned_runs(a.profile, a.data_dir, steps):
            progress.plan(planned, (runs / folder).resolve())
        ctx = {
            "profile": a.profile,
            "data_dir": a.data_dir,
            "out": out,
            "runs": runs.resolve(),
            "train": not a.no_train,
            "progress": progress,
            "launcher": ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={a.jobs}"] if a.jobs > 1 else [],
            "flags": f" --profile {a.profile}" + (f" --data-dir {a.data_dir}" if a.data_dir else ""),
        }
        for s in steps:
            if s == "latency" and a.profile == "smoke":
                continue
            RUNNERS[s](ctx)
            write_report(out, a.profile, a.data_dir, make)  # after every step: committable as it goes
    print(f"results in {write_report(out, a.profile, a.data_dir, make)}")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    if a.profile == "cpu" and a.data_dir and out.resolve() == (readme.parent / "results" / "cpu").resolve():
        update_readme(readme, out, make)


if __name__ == "__main__":
    main()
