"""Every documented command on real output: each `ttt-bench plot` kind (those `ttt-bench plot --help` lists)
on the sweep folder or run folder its help names, as the commands that make it wrote them: the committed step
folders of results/cpu/ (what `make reproduce` and `ttt-bench ablate` write; copied, so nothing is drawn
into results/), run folders of `ttt-bench train` at the conftest's tiny size, `ttt-bench bench models`; and
each `ttt-bench bench` suite in its quickest form. test_readme.py runs the README's commands on made-up
registries; here the inputs are real (`plot minibatch` failed on every input while that test passed)."""

import os
import shutil
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
import torch
from ttt_bench.cli.main import main

from tests.conftest import BENCH_TINY, TINY, TINY_IMAGE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("documented")


RESULTS = Path(__file__).resolve().parents[1] / "results" / "cpu"


def committed(root, sweep: str) -> Path:
    """A copy of the committed step folder of `sweep` (its registry, floors, curves and step files)."""
    return Path(shutil.copytree(RESULTS / sweep, root / sweep))


@pytest.fixture(scope="module")
def minibatch_sweep(root):
    return committed(root, "minibatch")


@pytest.fixture(scope="module")
def scaling_sweep(root):
    return committed(root, "scaling")


@pytest.fixture(scope="module")
def recall_sweep(root):
    return committed(root, "recall")


@pytest.fixture(scope="module")
def runs(root) -> dict:
    """Run folders of `ttt-bench train`: two language models in one runs folder, and an MTTT classifier."""
    for model in ("ttt_linear", "transformer"):
        main(["train", f"model={model}", "size=xs", *TINY, "trainer.max_steps=2",
              f"paths.runs={root / 'runs'}"])
    main(["train", *TINY_IMAGE, f"paths.runs={root / 'runs-mttt'}"])
    folders = {p.parent for p in root.glob("runs*/*/*/metrics.json")}  # runs/<run_name>/<overrides>/
    return {"runs": root / "runs", **{f.parent.name.split("-")[0]: f for f in folders}}


@pytest.fixture(scope="module")
def models_csv(root):
    out = root / "bench" / "models.csv"
    main(["bench", "models", *BENCH["models"], "--out", str(out)])
    return out


def plot(kind: str, *inputs, out, pdf: bool = False) -> None:
    """`ttt-bench plot KIND INPUTS`: a PNG of a drawn figure (not blank); with --pdf its PDF too."""
    main(["plot", kind, *map(str, inputs), "--out", str(out), *["--pdf"] * pdf])
    png = out / f"{kind.replace('-', '_')}.png"
    image = matplotlib.image.imread(png)
    assert min(image.shape[:2]) > 300 and image[..., :3].std() > 0.05, f"{png} looks blank"
    assert png.with_suffix(".pdf").is_file() == pdf
    if pdf:
        assert png.with_suffix(".pdf").stat().st_size > 1000


PLOTTED = {"minibatch", "inner-loss", "scaling", "context", "token-index", "latency", "recall", "curves"}


def test_every_plot_kind_is_run_here():
    from ttt_bench.experiments import plots

    assert set(plots()) == PLOTTED, "a plot kind was added or renamed: run it on its input in this module"


def test_plot_minibatch_on_a_minibatch_sweep(minibatch_sweep, tmp_path):
    """As `make reproduce` writes the step (with timing.csv), then as `ablate` writes it (without)."""
    plot("minibatch", minibatch_sweep, out=tmp_path / "timed")
    untimed = Path(shutil.copytree(minibatch_sweep, tmp_path / "untimed"))
    (untimed / "timing.csv").unlink()
    plot("minibatch", untimed, out=tmp_path / "untimed-figure")


def test_plot_inner_loss_on_run_folders(runs, tmp_path):
    plot("inner-loss", runs["ttt_linear"], out=tmp_path / "folder")
    plot("inner-loss", runs["ttt_linear"] / "inner_losses.csv", out=tmp_path / "csv")
    plot("inner-loss", runs["mttt_linear"], out=tmp_path / "mttt")  # against the inner step


@pytest.mark.parametrize("kind", ["scaling", "context", "token-index"])
def test_plots_of_a_scaling_sweep(scaling_sweep, tmp_path, kind):
    plot(kind, scaling_sweep, out=tmp_path)


def test_plot_token_index_and_curves_of_run_folders(runs, tmp_path):
    plot("token-index", runs["ttt_linear"], runs["transformer"], out=tmp_path / "token-index")
    plot("curves", runs["ttt_linear"], runs["transformer"], out=tmp_path / "curves", pdf=True)
    plot("curves", runs["runs"], out=tmp_path / "curves-of-a-folder")  # a folder of runs


def test_plot_recall_on_a_recall_sweep(recall_sweep, tmp_path):
    plot("recall", recall_sweep, out=tmp_path)


def test_plot_latency_of_bench_models(models_csv, tmp_path):
    assert {"prefill", "decode"} <= set(pd.read_csv(models_csv)["phase"])
    plot("latency", models_csv, out=tmp_path)


# the quickest form of each suite: tiny sizes, one repeat
BENCH = {
    "models": ["--models", "transformer,ttt_linear", "--phases", "prefill,decode", *BENCH_TINY],
    "forms": ["--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--tokens", "64", "--scopes", "core",
              "--warmup", "0", "--repeats", "1", "--threads", "1", "--device", "cpu"],
    "scan": ["--batch", "1", "--seqlen", "32", "--ref-seqlen", "16", "--d-model", "8", "--repeats", "1"],
    "step": ["--models", "transformer", "--size", "xs", "--seq-len", "16", "--vocab-size", "64"],
    "profile": ["--models", "ttt_linear,mamba", "--size", "xs", "--seq-len", "32", "--top", "5",
                "--warmup", "0", "--threads", "1", "--device", "cpu"],
}


def test_every_bench_suite_is_run_here():
    from ttt_bench.bench import SUITES

    assert set(SUITES) == set(BENCH)


@pytest.mark.parametrize("suite", [s for s in BENCH if s != "models"])  # models: the latency plot's input
def test_bench_suite_in_its_quickest_form(suite, tmp_path, capsys, monkeypatch):
    options = BENCH[suite]
    if suite == "forms":
        if shutil.which("c++") is None:  # torch.compile on the CPU needs a C++ compiler
            options = [*options, "--no-fused"]
        # torch.compile's cache goes to the toolkit's cache folder, not $TMPDIR, and the command says where
        # (a compile earlier in this process set TORCHINDUCTOR_CACHE_DIR to torch's default: as a fresh one)
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            monkeypatch.delenv(name, raising=False)
        torch._dynamo.reset()  # compiled anew, into that cache
    csv = tmp_path / f"{suite}.csv"
    main(["bench", suite, *options, "--out", str(csv)])
    out = capsys.readouterr().out
    assert len(pd.read_csv(csv)) and f"wrote {csv}" in out
    if suite == "forms" and "--no-fused" not in options:
        cache = Path(os.environ["TTT_BENCH_CACHE"]) / "torch-compile"  # the session's (conftest)
        assert f"torch.compile cache: {cache}" in out and any(p.is_file() for p in cache.rglob("*"))
