"""Shared fixtures and constants (the plain functions test modules share are in tests/helpers.py; a test
module never imports another). Real corpora are found through one setting: TTT_BENCH_DATA_DIR (default
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

# The tiny runs of the end-to-end tests, defined here only: a module's variant adds or overrides keys, e.g.
# [*TINY, "trainer.max_steps=8"] (a later override of the same key wins, in Hydra as on the command line).
# The tiny text run: a synthetic corpus of 24 documents of ~4 kB and the batch geometry of a step of 512
# tokens (2 micro-batches of 4 sequences of 64); seconds, not minutes.
TINY_CORPUS = ["data.corpus.train_docs=24", "data.corpus.validation_docs=4",
               "data.corpus.mean_doc_bytes=4000"]
TINY_BATCH = ["data.seq_len=64", "data.micro_batch_size=4", "recipe.tokens_per_batch=512", "data.num_proc=1",
              "data.val_tokens=4096", "trainer.enable_progress_bar=false"]
TINY = [*TINY_CORPUS, *TINY_BATCH]
# The run the sweep tests plan (tests/test_engine_*.py, test_sweep_folder.py): two steps on 20 documents.
SWEEP_RUN = [*TINY, "data=synthetic", "size=xs", "data.corpus.train_docs=20", "data.val_tokens=1024",
             "trainer.max_steps=2"]
# The tiny image run: an MTTT-Linear classifier, one step of 32 synthetic images, 32 to validate and test on.
TINY_IMAGE_BUDGET = ["recipe.total_images=32", "recipe.batch_size=32", "data.micro_batch_size=32",
                     "data.val_examples=32", "data.test_examples=32", "trainer.enable_progress_bar=false"]
TINY_IMAGE = ["task=image", "data=synthetic_images", "model=mttt_linear", "size=xs", *TINY_IMAGE_BUDGET]
# The options of `ttt-bench bench models` that make every model tiny (contexts 32 and 64, one repeat).
BENCH_TINY = ["--size", "xs", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--mlp-hidden", "64",
              "--vocab-size", "64", "--contexts", "32,64", "--train-context", "32", "--tokens-per-step", "64",
              "--decode-tokens", "2", "--warmup", "0", "--repeats", "1", "--threads", "1", "--device", "cpu"]


# Two tiers, as torchtitan's unit and integration tests: `make test-fast` (-m "not integration and not
# slow", a developer's inner loop, under 3 minutes on 2 cores) and `make test` (everything; what CI runs).
# The integration tier is every test of the modules that run the CLI, training runs, sweeps, the campaign
# or the Triton compiler end to end (test_engine_*: the sweep engine's, which train tiny sweeps); a slower
# test elsewhere is marked `slow` where it is defined.
INTEGRATION = {
    "test_bad_inputs", "test_campaign", "test_cluster", "test_documented_commands", "test_engine_cost",
    "test_engine_plan", "test_engine_progress", "test_engine_report", "test_engine_runner", "test_fuzz",
    "test_interrupt", "test_kernels_aot", "test_readme", "test_reliability", "test_runs", "test_scaleout",
    "test_sweep_folder", "test_wheelhouse",
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


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A folder holding the tokenizer.json of a tiny byte-level BPE with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Zepibi holds the code 4417 to the vault."] * 20, trainer=trainer)
    folder = tmp_path / "llama-tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def no_hub(monkeypatch):
    """HF_HUB_OFFLINE=1, and any attempt to open a connection fails the test."""
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def connect(*args, **kwargs):
        raise AssertionError("the network was used although HF_HUB_OFFLINE is set")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "create_connection", connect)
