"""Measurements beyond a training run: Table 1 as Markdown, Figure 8 (right)'s forward time of one TTT layer
split into the W's and the z's, and Figures 5/17's inner losses of a trained TTT model."""

import time
from functools import partial

import pandas as pd
import torch

from ..models.ttt.dual_scan import ttt_linear_dual
from .claims import finished, ngram_floor, undertrained
from .stats import mean_sd


def by_config(reg: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (its seeds aggregated): mean, std and n of val_ppl, in plan order; runs
    that did not finish are counted apart."""
    df = reg.copy()
    if "config" not in df:
        df["config"] = df["run"]
    df["val_ppl"] = pd.to_numeric(df["val_ppl"], errors="coerce").where(df["status"] == "finished")
    grouped = df.groupby("config", sort=False)
    out = grouped.first()
    out["ppl_mean"], out["ppl_std"] = grouped["val_ppl"].mean(), grouped["val_ppl"].std()
    out["seeds"] = grouped["val_ppl"].count()
    out["not_finished"] = grouped["status"].apply(lambda s: int((s != "finished").sum()))
    return out.reset_index()


def fmt_ppl(mean: float, std: float, n: int) -> str:
    if n == 0 or pd.isna(mean):
        return "not run yet"
    return f"{mean:.2f}" if n < 2 else f"{mean:.2f} +- {std:.2f}"


FLOOR_KEYS = ("role", "seq_len")  # what a floor is of: the validation text (by its role) at a context


def floor_rows(floors: pd.DataFrame | None, keys: list[str], trailing: int) -> list[str]:
    """Markdown rows of the n-gram floors (a table's reference lines), one per text, context and order: the
    text and context in the key columns that name them, the floor's name in the `label` (else the last) key
    column, its perplexity in the column after the keys, then `trailing` empty cells."""
    if floors is None or floors.empty:
        return []
    name = keys.index("label") if "label" in keys else len(keys) - 1
    lines = []
    for r in floors.to_dict("records"):
        cells = [str(r[k]) if k in FLOOR_KEYS and k in r else "" for k in keys]
        cells[name] = f"*{r['floor']} floor*"
        lines.append("| " + " | ".join([*cells, f"{r['val_ppl']:.2f}", *[""] * trailing]) + " |")
    return lines


def undertrained_mark(row, floors: pd.DataFrame | None) -> str:
    """" (under-trained)" for a table row whose mean perplexity does not beat its text's bigram floor."""
    bigram = ngram_floor(floors, row.get("role"), row.get("seq_len"))
    return " (under-trained)" if bigram is not None and row["ppl_mean"] >= bigram else ""


def table1(registry: pd.DataFrame, floors: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """Table 1: mean +- std over seeds, the Diff. of the means from the row above, the paper's numbers, and
    the n-gram floors; a row that does not beat the bigram floor is marked under-trained."""
    cfg = by_config(registry)
    rows = cfg[cfg["row"].notna()].sort_values("row")
    refs = cfg[cfg["row"].isna()]
    fmt = lambda v, signed=False: "-" if pd.isna(v) else (f"{v:+.2f}" if signed else f"{v:.2f}")
    diff, paper = rows["ppl_mean"].diff(), pd.to_numeric(rows["paper_ppl"], errors="coerce")
    paper_diff = paper - paper.ffill().shift()  # from the nearest row above that the paper has
    lines = [
        "| Configuration | Ppl. (mean +- std) | Diff. | seeds | Paper Ppl. | Paper Diff. |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (_, r), d, pp, pd_ in zip(rows.iterrows(), diff, paper, paper_diff, strict=True):
        mark = undertrained_mark(r, floors)
        lines.append(
            f"| {r['label']} | {fmt_ppl(r['ppl_mean'], r['ppl_std'], r['seeds'])}{mark} | "
            f"{fmt(d, True)} | {r['seeds']} | {fmt(pp)} | {fmt(pd_, True)} |"
        )
    for _, r in refs.iterrows():
        lines.append(
            f"| *{r['label']} (reference)* | {fmt_ppl(r['ppl_mean'], r['ppl_std'], r['seeds'])} | | "
            f"{r['seeds']} | | |"
        )
    lines += floor_rows(floors, ["label"], 4)
    table = pd.concat([rows, refs])[["config", "label", "ppl_mean", "ppl_std", "seeds", "paper_ppl"]]
    return table, "\n".join(lines) + "\n"


def summary_table(registry: pd.DataFrame, keys: list[str], floors: pd.DataFrame | None = None) -> str:
    """Any sweep as Markdown: `keys` columns, then perplexity mean +- std over seeds (marked under-trained
    where it does not beat its text's byte-bigram floor), and the floors."""
    cfg = by_config(registry)
    head = "| " + " | ".join(keys) + " | Ppl. (mean +- std) | seeds |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for _, r in cfg.iterrows():
        values = " | ".join("" if pd.isna(r.get(k)) else str(r.get(k)) for k in keys)
        mark = undertrained_mark(r, floors)
        ppl = fmt_ppl(r["ppl_mean"], r["ppl_std"], r["seeds"])
        lines.append(f"| {values} | {ppl}{mark} | {r['seeds']} |")
    lines += floor_rows(floors, keys, 1)
    return "\n".join(lines) + "\n"


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.no_grad()
def time_w_and_z(
    mini_batch_sizes: list,
    batch: int,
    heads: int,
    head_dim: int,
    seq_len: int,
    repeats: int = 3,
    seed: int = 0,
) -> pd.DataFrame:
    """Figure 8 (right): forward time of one TTT-Linear layer in dual form at context `seq_len` (the fast
    scan, dual_scan.ttt_linear_dual), total and for the W's at the end of every mini-batch alone (the same
    steps without the outputs); the z's take the difference."""
    g = torch.Generator().manual_seed(seed)
    H, f = heads, head_dim
    ln = (torch.ones(H, 1, f), torch.zeros(H, 1, f))
    W0, b0 = torch.randn(batch, H, f, f, generator=g) * 0.02, torch.zeros(batch, H, 1, f)
    rows = []
    for b in mini_batch_sizes:
        b = seq_len if b == "T" else int(b)
        N = seq_len // b
        XQ, XK, XV = (torch.randn(batch, H, N, b, f, generator=g) for _ in range(3))
        eta = torch.full((batch, H, N, b, b), 1.0 / f)
        both = partial(ttt_linear_dual, XQ, XK, XV, eta, W0, b0, *ln)
        weights_only = partial(both, outputs=False)
        total, weights = _best_time(both, repeats), _best_time(weights_only, repeats)
        rows.append(
            {
                "mini_batch": b,
                "total_ms": 1e3 * total,
                "w_ms": 1e3 * weights,
                "z_ms": 1e3 * max(total - weights, 0.0),
                "seq_len": seq_len,
                "heads": H,
                "head_dim": f,
                "batch": batch,
                "threads": torch.get_num_threads(),
            }
        )
    return pd.DataFrame(rows)


@torch.no_grad()
def inner_losses(ckpt_path: str, max_sequences: int = 16, batch_size: int = 4) -> pd.DataFrame:
    """Figures 5/17 for a checkpoint, on the validation data it was trained with (evaluate.inner_losses)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from ..training.checkpoint import load_checkpoint
    from ..training.evaluate import inner_losses as measure_inner_losses

    module, _ = load_checkpoint(ckpt_path)
    data_cfg = OmegaConf.create(module.hparams["config"]["data"])
    data_cfg.tokenizer = module.hparams["tokenizer"]
    dm = instantiate(data_cfg)
    dm.prepare_data()
    return measure_inner_losses(module.model, dm.val_dataset(), max_sequences, batch_size)


def recall_table(registry: pd.DataFrame, lrs: dict | None = None) -> str:
    """MQAR as Markdown: a row per method and width, a column per number of pairs with the answer accuracy
    (mean +- std over seeds), the recurrent state in floats and the learning rate used."""
    df = registry[registry["status"] == "finished"].copy()
    if df.empty:
        return "No finished recall runs yet.\n"
    df["val_accuracy"] = pd.to_numeric(df["val_accuracy"], errors="coerce")
    pairs = sorted(df["pairs"].unique())
    lines = [
        "| Method | width | state (floats) | lr | " + " | ".join(f"{n} pairs" for n in pairs) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(pairs),
    ]
    for (label, width), g in df.groupby(["label", "width"], sort=False):
        cells = []
        for n in pairs:
            acc = g.loc[g["pairs"] == n, "val_accuracy"]
            cells.append(
                "-"
                if acc.empty
                else (
                    f"{acc.mean():.3f}"
                    if len(acc) < 2
                    else f"{acc.mean():.3f} +- {acc.std():.3f} ({len(acc)})"
                )
            )
        state = g.loc[g["pairs"] == pairs[-1], "state_floats"]
        lines.append(
            f"| {label} | {int(width)} | {int(state.iloc[0]) if len(state) else '-'} | "
            f"{g['lr'].iloc[0]:g} | " + " | ".join(cells) + " |"
        )
    T = int(df["seq_len"].iloc[0])
    lines.append(
        f"\nAnswer accuracy on the validation split (mean +- std (seeds)); {T} tokens per sequence. "
        "Chance: 1 / (number of value tokens); a model that knows which tokens are values but "
        "not which one: 1 / pairs."
    )
    if lrs:
        lines.append(
            "Learning rates chosen on the calibration grid (highest accuracy, then lowest loss): "
            + ", ".join(f"{m} {v:g}" for m, v in lrs.items())
            + "."
        )
    return "\n".join(lines) + "\n"


def fact_recall_table(df: pd.DataFrame, registry: pd.DataFrame | None = None, floors=None) -> str:
    """Loss (nats) on restated facts' digits as Markdown: a row per method, a column per distance bin (first
    mention inside the window; mean +- std over seeds), then beyond the window and the first mentions; with
    the sweep's `registry` and n-gram `floors`, each model's validation perplexity on the text beside them."""
    from .longrange import RANDOM_DIGIT, bin_order

    rest = df[df["kind"] == "restated"]
    inside = rest[rest["in_context"].astype(bool)]
    bins = sorted(inside["distance"].unique(), key=bin_order)

    def cell(rows: pd.DataFrame) -> str:
        if rows.empty:
            return "-"
        per_seed = rows.assign(w=rows["loss"] * rows["n"]).groupby("seed")[["w", "n"]].sum()
        v = per_seed["w"] / per_seed["n"]
        return f"{v.mean():.2f}" if len(v) < 2 else f"{v.mean():.2f} +- {v.std():.2f}"

    runs = finished(registry) if registry is not None else None
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
            cells.append(mean_sd(mine["val_ppl"]) + (f" ({under} under the bigram floor)" if under else ""))
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
