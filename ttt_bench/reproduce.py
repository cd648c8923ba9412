"""`make reproduce [PROFILE=smoke|cpu|paper] [DATA_DIR=...]`: the whole pipeline into results/.

Table 1 and Figure 8 ablations, the inner losses of Figure 17, the scaling ladder with TF finetune and the
matched-FLOPs token-index runs, the latency benchmark, every figure, and results/REPORT.md. Runs (with their
checkpoints) go to $TTT_BENCH_RUNS/reproduce-PROFILE; re-running skips finished runs. PROFILE=paper without
a GPU prints the plan (runs, tokens, FLOPs, estimated GPU-hours) and stops.
"""

import argparse
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
from .experiments.measure import inner_losses, table1, time_w_and_z
from .experiments.sweeps import load_sweep, plan_sweep, run_sweep
from .io import write_atomic

log = logging.getLogger("ttt_bench.reproduce")
A100_BF16_FLOPS, ASSUMED_MFU = 312e12, 0.4


def paper_plan(data_dir: str | None) -> pd.DataFrame:
    """Every run of the paper-scale grid with its tokens and training FLOPs (Llama vocabulary)."""
    from omegaconf import OmegaConf

    from .config import compose
    from .flops import flops_per_token

    rows = []
    for sweep in ("table1", "minibatch", "scaling"):
        for name, spec in plan_sweep(sweep, "paper", data_dir).items():
            cfg = compose("train", spec["overrides"])
            tokens = float(cfg.recipe.total_tokens)
            per_token = flops_per_token(
                OmegaConf.to_container(cfg.model, resolve=True), cfg.data.seq_len, 32000
            )
            rows.append(
                {"sweep": sweep, "run": name, "tokens": tokens, "train_flops": per_token["train"] * tokens}
            )
    df = pd.DataFrame(rows)
    df["gpu_hours"] = df["train_flops"] / (A100_BF16_FLOPS * ASSUMED_MFU) / 3600
    return df


class Report:
    def __init__(self, profile: str, data_dir: str | None):
        self.profile, self.data_dir, self.sections = profile, data_dir, []
        data = f" DATA_DIR={data_dir}" if data_dir else ""
        self.make = f"make reproduce PROFILE={profile}{data}"
        self.flags = f" --profile {profile}" + (f" --data-dir {data_dir}" if data_dir else "")
        self.trained_s = 0.0  # the sweeps' runs' own training wall times, summed

    def add(self, title: str, paper: str, measured: str, holds: str, command: str, wall: float,
            registry: pd.DataFrame | None = None) -> None:
        """`registry`: a sweep's, whose runs' own training wall times are summed too (a sweep resumed
        after its runs finished takes little time itself)."""
        trained = ""
        if registry is not None and "wall_time_s" in registry:
            seconds = float(pd.to_numeric(registry["wall_time_s"]).sum())
            self.trained_s += seconds
            trained = f"; its runs trained for {seconds / 60:.1f} min"
        self.sections.append(
            f"## {title}\n\n**Paper.** {paper}\n\n**Measured.** {measured}\n\n"
            f"**Does the paper's claim hold at this scale?** {holds}\n\n"
            f"**Command.** `{command}` (part of `{self.make}`); wall time {wall / 60:.1f} min{trained}.\n"
        )

    def write(self, path: Path, total: float) -> None:
        data = (
            f"real corpora in {self.data_dir} (pile-mini as the Pile, books-mini as Books)"
            if self.data_dir
            else "the embedded synthetic corpus"
        )
        head = (
            f"# ttt-bench results ({self.profile} profile)\n\nHardware: {hardware()}. Data: {data}. "
            f"Total wall time {total / 60:.1f} min (the sweeps' runs trained for {self.trained_s / 60:.1f} "
            f"min of it, or earlier if this invocation resumed them). Perplexities are byte-level (the "
            f"paper's are Llama-token level), so only orderings and trends are comparable, not values. "
            f"Produced by `{self.make}`.\n"
        )
        write_atomic(path, "\n".join([head, *self.sections]))


def verdict(ok: bool | None) -> str:
    return "not measured (runs missing or failed)" if ok is None else ("yes" if ok else "no")


def ppl(df: pd.DataFrame, **where) -> float | None:
    sel = df[df["status"] == "finished"]
    for k, v in where.items():
        sel = sel[sel[k] == v]
    return float(sel["val_ppl"].iloc[0]) if len(sel) else None


def step_table1(rep: Report, runs: Path, out: Path) -> None:
    start = time.perf_counter()
    reg = run_sweep("table1", rep.profile, runs / "table1", rep.data_dir)
    write_atomic(out / "table1.csv", reg.to_csv(index=False))
    _, md = table1(reg)
    write_atomic(out / "table1.md", md)
    mb, ln, la, last = (ppl(reg, row=r) for r in (6, 5, 1, 8))
    ok = None if None in (mb, ln, la, last) else (mb < ln and last < la)
    rep.add(
        "Table 1: from linear attention to TTT-Linear",
        "Each design lowers perplexity except learnable W0 (+0.04); the biggest gain is mini-batch TTT "
        "(b=T -> 16, -1.70), then LN and residual in f (-1.22); TTT-Linear (M) ends at 11.09 vs 15.91 for "
        "linear attention.",
        "\n\n" + md,
        f"{verdict(ok)} (mini-batch TTT improves on the row above it, "
        "and the last row beats linear attention)",
        f"ttt-bench ablate table1{rep.flags}",
        time.perf_counter() - start,
        reg,
    )


def step_minibatch(rep: Report, runs: Path, out: Path) -> None:
    start = time.perf_counter()
    sweep_dir = runs / "minibatch"
    reg = run_sweep("minibatch", rep.profile, sweep_dir, rep.data_dir)
    t = load_sweep("minibatch")
    timing = time_w_and_z(t["mini_batch_sizes"], **t["timing"][rep.profile])
    write_atomic(sweep_dir / "timing.csv", timing.to_csv(index=False))
    write_atomic(out / "minibatch.csv", reg.to_csv(index=False))
    write_atomic(out / "minibatch_timing.csv", timing.to_csv(index=False))
    figures.minibatch(reg, timing, out / "figures" / "minibatch")
    small, full = ppl(reg, mini_batch="1"), ppl(reg, mini_batch="T")
    rows = ", ".join(f"b={r.mini_batch}: {r.val_ppl:.3f}" for r in reg.itertuples() if r.status == "finished")
    times = ", ".join(
        f"b={r.mini_batch}: {r.total_ms:.1f} ms ({r.w_ms:.1f} for W's)" for r in timing.itertuples()
    )
    faster = timing["total_ms"].iloc[0] > timing.loc[timing["mini_batch"] == 16, "total_ms"].min()
    rep.add(
        "Figure 8: TTT mini-batch size",
        "Smaller b gives lower perplexity (more GD steps); forward time in dual form falls with b as the W's "
        "parallelise, then the z's (O(T b d)) dominate; b=16 is the chosen trade-off.",
        f"Perplexity: {rows}. Forward time of one TTT-Linear layer: {times}. Figure: figures/minibatch.png.",
        f"perplexity: {verdict(None if None in (small, full) else small < full)} (b=1 below b=T); time: "
        f"{verdict(bool(faster))} (b=16 faster than b=1)",
        f"ttt-bench ablate minibatch{rep.flags}",
        time.perf_counter() - start,
        reg,
    )
    # Figure 17 uses the b=1 network of Figure 8
    start = time.perf_counter()
    ckpt = sweep_dir / "b1" / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        rep.add(
            "Figures 5/17: inner losses",
            "",
            "not measured: the b=1 run did not finish",
            verdict(None),
            "",
            time.perf_counter() - start,
        )
        return
    losses = inner_losses(str(ckpt))
    write_atomic(out / "inner_loss.csv", losses.to_csv(index=False))
    figures.inner_loss(losses, out / "figures" / "inner_loss")
    mean = losses[["w0", "prev", "now"]].mean()
    late = losses[losses["position"] > losses["position"].max() / 2]
    gap_early = (losses["w0"] - losses["now"])[losses["position"] <= losses["position"].max() / 2].mean()
    gap_late = (late["w0"] - late["now"]).mean()
    rep.add(
        "Figures 5/17: inner losses of TTT-Linear",
        "One GD step lowers the TTT loss from l(W_{t-1}; x_t) to l(W_t; x_t), and l(W_t; x_t) improves "
        "further from l(W_0; x_t) as t grows.",
        f"Mean over layers and positions: l(W_0)={mean['w0']:.4f}, l(W_t-1)={mean['prev']:.4f}, "
        f"l(W_t)={mean['now']:.4f}; gap l(W_0)-l(W_t) {gap_early:.4f} in the first half of the context, "
        f"{gap_late:.4f} in the second. Figure: figures/inner_loss.png.",
        f"{verdict(bool(mean['now'] < mean['prev'] and gap_late > gap_early))}",
        f'python -c "from ttt_bench.experiments.measure import inner_losses; '
        f"print(inner_losses('{ckpt}'))\"",
        time.perf_counter() - start,
    )


def step_scaling(rep: Report, runs: Path, out: Path) -> None:
    start = time.perf_counter()
    sweep_dir = runs / "scaling"
    reg = run_sweep("scaling", rep.profile, sweep_dir, rep.data_dir)
    write_atomic(out / "scaling.csv", reg.to_csv(index=False))
    drawn = []
    for name, draw in (
        ("scaling", lambda s: figures.scaling(reg, s)),
        ("context", lambda s: figures.context(reg, s)),
        ("token_index", lambda s: figures.token_index(reg, sweep_dir, s)),
    ):
        try:
            draw(out / "figures" / name)
            drawn.append(f"figures/{name}.png")
        except ValueError as e:
            drawn.append(f"{name}: not drawn ({e})")
    fin = reg[reg["status"] == "finished"]
    longest = fin[fin["role"] == "pile"]["seq_len"].max() if len(fin) else None
    pairs = []
    for size in fin["size"].dropna().unique():
        t, m = (
            ppl(reg, role="pile", seq_len=longest, size=size, method=k) for k in ("ttt_linear_m", "mamba")
        )
        if t is not None and m is not None:
            pairs.append((size, t, m))
    ft = [
        (
            ppl(reg, method="tf_finetune", size=r.size, seq_len=r.seq_len),
            ppl(reg, method="transformer", role="books", size=r.size, seq_len=r.seq_len),
        )
        for r in fin[fin["method"] == "tf_finetune"].itertuples()
    ]
    ft = [p for p in ft if None not in p]
    failed = int((reg["status"] != "finished").sum())
    rep.add(
        "Figures 11-14, 18: scaling, context length, token index",
        "At short context TTT-Linear (M), Mamba and Transformer are comparable; at longer context (Pile 8k, "
        "Books 32k) TTT-Linear/MLP (M) beat Mamba. TF finetune beats TF pretrain. With matched FLOPs, "
        "Transformer and TTT keep improving with token index while Mamba plateaus after 16k.",
        f"{len(fin)} of {len(reg)} runs finished ({failed} failed or pending; see scaling.csv). "
        f"At the longest Pile-like context T={longest}: "
        + ", ".join(f"{s}: TTT-Linear (M) {t:.3f} vs Mamba {m:.3f}" for s, t, m in pairs)
        + ". TF finetune vs TF pretrain at the same context: "
        + ", ".join(f"{a:.3f} vs {b:.3f}" for a, b in ft)
        + "."
        f" Figures: {'; '.join(drawn)}.",
        f"TTT-Linear (M) below Mamba at the longest context: "
        f"{verdict(all(t < m for _, t, m in pairs) if pairs else None)}; TF finetune below TF pretrain: "
        f"{verdict(all(a < b for a, b in ft) if ft else None)}",
        f"ttt-bench ablate scaling{rep.flags}",
        time.perf_counter() - start,
        reg,
    )


# Figures 3/15: the latency suite of `ttt-bench bench models` at the profile's size (smoke profiles skip it)
LATENCY = {
    "cpu": ["--preset", "cpu-ref", "--phases", "prefill,decode"],
    "paper": ["--size", "1.3b", "--batch", "16", "--decode-batch", "512", "--dtype", "bfloat16",
              "--contexts", "1024-32768", "--phases", "prefill,decode"],
}


def step_latency(rep: Report, out: Path) -> None:
    start = time.perf_counter()
    csv = out / "latency.csv"
    cmd = [sys.executable, "-m", "ttt_bench.cli.main", "bench", "models", *LATENCY[rep.profile]]
    cmd += ["--out", str(csv)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    holds = verdict(None)
    if done.returncode:
        measured = f"benchmark failed: {(done.stderr.strip().splitlines() or [''])[-1]}"
    else:
        bench = pd.read_csv(csv)
        figures.latency(bench, out / "figures" / "latency")
        lines = [ln for ln in models_summary(bench) if ln.startswith(("prefill", "decode"))]
        measured = "; ".join(lines) + ". latency.csv, figures/latency.png"
        lat = bench[bench.phase == "prefill"].pivot_table(index="context", columns="model",
                                                          values="latency_ms_per_token")
        if {"ttt_linear", "transformer"} <= set(lat.columns) and lat.index.max() >= 8192:
            holds = verdict(bool((lat.loc[lat.index >= 8192, "ttt_linear"]
                                  < lat.loc[lat.index >= 8192, "transformer"]).all()))
    rep.add(
        "Figures 3/15: latency",
        "Forward latency per token grows with context for the Transformer and stays "
        "flat for TTT-Linear and Mamba; TTT-Linear is faster than the Transformer from 8k context.",
        measured,
        f"TTT-Linear prefill faster than the Transformer at every context from 8k: {holds}",
        " ".join(cmd[2:]).replace("ttt_bench.cli.main", "ttt-bench"),
        time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ttt_bench.reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("smoke", "cpu", "paper"), default="cpu")
    p.add_argument("--data-dir", help="folder with pile-mini/ and books-mini/ (default: synthetic data)")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--runs", type=Path, help="run folders (default: $TTT_BENCH_RUNS/reproduce-PROFILE)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.profile == "paper" and not torch.cuda.is_available():
        plan = paper_plan(a.data_dir)
        print(
            plan.groupby("sweep")[["tokens", "train_flops", "gpu_hours"]]
            .sum()
            .assign(runs=plan.groupby("sweep").size())
            .to_string(float_format="{:.3g}".format)
        )
        print(
            f"total: {len(plan)} runs, {plan['tokens'].sum():.3g} tokens, "
            f"{plan['train_flops'].sum():.3g} FLOPs, ~{plan['gpu_hours'].sum():.0f} A100-hours at "
            f"{ASSUMED_MFU:.0%} MFU. No GPU here: nothing was run."
        )
        return
    runs = a.runs or Path(os.environ.get("TTT_BENCH_RUNS", "runs")) / f"reproduce-{a.profile}"
    start = time.perf_counter()
    rep = Report(a.profile, a.data_dir)
    step_table1(rep, runs, a.out)
    step_minibatch(rep, runs, a.out)
    step_scaling(rep, runs, a.out)
    if a.profile != "smoke":
        step_latency(rep, a.out)
    rep.write(a.out / "REPORT.md", time.perf_counter() - start)
    print(f"results in {a.out}/ (REPORT.md)")


if __name__ == "__main__":
    main()
