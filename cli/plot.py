"""`ttt-bench plot FIGURE`: draw a paper figure (PNG and PDF) from a sweep registry or a CSV."""

import argparse
import tempfile
from pathlib import Path

from ttt_bench.cli.main import SUBCOMMANDS, ArgumentParser, fail

FIGURES = {
    "scaling": "perplexity vs training FLOPs per method (Figs 11/12/18); INPUT: a scaling sweep folder",
    "context": "context length as a hyper-parameter (Fig 13); INPUT: a scaling sweep folder",
    "token-index": "perplexity per token index (Figs 2 right/14); INPUT: a scaling sweep folder",
    "minibatch": "TTT mini-batch size (Fig 8); INPUT: a minibatch sweep folder (with timing.csv)",
    "inner-loss": "TTT inner losses per layer: against the token index for a language model (Figs 5/17), "
                  "against the inner step for MTTT (its Figs 1 right/3/4); INPUT: a run's inner_losses.csv "
                  "or an MTTT step's inner_loss.csv",
    "latency": "latency per token vs context (Figs 3/15); INPUT: CSVs of `ttt-bench bench`",
    "recall": "MQAR answer accuracy vs pairs per width, and vs state size; INPUT: a recall sweep folder",
}


def read_floors(src: Path) -> dict | None:
    """The byte n-gram floors a sweep wrote beside its runs (<sweep>/floors.json: role -> {name: ppl}),
    or beside a registry CSV; None when there are none."""
    import json

    path = (src if src.is_dir() else src.parent) / "floors.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        fail(f"cannot read the n-gram floors {path}: {e}")


def run(args: list[str]) -> None:
    p = ArgumentParser(
        prog="ttt-bench plot",
        description=SUBCOMMANDS["plot"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {k:12s} {v}" for k, v in FIGURES.items())
        + "\n\nA floors.json in the sweep folder (or beside a registry CSV) adds the byte n-gram floors to"
        " scaling, context, token-index and minibatch.",
    )
    p.add_argument("figure", choices=FIGURES)
    p.add_argument("inputs", nargs="+", type=Path, help="sweep folder(s) or CSV file(s), see below")
    p.add_argument("--out", type=Path, default=Path("figures"), help="folder for FIGURE.png/.pdf")
    a = p.parse_args(args)
    from ttt_bench.io import write_atomic

    src = a.inputs[0]
    for path in a.inputs:
        if not path.exists():
            fail(f"{path} does not exist")
    if src.is_dir() and not any((src / name).is_file() for name in ("plan.json", "registry.csv")):
        fail(f"{src} is not a sweep folder (no plan.json or registry.csv); pass the --out folder of "
             "`ttt-bench ablate`")
    floors = read_floors(src)
    with tempfile.TemporaryDirectory() as tmp:  # drawn aside, then copied: a failure leaves no partial figure
        paths = draw(a, src, Path(tmp) / a.figure.replace("-", "_"), floors)
        for path in paths:
            write_atomic(a.out / path.name, path.read_bytes())
    print("\n".join(str(a.out / p.name) for p in paths))


def draw(a, src: Path, stem: Path, floors: dict | None) -> list[Path]:
    import pandas as pd

    from ttt_bench.experiments import figures
    from ttt_bench.experiments.sweeps import read_registry

    try:
        if a.figure in ("scaling", "context"):
            paths = getattr(figures, a.figure)(read_registry(src), stem, floors=floors)
        elif a.figure == "token-index":
            reg = read_registry(src)
            curves = figures.read_token_index(figures.token_index_runs(reg), src)
            paths = figures.token_index(reg, curves, stem, floors=floors)
        elif a.figure == "minibatch":
            timing = src / "timing.csv"
            paths = figures.minibatch(
                read_registry(src), pd.read_csv(timing) if timing.is_file() else None, stem, floors=floors
            )
        elif a.figure == "recall":
            paths = figures.recall(read_registry(src), stem)
        elif a.figure == "inner-loss":
            paths = inner_loss(pd.read_csv(src), src, stem)
        else:
            paths = figures.latency(pd.concat([pd.read_csv(f) for f in a.inputs], ignore_index=True), stem)
    except (ValueError, KeyError, IndexError) as e:
        fail(f"cannot draw {a.figure} from {src} ({type(e).__name__}: {e}); is it the right input? "
             "(see --help)")
    return paths


def inner_loss(df, src: Path, stem: Path) -> list[Path]:
    """A language model's inner losses by token position, or MTTT's by inner step: a run's
    inner_losses.csv (its validation images) or a reproduce step's inner_loss.csv (one panel a row)."""
    from ttt_bench.experiments import figures
    from ttt_bench.experiments.mttt import inner_loss_figure

    if "position" in df:
        return figures.inner_loss(df, stem)
    if "config" not in df:  # one MTTT run: its validation images, titled <model>-<size>-<data>-T<tokens>
        df = df[df["split"] == "val"].assign(config=src.resolve().parent.parent.name)
    fig = inner_loss_figure(df, min_steps=1)
    if fig is None:
        raise ValueError("no inner losses in it")
    return figures.save(fig, stem)
