"""Shared fixtures. Real corpora are found through one setting: TTT_BENCH_DATA_DIR (default
../shared/data beside the repository); tests that need them skip with a reason when absent."""

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in its CPU interpreter where there is no GPU (CI); the variable must be set before any
# module decorates a kernel, i.e. before the first test imports ttt_bench.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("TTT_BENCH_DATA_DIR", REPO.parent / "shared" / "data"))

# Tiny synthetic corpus + batch geometry for end-to-end runs (seconds, not minutes).
TINY = [
    "data.corpus.train_docs=24",
    "data.corpus.validation_docs=4",
    "data.corpus.mean_doc_bytes=4000",
    "data.seq_len=64",
    "data.micro_batch_size=4",
    "recipe.tokens_per_batch=512",
    "data.num_proc=1",
    "data.val_tokens=4096",
    "trainer.enable_progress_bar=false",
]


# Two tiers, as torchtitan's unit and integration tests: `make test-fast` (-m "not integration and not
# slow", a developer's inner loop, under 3 minutes on 2 cores) and `make test` (everything; what CI runs).
# The integration tier is every test of the modules that run the CLI, training runs, sweeps, the campaign
# or the Triton compiler end to end; a slower test elsewhere is marked `slow` where it is defined.
INTEGRATION = {
    "test_bad_inputs", "test_campaign", "test_cluster", "test_documented_commands", "test_experiments",
    "test_fuzz", "test_interrupt", "test_kernels_aot", "test_readme", "test_reliability", "test_runs",
    "test_scaleout", "test_sweep_folder", "test_wheelhouse",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in INTEGRATION:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def _isolated_paths(tmp_path_factory):
    """Runs and caches of the test session go to temporary folders, never into the repository."""
    os.environ["TTT_BENCH_RUNS"] = str(tmp_path_factory.mktemp("runs"))
    os.environ["TTT_BENCH_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation (very slow on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def float64_one_thread(one_thread):
    """float64 for exact comparisons (fast path against its reference), on one thread."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute error relative to the largest entry of the reference b."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.fixture
def shared_data() -> Path:
    if not (DATA_DIR / "pile-mini" / "train.jsonl.zst").is_file():
        pytest.skip(
            f"real corpora not found at {DATA_DIR} (set TTT_BENCH_DATA_DIR to the folder holding pile-mini/)"
        )
    return DATA_DIR
