"""`ttt-bench bench SUITE`: run a benchmark suite of ttt_bench.bench, print its table, write its CSV."""

import importlib
from pathlib import Path

from ttt_bench.cli.common import SUBCOMMANDS, ArgumentParser, fail

from ttt_bench.config import runs_root

ZERO_OK = {"warmup", "chunk_size", "ref_seqlen", "seed"}  # integer options where 0 means none or automatic


def parser() -> ArgumentParser:
    from ttt_bench.bench import SUITES

    p = ArgumentParser(prog="ttt-bench bench", description=SUBCOMMANDS["bench"] + " (docs/speed.md)")
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, text in SUITES.items():
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--out", type=Path, help="CSV path (default: $TTT_BENCH_RUNS/bench/<suite>.csv,\n"
                       "TTT_BENCH_RUNS defaulting to runs)")
        importlib.import_module(f"ttt_bench.bench.{name}").add_arguments(s)
    return p


def check_options(a) -> None:
    """Sizes, counts and the device, before anything is built."""
    from ttt_bench.training.checkpoint import torch_device

    for key, value in vars(a).items():
        low = 0 if key in ZERO_OK else 1
        if isinstance(value, int) and not isinstance(value, bool) and value < low:
            fail(f"--{key.replace('_', '-')} {value} must be an integer >= {low}")
    if getattr(a, "device", None):
        torch_device(a.device, "--device")


def run(args: list[str]) -> None:
    import time

    import pandas as pd

    from ttt_bench.bench.common import busy_cores, conditions, load_average
    from ttt_bench.io import write_atomic
    from ttt_bench.machine import hardware

    if args[:1] == ["forms"]:
        from ttt_bench.bench.forms import compile_cache

        compile_cache()  # before parser() imports the models, and with them torch._dynamo
    a = parser().parse_args(args)
    check_options(a)
    suite = importlib.import_module(f"ttt_bench.bench.{a.suite}")
    busy, load = busy_cores(), load_average()
    start = time.perf_counter()
    try:
        df = suite.run(a)
    except ValueError as e:
        fail(str(e))
    wall = time.perf_counter() - start
    threads = getattr(a, "threads", None) or 1
    cond = conditions(busy, load, threads)
    df = df.assign(**cond)

    out = a.out or runs_root() / "bench" / f"{a.suite}.csv"
    write_atomic(out, df.to_csv(index=False))
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200,
                           "display.float_format", "{:.4g}".format):
        print(df.dropna(axis=1, how="all").to_string(index=False))
    for line in getattr(suite, "summary", lambda _: [])(df):
        print(line)
    print(f"command: ttt-bench bench {' '.join(args)}")
    print(f"hardware: {hardware()}; wall time {wall:.0f} s")
    loaded = "; TAKEN UNDER LOAD: other work competed for the cores, the timings are not reliable"
    print(f"conditions: other work kept {cond['busy_cores_before']} cores busy just before; load average "
          f"{cond['load_before']} before, {cond['load_after']} after; {threads} threads"
          f"{loaded if cond['under_load'] else ''}")
    print(f"wrote {out}")
