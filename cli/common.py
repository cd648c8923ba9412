"""What every subcommand shares: the list of subcommands, one-line errors, an argparse that gives them."""

import argparse
import difflib
import errno
import sys

SUBCOMMANDS = {
    "train": "train a model: ttt-bench train model=ttt_linear size=s data=synthetic",
    "eval": "evaluate a checkpoint: ttt-bench eval ckpt_path=runs/<run>/checkpoints/last.ckpt",
    "generate": "sample text from a checkpoint: ttt-bench generate CKPT --prompt 'Once'",
    "ablate": "run a sweep into a results registry: ttt-bench ablate table1",
    "plot": "draw a paper figure from a registry: ttt-bench plot scaling",
    "runs": "list run folders with their status and numbers: ttt-bench runs runs/",
    "bench": "measure speed: ttt-bench bench models",
    "doctor": "what this machine supports: torch, CUDA, bf16, kernels, data folder, each model's kernel path",
}


def fail(message: str, code: int = 2) -> None:
    message = " ".join(str(message).split())  # one line, whatever the exception text held
    print(f"ttt-bench: {'' if code == 130 else 'error: '}{message}", file=sys.stderr)
    sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with ttt-bench's one-line errors (no usage block)."""

    def error(self, message: str) -> None:
        fail(f"{message} (see {self.prog} --help)")


def os_error(e: OSError) -> str:
    """One line for a failed read or write: a full disk, a missing file, a permission."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return (f"no space left on device{where}; free some space or write elsewhere "
                "(TTT_BENCH_RUNS, TTT_BENCH_CACHE or --out)")
    return f"{e.strerror or e}{where}; check the path and its permissions"


def did_you_mean(word: str, options, prefix: str = "") -> str:
    options = sorted(str(o) for o in options)
    hint = difflib.get_close_matches(word, options, n=1)
    return f"; did you mean '{prefix}{hint[0]}'?" if hint else f"; use one of: {', '.join(options)}"
