"""`ttt-bench bench` (placeholder until benchmarks land)."""

import argparse

from ttt_bench.cli.main import SUBCOMMANDS, fail


def run(args: list[str]) -> None:
    argparse.ArgumentParser(prog="ttt-bench bench", description=SUBCOMMANDS["bench"]).parse_args(args)
    fail("`ttt-bench bench` is not available yet (the benchmarks land with the speed issue); nothing was run", code=3)
