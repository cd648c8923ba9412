"""How many times a run's token budget passes over its training corpus, and a one-line warning when it is
more than a few times (issue 50).

The paper trains each model on fresh Pile text: 2.5B tokens at 125m are one pass over a fraction of one
Pile shard. The same budget on a small corpus (pile-mini, 34M tokens) trains on the same text about 70
times, and the run then measures how well a model memorises pile-mini rather than what the paper measured.
Nothing stops such a run, so it is said loudly, twice:

- `ttt-bench train` (training/train.py), with the exact count once the train split is tokenized
  (`trained_loop_warning`: the tokens of the train shards the budget reached, token_cache.split_tokens);
- `ttt-bench ablate --plan` (cli/ablate.py), before anything is tokenized (`planned_loop_warning`), from an
  upper bound of the train split's tokens: at most one token a byte of its files, decompressed (a byte-level
  tokenizer makes one token a byte; BPE and the Llama tokenizer merge bytes, and their byte fallback makes at
  most one token a byte; a JSON line's field names and quotes outnumber the end-of-document token), so the
  epochs the plan names are a lower bound and it never warns where training would not. Counting stops once
  the bytes read rule a warning out, so a plan over real shards decompresses at most a quarter of its budget
  in bytes, once per corpus and budget.

Neither refuses the run: several passes over a corpus are a legitimate choice (MQAR's sequences and MTTT's
images are drawn from fixed sets by design, and a deliberate small-data trial is a user's to make).
"""

import functools
import os

from ..errors import UserError
from .corpora import LocalCorpus, SyntheticCorpus, _zstd_chunks

# More than 4 passes is warned about. Muennighoff et al. (2023, "Scaling Data-Constrained Language
# Models") found that up to 4 epochs of repeated data change a language model's loss negligibly against as
# much unique data, and that with more repetition the value of the added compute decays toward zero. Up to
# the threshold a run is still close to what the paper measured; above it, it is not. The budgets of the
# smoke, quick, cpu and gpu profiles (up to about 21M tokens) stay within one pass of their corpora
# (pile-mini: 34M byte tokens, books-mini: 66M, the synthetic corpus: 19M), and the paper profile's 2.5B
# tokens need the Pile: the threshold separates the two by a wide margin.
MAX_EPOCHS = 4
SYNTHETIC_BOUND = 2  # synthetic documents hold at most 1.42x data.corpus.mean_doc_bytes (measured)
FIX = "point data.corpus.train_files at real shards (docs/cluster.md) or lower recipe.total_tokens"


def _passes(epochs: float) -> str:
    return f"{epochs:,.0f}" if epochs >= 10 else f"{epochs:.1f}"


def describe(corpus) -> str:
    """The corpus a warning names: its train files (the first and how many more), or the synthetic one."""
    if isinstance(corpus, LocalCorpus):
        try:
            files = corpus.files("train")
        except UserError:
            return str(corpus.train_files)
        return files[0] + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
    if isinstance(corpus, SyntheticCorpus):
        return "the embedded synthetic corpus"
    return type(corpus).__name__


def loop_warning(run: str, budget: float, corpus_tokens: int, corpus: str, bound: bool = False) -> str | None:
    """The one-line warning for a run that trains `budget` tokens on a train split of `corpus_tokens`
    (`bound`: an upper bound, so the epochs are a lower bound), or None at MAX_EPOCHS passes or fewer."""
    epochs = budget / max(corpus_tokens, 1)
    if epochs <= MAX_EPOCHS:
        return None
    least, most = ("at least ", "at most ") if bound else ("", "")
    return (f"run {run} trains {budget:,.0f} tokens, {least}{_passes(epochs)} epochs of its train split "
            f"({most}{corpus_tokens:,} tokens: {corpus}); more than {MAX_EPOCHS} epochs repeat the same text "
            f"instead of the paper's fresh tokens: {FIX}")


def trained_loop_warning(run: str, dm) -> str | None:
    """The warning for a prepared text datamodule (LMDataModule, after prepare_data) whose budget
    (`dm.train_tokens`) passes over its train split more than MAX_EPOCHS times; None for any other data."""
    budget, meta = getattr(dm, "train_tokens", None), getattr(dm, "meta", {}).get("train")
    if not budget or not meta or not hasattr(dm, "corpus"):
        return None
    return loop_warning(run, budget, int(meta["n_tokens"]), describe(dm.corpus))


@functools.lru_cache(maxsize=256)
def _file_bytes(path: str, stamp: tuple, limit: float) -> int:
    """A train file's bytes, decompressed for .zst; the count stops once past `limit`. `stamp` (size, mtime)
    keys the cache, so a plan counts each file once per budget."""
    if not path.endswith(".zst"):
        return stamp[0] + (1 if path.endswith(".txt") else 0)  # a .txt file: one document, one EOS
    n = 0
    for chunk in _zstd_chunks(path):
        n += len(chunk)
        if n > limit:
            break
    return n


def train_tokens_at_most(corpus, limit: float) -> int | None:
    """An upper bound of the tokens of `corpus`' train split without tokenizing it (module docstring), or None
    where there is none to give (a hub corpus, unreadable files: training says what is wrong with them). The
    count may stop anywhere past `limit`."""
    if isinstance(corpus, SyntheticCorpus):
        docs, size = corpus.train_docs, corpus.mean_doc_bytes
        ok = all(isinstance(v, int) and v > 0 for v in (docs, size))  # else the run says what is wrong
        return SYNTHETIC_BOUND * docs * size if ok else None
    if not isinstance(corpus, LocalCorpus):
        return None
    total = 0
    try:
        for path in corpus.files("train"):
            stat = os.stat(path)
            total += _file_bytes(path, (stat.st_size, stat.st_mtime_ns), limit - total)
            if total > limit:
                break
    except (OSError, UserError):
        return None
    return total


def planned_loop_warning(run: str, data_cfg, budget: float) -> str | None:
    """The warning for a planned run whose `budget` (tokens) would pass over its train split more than
    MAX_EPOCHS times, judged from its data config before anything is tokenized; None otherwise, and for data
    without a text corpus (MQAR, images) or a corpus whose size cannot be bounded."""
    corpus_cfg = data_cfg.get("corpus") if hasattr(data_cfg, "get") else None
    if corpus_cfg is None or not budget > 0:  # no text corpus; NaN: an image run
        return None
    from hydra.utils import instantiate

    try:
        corpus = instantiate(corpus_cfg)
        tokens = train_tokens_at_most(corpus, budget / MAX_EPOCHS)
        where = describe(corpus)
    except Exception:  # noqa: BLE001  (a corpus that cannot be built or read fails its run with its own line;
        return None  # the plan of it stays a plan)
    return None if tokens is None else loop_warning(run, budget, tokens, where, bound=True)
