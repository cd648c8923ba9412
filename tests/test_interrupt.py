"""Ctrl-C during `ttt-bench train` prints the toolkit's one line and nothing of Hydra's, exits 130, and the
same command resumes with a progress bar that has its total and an ETA (issue 50, points 4 and 5)."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, TINY
from ttt_bench.training.callbacks import StepProgressBar

# Steps enough that the run is still training when it is interrupted; no checkpoint or validation before it.
MAX_STEPS = 1000
RUN = [o for o in TINY if not o.startswith("trainer.enable_progress_bar")] + [
    "model=transformer", "size=xs", f"trainer.max_steps={MAX_STEPS}", "checkpoint_every_n_steps=1000",
    "eval_every_n_steps=1000"]
FRIENDLY = re.compile(rf"ttt-bench: interrupted at step (\d+) of {MAX_STEPS}; the same command resumes")


def last_logged_step(runs: Path) -> int:
    """The last optimizer step in the run's losses.csv (0 before the first)."""
    for path in runs.glob("*/*/losses.csv"):
        rows = path.read_text().strip().splitlines()[1:]
        if rows and rows[-1].count(",") == 1:  # a whole row (the file is being appended to)
            return int(rows[-1].split(",")[0])
    return 0


def interrupted_train(runs: Path, out: Path, after_step: int) -> SimpleNamespace:
    """`ttt-bench train` in a process of its own, sent SIGINT (as Ctrl-C does) once it has logged optimizer
    step `after_step`: its exit code, stdout and stderr."""
    out.mkdir()
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        command = [sys.executable, "-m", "ttt_bench.cli.main", "train", *RUN, f"paths.runs={runs}"]
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=REPO)
        try:
            deadline = time.monotonic() + 600  # seconds on an idle machine; a busy one is slower
            while last_logged_step(runs) < after_step and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert proc.poll() is None, (out / "stderr").read_text()[-3000:]
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = {name: (out / name).read_text() for name in ("stdout", "stderr")}
    return SimpleNamespace(code=code, **text)


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> SimpleNamespace:
    """A run interrupted once it has trained a step."""
    runs, out = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("out")
    result = interrupted_train(runs, out / "first", after_step=1)
    result.runs, result.out = runs, out
    return result


def test_ctrl_c_during_train_prints_one_line_and_exits_130(first):
    """Not Hydra's "Error executing job with overrides: [...]" (an exception leaving its task) first."""
    assert first.code == 130, first.stderr[-3000:]
    assert FRIENDLY.fullmatch(first.stderr.strip().splitlines()[-1]), first.stderr[-3000:]
    assert "Error executing job" not in first.stdout + first.stderr
    assert "Traceback" not in first.stderr


def test_the_resumed_run_shows_its_total_and_eta(first):
    """The same command resumes from the step saved at the interrupt; its bar reads "<step>/1000" with an
    ETA from its first step on (Lightning skips on_train_epoch_start mid-epoch: the bar read "<step>/?")."""
    step = int(FRIENDLY.fullmatch(first.stderr.strip().splitlines()[-1]).group(1))
    resumed = interrupted_train(first.runs, first.out / "resumed", after_step=step + 1)
    assert resumed.code == 130, resumed.stderr[-3000:]
    bars = re.split(r"[\r\n]", resumed.stdout)
    assert not [b for b in bars if re.search(r"\b[1-9]\d*/\?", b)], resumed.stdout[-3000:]  # no "93/?"
    with_eta = rf"^step: .*\b{step + 1}/{MAX_STEPS} \[[\d:]+<[\d:]+,"
    assert any(re.search(with_eta, b) for b in bars), resumed.stdout[-3000:]


def test_the_bar_of_a_resumed_run_counts_from_its_step_to_max_steps(capsys):
    """As Lightning calls it for a run resumed mid-epoch: on_train_start and no on_train_epoch_start."""
    trainer = SimpleNamespace(max_steps=245, global_step=93, is_global_zero=True, current_epoch=0)
    callback = StepProgressBar()
    callback._trainer = trainer  # (Trainer.fit attaches it)
    callback.on_train_start(trainer, None)
    bar = callback.train_progress_bar
    assert (bar.n, bar.total) == (93, 245)
    bar.n += 1  # a step later: an ETA
    assert re.search(r" 94/245 \[[\d:]+<[\d:]+,", str(bar))
    bar.close()
