"""Figures 3/15: latency per token against context, prefill and decode, for the Transformer, TTT-Linear,
TTT-MLP and Mamba: the suite of `ttt-bench bench models` at the profile's size (smoke skips it). Nothing is
trained; the benchmark runs alone (a busy machine would time itself)."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from ..bench.models import summary as models_summary
from ..io import read_table
from .engine import plotting as P
from .engine import timing
from .engine.experiment import Experiment, PlotCommand, Section, read_csv
from .engine.report import Step
from .engine.tables import context_label
from .engine.verdicts import FAILS, HOLDS, INCONCLUSIVE, MISSING, Claim, Verdict

PROFILES = {  # `ttt-bench bench models` arguments per profile
    "quick": ["--preset", "cpu-ref", "--phases", "prefill,decode", "--contexts", "1024-4096"],
    "cpu": ["--preset", "cpu-ref", "--phases", "prefill,decode"],
    "paper": ["--size", "1.3b", "--batch", "16", "--decode-batch", "512", "--dtype", "bfloat16", "--contexts",
              "1024-32768", "--phases", "prefill,decode"],
}


def latency_figure(bench: pd.DataFrame):
    phases = [p for p in ("prefill", "decode", "train") if p in set(bench["phase"])]
    if not phases:
        raise ValueError("no prefill/decode/train rows in the benchmark CSV")
    bench = bench.copy()
    bench["latency_ms_per_token"] = pd.to_numeric(bench["latency_ms_per_token"], errors="coerce")
    bench = bench[bench["latency_ms_per_token"].notna()]
    fig, axes = P.plt.subplots(1, len(phases), figsize=(4.8 * len(phases), 4.4), squeeze=False,
                               layout="constrained")
    for ax, phase in zip(axes[0], phases, strict=True):
        sub = bench[bench["phase"] == phase]
        for model, g in sub.groupby("model", sort=False):
            s = g.groupby("context")["latency_ms_per_token"].agg(["mean", "std", "size"]).sort_index()
            label = P.PAPER_NAMES.get(model, model)
            one = " (single point)" if len(s) == 1 else ""
            P.errorbar(ax, s.index, s["mean"], s["std"].fillna(0.0), f"{label}{one}", style_of=label)
        ctx = sorted(sub["context"].unique())
        info = []
        for col, fmt in (("device", "{}"), ("dtype", "{}"), ("threads", "{} threads"), ("batch", "batch {}")):
            on_cpu = "device" not in sub or sub["device"].astype(str).str.startswith("cpu").any()
            if col in sub and sub[col].notna().any() and (col != "threads" or on_cpu):  # threads: CPU only
                vals = sorted({str(v).removesuffix(".0") for v in sub[col].dropna()})
                info.append(fmt.format("/".join(vals)))
        loaded = "under_load" in sub and sub["under_load"].astype(str).eq("True").any()
        ax.set(xscale="log", yscale="log", xlabel="Context length", ylabel="Latency per token (ms)",
               title=phase.capitalize() + (f" ({', '.join(info)})" if info else "")
               + ("\nTAKEN UNDER LOAD" if loaded else ""))
        if ctx:
            ax.set_xlim(ctx[0] / 1.25, ctx[-1] * 1.25)
        P.finish_log_axis(ax, "x", lambda v, _p=None: P.context_label(int(v)), ticks=[float(c) for c in ctx])
        P.finish_log_axis(ax, "y")
    P.legend_below(fig, [h for ax in axes[0] for h in P.handles_of(ax)])
    return fig


def plot_latency(inputs: list[Path], stem: Path) -> list[Path]:
    tables = [read_table(f, required=("phase", "context", "latency_ms_per_token"),
                         fix="pass a CSV that `ttt-bench bench models --out` wrote") for f in inputs]
    return P.save(latency_figure(pd.concat(tables, ignore_index=True)), stem)


def prefill_faster_from_8k(r) -> Verdict:
    """The ratio TTT-Linear / Transformer of prefill latency per token at every context >= 8k: holds below
    0.9 and outside the repeats' spread, does not hold above 1.1 (outside it) at some context, else
    inconclusive; a timing that engine/timing.py doubts (cold, too few repeats, under load) is
    inconclusive with the reason."""
    b = r.csv("latency", "latency.csv")
    if b is None or b.empty:
        return Verdict(MISSING, "no latency benchmark")
    rows = b[(b["phase"] == "prefill") & b["model"].isin(["ttt_linear", "transformer"])
             & (pd.to_numeric(b["context"], errors="coerce") >= 8192)]
    rows = rows[pd.to_numeric(rows["latency_ms_per_token"], errors="coerce").notna()]
    lat = rows.pivot_table(index="context", columns="model", values="latency_ms_per_token")
    if not {"ttt_linear", "transformer"} <= set(lat.columns):
        return Verdict(MISSING, "TTT-Linear and Transformer prefill at >= 8k not measured")
    ratio = lat["ttt_linear"] / lat["transformer"]
    noise = rows.assign(s=timing.spread(rows)).pivot_table(index="context", columns="model", values="s")
    clear = pd.Series({c: timing.beyond_spread(v, noise.loc[c, "ttt_linear"], noise.loc[c, "transformer"])
                       for c, v in ratio.items()})
    status = (HOLDS if ((ratio < 0.9) & clear).all() else
              FAILS if ((ratio > 1.1) & clear).any() else INCONCLUSIVE)
    repeats = pd.to_numeric(rows["repeats"], errors="coerce").min() if "repeats" in rows else float("nan")
    sentence = (
        "TTT-Linear / Transformer prefill latency per token: "
        + ", ".join(f"{c // 1024}k {v:.2f}x" for c, v in ratio.items())
        + f" (median of {repeats:.0f} repeats, {timing.spread_text(rows)}; within 10% of 1 or "
        "within the spread is inconclusive)"
    )
    if (why := timing.doubt(rows)) is not None:
        status, sentence = INCONCLUSIVE, f"{sentence}; inconclusive: {why}"
    return Verdict(status, sentence, {"ratio": ratio.to_dict()})


def campaign_latency(folder: Path) -> tuple[pd.DataFrame | None, str | None]:
    """Figure 3's prefill at the paper profile's size and batch (PROFILES['paper']) from a GPU
    campaign's benchmark CSVs in `folder` (`bench_prefill_<size>*.csv`, which no step folder holds), as the
    latency step's latency.csv, with a line that says what it is; (None, None) where there are none. A
    context where one model has no time (out of memory) is left out and named."""
    args = PROFILES["paper"]
    size, batch = args[args.index("--size") + 1], int(args[args.index("--batch") + 1])
    files = sorted(Path(folder).glob(f"**/bench_prefill_{size}*.csv"))
    if not files:
        return None, None
    bench = pd.concat([pd.read_csv(f).assign(file=f.name) for f in files], ignore_index=True)
    lat = pd.to_numeric(bench["latency_ms_per_token"], errors="coerce")
    rows = bench[(bench["phase"] == "prefill") & (pd.to_numeric(bench["batch"], errors="coerce") == batch)
                 & lat.notna()]
    both = rows.groupby("context")["model"].agg(lambda m: {"ttt_linear", "transformer"} <= set(m))
    rows = rows[rows["context"].isin(both[both].index)]
    if rows.empty:
        return None, None
    used = sorted(rows["file"].unique())
    oom = bench[(bench["phase"] == "prefill") & bench["note"].astype(str).str.contains("out of memory")
                & ~bench["context"].isin(rows["context"])]
    device = "/".join(sorted(rows["device"].dropna().astype(str).unique())) if "device" in rows else ""
    machine = Path(folder) / "machine.json"
    if machine.is_file() and device.startswith("cuda"):
        device = json.loads(machine.read_text()).get("gpu", device)
    contexts = sorted(rows["context"].unique())
    line = (f"GPU campaign benchmark ({', '.join(used)}): {size}, batch {batch} (the paper's), "
            f"{'/'.join(sorted(rows['dtype'].dropna().astype(str).unique()))} on {device}, contexts "
            f"{context_label(contexts[0])}-{context_label(contexts[-1])}"
            + (f"; {', '.join(sorted({context_label(c) for c in oom['context']}))} left out (out of memory)"
               if len(oom) else ""))
    return rows.reset_index(drop=True), line


class Latency(Experiment):
    name = "latency"
    measures = "speed"
    trains = False
    seconds = {"quick": 42.0, "cpu": 140.0}  # the benchmark on 2 CPU cores (results/speed/eta, cpu/RUN.md)
    section = Section(
        "Figures 3/15: latency",
        "Forward latency per token grows with context for the Transformer and stays flat for TTT-Linear "
        "and Mamba; TTT-Linear is faster than the Transformer from 8k context.",
        ["latency.png"],
        ["Figures 3/15"],
    )

    def untested(self, profile: str) -> dict[str, str]:
        """A profile without a benchmark (smoke; gpu, where the GPU campaign measures latency) does not test
        the claim."""
        if profile in PROFILES:
            return {}
        return {c.id: "no latency benchmark in this profile (`make gpu-campaign` measures it on a GPU: "
                      "results/gpu/SUMMARY.md)" for c in self.claims}

    def run_step(self, ctx) -> None:
        """The benchmark in a process of its own, into the step folder."""
        if ctx.profile not in PROFILES:
            return
        args = PROFILES[ctx.profile]
        step = Step(ctx.out, self.name, " ".join(["ttt-bench bench models", *args]))
        cmd = [sys.executable, "-m", "ttt_bench.cli.main", "bench", "models", *args]
        done = subprocess.run([*cmd, "--out", str(step.dir / "latency.csv")], capture_output=True, text=True)
        if done.returncode:
            step.done(error=(done.stderr.strip().splitlines() or [""])[-1])
            return
        self.tabulate(step.dir)
        step.done()

    def tabulate(self, folder: Path) -> None:
        bench = read_csv(folder, "latency.csv")
        if bench is not None:
            P.save(latency_figure(bench), folder / "latency")

    def outside_results(self, folder: Path) -> tuple[dict, str | None]:
        """A profile without the latency step (gpu): the GPU campaign's prefill benchmarks in its folder."""
        bench, line = campaign_latency(folder)
        return ({(self.name, "latency.csv"): bench}, line) if bench is not None else ({}, None)

    def summary(self, folder: Path) -> str | None:
        """The benchmark's prefill and decode lines (`ttt-bench bench models`' summary)."""
        bench = read_csv(folder, "latency.csv")
        if bench is None:
            return None
        return "; ".join(line for line in models_summary(bench) if line.startswith(("prefill", "decode")))

    @property
    def claims(self) -> list[Claim]:
        return [Claim("latency.prefill", "Figures 3/15", "TTT-Linear's prefill is faster per token than the "
                      "Transformer's from 8k context.", prefill_faster_from_8k)]

    @property
    def plots(self) -> dict[str, PlotCommand]:
        return {"latency": PlotCommand("latency per token vs context (Figs 3/15); INPUT: CSVs of `ttt-bench "
                                       "bench`", plot_latency)}


EXPERIMENT = Latency()
