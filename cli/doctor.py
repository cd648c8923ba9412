"""`ttt-bench doctor`: what this machine gives the toolkit (ttt_bench/doctor.py)."""

from ttt_bench.cli.common import SUBCOMMANDS, ArgumentParser


def run(args: list[str]) -> None:
    ArgumentParser(prog="ttt-bench doctor", description=SUBCOMMANDS["doctor"]).parse_args(args)
    from ttt_bench.doctor import report

    print("\n".join(report()))
