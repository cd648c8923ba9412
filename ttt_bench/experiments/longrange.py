"""Long range in text-like data (conf/sweep/longrange.yaml): does a model use what it read thousands of
bytes ago? The embedded synthetic corpus (data/synthetic.py) binds each document's entity names to random
codes ("Kavomir holds the code 4821-7730.") and restates the facts later in the document: the digits of a
restated code are predictable only from the fact's first mention. The four main models are trained at a
long context on that corpus; `fact_recall` measures a byte-level model's loss on those digits, binned by the
distance back to the first mention, for mentions inside and beyond the model's context window. A model that
uses the fact has a loss far below ln 10 = 2.30 nats (a random digit); one that does not stays near it, as
on the first mentions themselves, which `fact_recall` reports as the reference row.
"""

import math
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from ..errors import UserError
from ..io import write_atomic
from ..training.checkpoint import load_checkpoint
from .engine import plotting as P
from .engine.experiment import Experiment, Section, read_csv
from .engine.floors import undertrained
from .engine.plan import Run, configuration
from .engine.registry import finished_runs
from .engine.stats import mean_sd
from .engine.verdicts import INCONCLUSIVE, MISSING, UNDERTRAINED, Claim, Verdict, compare

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


FAR = 1024  # bytes back to the first mention from which a fact counts as far


def fact_recall_table(df: pd.DataFrame, registry: pd.DataFrame | None = None, floors=None) -> str:
    """Loss (nats) on restated facts' digits as Markdown: a row per method, a column per distance bin (first
    mention inside the window; mean +- std over seeds), then beyond the window and the first mentions; with
    the sweep's `registry` and n-gram `floors`, each model's validation perplexity on the text beside them."""
    rest = df[df["kind"] == "restated"]
    inside = rest[rest["in_context"].astype(bool)]
    bins = sorted(inside["distance"].unique(), key=bin_order)

    def cell(rows: pd.DataFrame) -> str:
        if rows.empty:
            return "-"
        per_seed = rows.assign(w=rows["loss"] * rows["n"]).groupby("seed")[["w", "n"]].sum()
        v = per_seed["w"] / per_seed["n"]
        return f"{v.mean():.2f}" if len(v) < 2 else f"{v.mean():.2f} +- {v.std():.2f}"

    runs = finished_runs(registry) if registry is not None else None
    ppl = runs is not None and not runs.empty
    lines = [
        "| Method | " + " | ".join(f"{b} B" for b in bins) + " | beyond the window | first mentions |"
        + (" text ppl |" if ppl else ""),
        "|---|" + "---:|" * (len(bins) + 2 + ppl),
    ]
    for label, g in df.groupby("label", sort=False):
        r = g[g["kind"] == "restated"]
        cells = [cell(r[r["in_context"].astype(bool) & (r["distance"] == b)]) for b in bins]
        cells += [cell(r[~r["in_context"].astype(bool)]), cell(g[g["kind"] == "first mention"])]
        if ppl:
            mine = runs[runs["label"] == label]
            under = len(undertrained(mine, floors))
            cells.append(mean_sd(mine["val_ppl"]) + (f" ({under} under the 3-gram floor)" if under else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    n = df[df["kind"] == "restated"]["n"].sum()
    lines.append(
        f"\nLoss in nats on the 8 digits of restated codes ({n} digits over all runs; mean +- std over "
        f"seeds), by bytes back to the fact's first mention; a random digit costs ln 10 = "
        f"{RANDOM_DIGIT:.2f}. 'Beyond the window': the first mention is outside the model's context."
    )
    if ppl:
        lines[-1] += " Text ppl: validation perplexity per byte on the synthetic text"
        if floors is not None and len(floors):
            named = zip(floors["floor"], floors["val_ppl"], strict=True)
            lines[-1] += "; its n-gram floors: " + ", ".join(f"{f} {v:.2f}" for f, v in named)
        lines[-1] += "."
    return "\n".join(lines) + "\n"


def fact_recall_figure(df: pd.DataFrame):
    """Loss on the digits of restated facts vs distance to their first mention, a line per method (mean and
    std over seeds; first mentions inside the window only), with a random digit's ln 10 and the first
    mentions' own loss as references."""
    rest = df[(df["kind"] == "restated") & df["in_context"]]
    if rest.empty:
        raise ValueError("no restated facts within the models' context")
    bins = sorted(rest["distance"].unique(), key=bin_order)
    x = {b: i for i, b in enumerate(bins)}
    fig, ax = P.plt.subplots(figsize=(7, 4.4), layout="constrained")
    per_seed = rest.groupby(["label", "seed", "distance"], sort=False)["loss"].mean().reset_index()
    for label, g in per_seed.groupby("label", sort=False):
        s = g.groupby("distance")["loss"].agg(["mean", "std"]).reindex(bins).dropna(subset=["mean"])
        P.errorbar(ax, [x[b] for b in s.index], s["mean"], s["std"].fillna(0.0), label)
    ax.axhline(RANDOM_DIGIT, color=P.FLOOR_COLOUR, ls="--", lw=1.1, label="a random digit (ln 10)")
    first = df[df["kind"] == "first mention"]["loss"].mean()
    ax.axhline(first, color=P.FLOOR_COLOUR, ls=":", lw=1.1, label=f"first mentions ({first:.2f}, all models)")
    T = int(df["seq_len"].max())
    ax.set(
        xlabel="bytes back to the fact's first mention",
        ylabel="loss on the code's digits (nats)",
        title=f"Recalling facts from far back, synthetic corpus, context {P.context_label(T)} "
        f"({P.seeds_note(rest.groupby('label')['seed'].nunique())})",
    )
    ax.set_xticks(range(len(bins)), bins)
    if len(bins) == 1:
        ax.set_title(ax.get_title() + "\none distance bin: every fact was restated within it")
    P.legend_below(fig, P.handles_of(ax))
    return fig


# ---- claims ----


def far_fact_loss(df: pd.DataFrame | None) -> pd.DataFrame:
    """Per run: the loss on restated digits whose first mention is >= FAR bytes back and inside the window
    (weighted by count), with the run's method, label and seed."""
    if df is None or df.empty:
        return pd.DataFrame(columns=["method", "label", "seed", "loss"])
    far = df[(df["kind"] == "restated") & df["in_context"].astype(bool)]
    far = far[far["distance"].map(bin_order) >= FAR]
    total = far.assign(w=far["loss"] * far["n"]).groupby(["method", "label", "seed"])[["w", "n"]].sum()
    return (total["w"] / total["n"]).rename("loss").reset_index()


def recalls_far_facts_better(a: str, b: str):
    def judge(r) -> Verdict:
        df = far_fact_loss(r.csv("longrange", "fact_recall.csv"))
        if df.empty:
            return Verdict(MISSING, "no fact-recall measurements")
        label = lambda m: str(df.loc[df["method"] == m, "label"].iloc[0]) if (df["method"] == m).any() else m
        pair = df[df["method"].isin([a, b])]
        v = compare(pair[pair["method"] == a], pair[pair["method"] == b], (label(a), label(b)), "<", None,
                    value="loss")
        status, sentence = v.status, f"loss on facts >= {FAR} bytes back: {v.sentence}"
        if v.status != MISSING and (pair["loss"] >= RANDOM_DIGIT - 0.1).all():  # a floor, as the bigram's
            status = INCONCLUSIVE
            sentence += (f"; neither is below chance (a random digit: ln 10 = {RANDOM_DIGIT:.2f}): neither "
                         "model learned to recall facts at this budget")
        runs = finished_runs(r.csv("longrange"))
        under = undertrained(runs[runs["method"].isin([a, b])], r.floors) if "method" in runs else []
        if v.status != MISSING and under:
            status = UNDERTRAINED
            sentence += f"; {len(under)} of the runs do not beat the 3-gram floor of the text (under-trained)"
        return Verdict(status, sentence, v.numbers)

    return judge


class LongRange(Experiment):
    name = "longrange"
    section = Section(
        "Long range in text-like data: recalling facts from far back",
        "Figures 2 (right) and 14: with matched FLOPs, TTT-Linear and TTT-MLP keep lowering their loss late "
        "in a long context while Mamba plateaus, i.e. they use what they read long ago. Here the same models "
        "are trained at a long context on the synthetic corpus, where a code is predictable only from its "
        "first mention, and the loss on the code's digits is measured by distance to that mention.",
        ["fact_recall.md", "fact_recall.png"],
        ["Long range (synthetic facts)"],
    )

    def configurations(self, profile: str, data_dir: str | None) -> list[Run]:
        """The main models at one long context on the synthetic corpus (its facts are labelled), whatever
        `data_dir` says."""
        p, data = self.sweep["profiles"][profile], self.sweep["data"]
        return [configuration(key, [f"data={data}", *p["overrides"], *m["overrides"]], m["label"], method=key,
                              role=data)
                for key, m in self.sweep["methods"].items()]

    def measure(self, step, trained, ctx) -> None:
        """Each checkpoint's loss on restated facts by distance to their first mention."""
        docs = self.sweep["profiles"][ctx.profile]["docs"]

        def measure(r):
            ckpt = ctx.runs / self.name / r.run / "checkpoints" / "last.ckpt"
            if not ckpt.is_file():
                return None
            return checkpoint_fact_recall(ckpt, docs).assign(method=r.method, label=r.label, seed=r.seed,
                                                             seq_len=r.seq_len)

        reg = trained.registry
        step.per_run("fact_recall.csv", reg[reg["status"] == "finished"], measure)

    def tabulate(self, folder: Path) -> None:
        df = read_csv(folder, "fact_recall.csv")
        if df is None:
            return
        P.save(fact_recall_figure(df), folder / "fact_recall")
        write_atomic(folder / "fact_recall.md",
                     fact_recall_table(df, read_csv(folder, "registry.csv"), read_csv(folder, "floors.csv")))

    @property
    def claims(self) -> list[Claim]:
        return [
            Claim("longrange.ttt_linear", "Long range (synthetic facts)", "TTT-Linear (M) uses facts far "
                  "back in its context better than Mamba (lower loss on them).",
                  recalls_far_facts_better("ttt_linear_m", "mamba")),
            Claim("longrange.ttt_mlp", "Long range (synthetic facts)", "TTT-MLP (M) uses facts far back in "
                  "its context better than Mamba (lower loss on them).",
                  recalls_far_facts_better("ttt_mlp_m", "mamba")),
        ]


EXPERIMENT = LongRange()
