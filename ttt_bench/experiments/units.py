"""Per-byte units: what the paper's effects are worth in our units (issue 32).

The paper reports perplexity per Llama token (a 32k vocabulary); ours is per byte. A 32k byte-level BPE
trained on each training split stands in for Llama's tokenizer, and its bytes per token on the same
validation text convert a token perplexity to a byte one: ln ppl_byte = ln ppl_token / (bytes per token).
A claim then reads its minimum detectable effect against the paper's effect in these units, relative to its
reference: |ln(ppl_a / ppl_b)| / (bytes per token) for perplexities (`paper_effect`). Nothing is trained.
"""

import math
import time
from pathlib import Path

import pandas as pd
from hydra.utils import instantiate

from ..io import write_atomic
from .engine.experiment import Experiment, Section, read_csv
from .engine.plan import composed, data_overrides
from .engine.report import Step

VOCAB = 32000  # Llama's vocabulary size
ROLES = ("pile", "books")


def bytes_per_token(role: str, data_dir: str | None) -> dict:
    """A 32k BPE trained on the role's training split (cached with the token caches): its bytes per token
    on the validation and training text."""
    start = time.perf_counter()
    cfg = composed([*data_overrides(role, data_dir), "data.tokenizer.kind=bpe",
                    f"+data.tokenizer.vocab_size={VOCAB}"])
    dm = instantiate(cfg.data)
    dm.prepare_data()
    return {"role": role, "corpus": "synthetic" if data_dir is None else f"{role}-mini", "vocab_size": VOCAB,
            "bytes_per_token": dm.bytes_per_token("validation"),
            "train_bytes_per_token": dm.bytes_per_token("train"),
            "seconds": round(time.perf_counter() - start, 1)}


def paper_effect(results, role: str, paper_a: float | None, paper_b: float | None) -> float | None:
    """The paper's effect between two perplexities per token, per byte of the role's text, relative to the
    reference (|ln(a / b)| / bytes per token); None where a number or the units are missing."""
    units = results.csv("units", "units.csv")
    if paper_a is None or paper_b is None or units is None or role not in set(units["role"]):
        return None
    bpt = float(units.set_index("role").loc[role, "bytes_per_token"])
    return abs(math.log(paper_a / paper_b)) / bpt


def context(results, role: str, n_bytes: int) -> tuple[str, float | None]:
    """A context in bytes as a sentence names it ("1,024 bytes, about 250 Llama tokens"), and its tokens
    (None without the units)."""
    units = results.csv("units", "units.csv")
    if units is None or role not in set(units["role"]):
        return f"{n_bytes:,} bytes", None
    tokens = n_bytes / float(units.set_index("role").loc[role, "bytes_per_token"])
    return f"{n_bytes:,} bytes, about {tokens:,.0f} Llama tokens", tokens


class Units(Experiment):
    name = "units"
    trains = False
    seconds = {"cpu": 128.0}  # two 32k BPEs on the 2-core CPU (results/cpu/units/step.json); synthetic: none
    section = Section(
        "Per-byte units: the paper's effects in bytes",
        "The paper's perplexities are per Llama token (32k vocabulary). A 32k byte-level BPE trained on each "
        "training split stands in for that tokenizer: its bytes per token convert the paper's effects to "
        "per-byte units (ln ppl_byte = ln ppl_token / bytes per token), against which every claim's minimum "
        "detectable effect is read (a claim whose MDE is larger than the paper's effect is underpowered).",
        ["units.md"],
        [],
    )

    def run_step(self, ctx) -> None:
        """The real corpora's units; the synthetic corpus stands in for no text the paper measured."""
        if ctx.data_dir is None:
            return
        step = Step(ctx.out, self.name, f"python -m ttt_bench.reproduce --steps units{ctx.flags}")
        step.csv("units.csv", pd.DataFrame([bytes_per_token(role, ctx.data_dir) for role in ROLES]))
        self.tabulate(step.dir)
        step.done()

    def tabulate(self, folder: Path) -> None:
        units = read_csv(folder, "units.csv")
        if units is None:
            return
        lines = ["| text | tokenizer | bytes per token (validation) | (training) |", "|---|---|---:|---:|"]
        lines += [f"| {r.corpus} | BPE, {r.vocab_size} tokens, trained on its training split | "
                  f"{r.bytes_per_token:.3f} | {r.train_bytes_per_token:.3f} |" for r in units.itertuples()]
        write_atomic(folder / "units.md", "\n".join(lines) + "\n")


EXPERIMENT = Units()
