"""`ttt-bench ablate` (placeholder until sweeps land)."""

import argparse

from ttt_bench.cli.main import SUBCOMMANDS, fail


def run(args: list[str]) -> None:
    argparse.ArgumentParser(prog="ttt-bench ablate", description=SUBCOMMANDS["ablate"]).parse_args(args)
    fail("`ttt-bench ablate` is not available yet (the sweeps land with the experiments issue); nothing was run", code=3)
