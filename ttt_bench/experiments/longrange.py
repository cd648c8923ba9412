"""Does a model use what it read thousands of bytes ago? The embedded synthetic corpus (data/synthetic.py)
binds each document's entity names to random codes ("Kavomir holds the code 4821-7730.") and restates the
facts later in the document: the digits of a restated code are predictable only from the fact's first
mention. `fact_recall` measures a byte-level model's loss on those digits, binned by the distance back to
the first mention, for mentions inside and beyond the model's context window. A model that uses the fact
has a loss far below ln 10 = 2.30 nats (a random digit); one that does not stays near it, as on the first
mentions themselves, which `fact_recall` reports as the reference row.
"""

import math
import re
from collections.abc import Iterable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

FACT = re.compile(rb"([A-Z][a-z]+) holds the code (\d{4}-\d{4})\.")
DISTANCE_BINS = (0, 256, 512, 1024, 2048, 4096, 8192, math.inf)  # bytes back to the first mention
RANDOM_DIGIT = math.log(10)


def code_digits(text: bytes) -> tuple[dict[int, int], list[int]]:
    """({byte position: distance back to the same byte of the fact's first mention} for every digit of a
    restated code, [byte positions of the digits of first mentions])."""
    first: dict[bytes, int] = {}
    restated, firsts = {}, []
    for m in FACT.finditer(text):
        name, start = m.group(1), m.start(2)
        digits = [start + k for k in range(9) if k != 4]  # dddd-dddd without the '-'
        if name in first:
            restated.update((p, start - first[name]) for p in digits)
        else:
            first[name] = start
            firsts += digits
    return restated, firsts


def _bin(distance: int) -> str:
    i = int(np.searchsorted(DISTANCE_BINS, distance, side="right")) - 1
    lo, hi = DISTANCE_BINS[i], DISTANCE_BINS[i + 1]
    return f">= {lo}" if math.isinf(hi) else f"{lo}-{hi}"


@torch.no_grad()
def fact_recall(
    model: torch.nn.Module, documents: Iterable[str], seq_len: int, max_docs: int = 16
) -> pd.DataFrame:
    """The loss (nats) on the digits of restated facts, by distance bin and whether the first mention is in
    the window, over the first `max_docs` documents, each cut into windows of `seq_len` bytes from its start
    (byte tokenizer: token id = byte). Rows: kind ('restated' or 'first mention'), distance bin, in_context,
    loss (mean), n."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rows = []
    for d, text in enumerate(documents):
        if d >= max_docs:
            break
        data = text.encode("utf-8")
        restated, firsts = code_digits(data)
        firsts = set(firsts)
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        for w0 in range(0, len(ids) - 1, seq_len):
            window = ids[w0 : w0 + seq_len + 1].to(device)
            loss = F.cross_entropy(model(window[None, :-1])[0].float(), window[1:], reduction="none").cpu()
            for j, p in enumerate(range(w0 + 1, w0 + len(window))):  # loss[j]: the byte at p
                if p in restated:
                    dist = restated[p]
                    rows.append(("restated", _bin(dist), p - dist >= w0, float(loss[j])))
                elif p in firsts:
                    rows.append(("first mention", "", False, float(loss[j])))
    model.train(was_training)
    df = pd.DataFrame(rows, columns=["kind", "distance", "in_context", "loss"])
    return (
        df.groupby(["kind", "distance", "in_context"], sort=False)["loss"]
        .agg(loss="mean", n="size")
        .reset_index()
    )


def checkpoint_fact_recall(ckpt_path, max_docs: int = 16) -> pd.DataFrame:
    """`fact_recall` of a checkpoint trained on the synthetic corpus, on that corpus's validation documents
    at the context it was trained with."""
    from hydra.utils import instantiate

    from ..errors import UserError
    from ..training.checkpoint import load_checkpoint

    module, tokenizer = load_checkpoint(ckpt_path)
    cfg = module.hparams["config"]
    if cfg["data"].get("name") != "synthetic" or not getattr(tokenizer, "byte_level", False):
        raise UserError(
            f"{ckpt_path}: the fact metric needs a byte-level model trained on data=synthetic, "
            "whose facts are known"
        )
    corpus = instantiate(cfg["data"]["corpus"])
    return fact_recall(module.model, corpus.documents("validation"), int(cfg["data"]["seq_len"]), max_docs)


def bin_order(label: str) -> float:
    """Sort key of a distance bin label ('256-512', '>= 8192')."""
    return float(label.split("-")[0].lstrip(">= ")) if label else -1.0
