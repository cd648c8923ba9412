"""`ttt-bench bench SUITE`: run a benchmark suite of ttt_bench.bench, print its table, write its CSV."""

import argparse
import importlib
from pathlib import Path

from ttt_bench.cli.main import SUBCOMMANDS, fail


def parser() -> argparse.ArgumentParser:
    from ttt_bench.bench import SUITES

    p = argparse.ArgumentParser(prog="ttt-bench bench", description=SUBCOMMANDS["bench"] + " (docs/speed.md)")
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, text in SUITES.items():
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--out", type=Path, help="CSV path (default: $TTT_BENCH_RUNS/bench/<suite>.csv,\n"
                       "TTT_BENCH_RUNS defaulting to runs)")
        importlib.import_module(f"ttt_bench.bench.{name}").add_arguments(s)
    return p


def run(args: list[str]) -> None:
    import os
    import time

    import pandas as pd

    from ttt_bench.bench.common import hardware
    from ttt_bench.io import write_atomic

    a = parser().parse_args(args)
    suite = importlib.import_module(f"ttt_bench.bench.{a.suite}")
    start = time.perf_counter()
    try:
        df = suite.run(a)
    except ValueError as e:
        fail(str(e))
    wall = time.perf_counter() - start

    out = a.out or Path(os.environ.get("TTT_BENCH_RUNS", "runs")) / "bench" / f"{a.suite}.csv"
    write_atomic(out, df.to_csv(index=False))
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200,
                           "display.float_format", "{:.4g}".format):
        print(df.dropna(axis=1, how="all").to_string(index=False))
    for line in getattr(suite, "summary", lambda _: [])(df):
        print(line)
    print(f"command: ttt-bench bench {' '.join(args)}")
    print(f"hardware: {hardware()}; wall time {wall:.0f} s")
    print(f"wrote {out}")
