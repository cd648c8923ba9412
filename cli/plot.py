"""`ttt-bench plot FIGURE`: draw a paper figure (PNG, and with --pdf a PDF) from a sweep folder or a CSV;
every figure belongs to an experiment (ttt_bench/experiments/), which draws it."""

import argparse
import contextlib
import tempfile
from pathlib import Path

from ttt_bench.cli.common import SUBCOMMANDS, ArgumentParser, fail

from ttt_bench.errors import UserError


def run(args: list[str]) -> None:
    from ttt_bench.experiments import plots

    figures = plots()
    p = ArgumentParser(
        prog="ttt-bench plot",
        description=SUBCOMMANDS["plot"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {k:12s} {v.help}" for k, v in figures.items())
        + "\n\nThe n-gram floors a sweep wrote beside its runs (floors.csv) are drawn on the perplexity "
        "figures.",
    )
    p.add_argument("figure", choices=figures)
    p.add_argument("inputs", nargs="+", type=Path, help="sweep folder(s) or CSV file(s), see below")
    p.add_argument("--out", type=Path, default=Path("figures"), help="folder for FIGURE.png (and .pdf)")
    p.add_argument("--pdf", action="store_true", help="also write FIGURE.pdf, vector art for a paper")
    a = p.parse_args(args)
    from ttt_bench.experiments.engine.plotting import vector
    from ttt_bench.io import write_atomic

    src = a.inputs[0]
    for path in a.inputs:
        if not path.exists():
            fail(f"{path} does not exist")
    run_figures = ("curves", "token-index", "inner-loss")  # they also take run folders
    if src.is_dir() and a.figure not in run_figures and \
            not any((src / name).is_file() for name in ("plan.json", "registry.csv")):
        fail(f"{src} is not a sweep folder (no plan.json or registry.csv); pass the --out folder of "
             "`ttt-bench ablate`")
    with tempfile.TemporaryDirectory() as tmp:  # drawn aside, then copied: a failure leaves no partial figure
        try:
            with vector() if a.pdf else contextlib.nullcontext():
                paths = figures[a.figure].draw(a.inputs, Path(tmp) / a.figure.replace("-", "_"))
        except UserError as e:
            fail(f"cannot draw {a.figure} from {src}: {e}")
        except (ValueError, KeyError, IndexError) as e:
            fail(f"cannot draw {a.figure} from {src} ({type(e).__name__}: {e}); is it the right input? "
                 "(see --help)")
        for path in paths:
            write_atomic(a.out / path.name, path.read_bytes())
    print("\n".join(str(a.out / p.name) for p in paths))
