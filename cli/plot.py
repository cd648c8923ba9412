"""`ttt-bench plot` (placeholder until figures land)."""

import argparse

from ttt_bench.cli.main import SUBCOMMANDS, fail


def run(args: list[str]) -> None:
    argparse.ArgumentParser(prog="ttt-bench plot", description=SUBCOMMANDS["plot"]).parse_args(args)
    fail("`ttt-bench plot` is not available yet (the figures land with the experiments issue); nothing was run", code=3)
