"""Markdown tables of a registry: each configuration's perplexity over seeds, beside the n-gram floors of the
text it was validated on, rows that do not beat the 3-gram floor marked under-trained."""

import pandas as pd

from .floors import TRAINED_PAST, ngram_floor
from .registry import finished_runs

FLOOR_KEYS = ("role", "seq_len")  # what a floor is of: the validation text (by its role) at a context


def by_config(reg: pd.DataFrame, means: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per configuration (its seeds aggregated), in plan order: its first row's columns, the mean,
    std and number of its finished runs' val_ppl (ppl_mean, ppl_std, seeds), the mean of each column of
    `means`, and where the runs have it the mean bootstrap standard error of their evaluation over documents
    in perplexity (eval_se = ppl x the loss's); runs that did not finish are counted apart (not_finished)."""
    df = reg.copy()
    if "config" not in df:
        df["config"] = df["run"]
    ppl = df["val_ppl"] if "val_ppl" in df else pd.Series(float("nan"), index=df.index)  # none finished
    df["val_ppl"] = pd.to_numeric(ppl, errors="coerce").where(df["status"] == "finished")
    grouped = df.groupby("config", sort=False)
    out = grouped.first()
    out["ppl_mean"], out["ppl_std"] = grouped["val_ppl"].mean(), grouped["val_ppl"].std()
    for col in means:
        out[col] = grouped[col].mean()
    if "val_loss_se" in df:
        df["eval_se"] = df["val_ppl"] * pd.to_numeric(df["val_loss_se"], errors="coerce")
        out["eval_se"] = df.groupby("config", sort=False)["eval_se"].mean()
    out["seeds"] = grouped["val_ppl"].count()
    out["not_finished"] = grouped["status"].apply(lambda s: int((s != "finished").sum()))
    return out.reset_index()


def fmt_ppl(mean: float, std: float, n: int) -> str:
    if n == 0 or pd.isna(mean):
        return "not run yet"
    return f"{mean:.2f}" if n < 2 else f"{mean:.2f} +- {std:.2f}"


def fmt_se(row) -> str:
    """A table cell: the evaluation's standard error over documents (by_config's eval_se), if measured."""
    se = row.get("eval_se")
    return "-" if se is None or pd.isna(se) else f"{se:.2f}"


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
    """" (under-trained)" for a table row whose mean perplexity does not beat its text's 3-gram floor."""
    floor = ngram_floor(floors, row.get("role"), row.get("seq_len"), TRAINED_PAST)
    return " (under-trained)" if floor is not None and row["ppl_mean"] >= floor else ""


def stalled_note(registry: pd.DataFrame, curves: pd.DataFrame | None,
                 floors: pd.DataFrame | None) -> tuple[set, str]:
    """The configurations with a stalled run (curves.py: mid-training validation loss not below the unigram
    floor, a failed optimisation) and the table's footnote naming those runs; ("", set()) when none."""
    from .curves import stalled

    runs = stalled(finished_runs(registry), curves, floors)
    if not runs:
        return set(), ""
    configs = set(registry[registry["run"].isin(runs)]["config"].astype(str))
    return configs, (f"\n\\* a run of the row stalled: its validation loss at mid-training was not below the "
                     f"unigram floor (a failed optimisation, averaged in above; its curve is in curves.csv): "
                     f"{', '.join(runs)}\n")


def summary_table(registry: pd.DataFrame, keys: list[str], floors: pd.DataFrame | None = None) -> str:
    """Any sweep as Markdown: `keys` columns, then perplexity mean +- std over seeds (marked under-trained
    where it does not beat its text's byte 3-gram floor), and the floors."""
    cfg = by_config(registry)
    se = "eval_se" in cfg  # the evaluation's own error beside the seed spread, where measured
    head = "| " + " | ".join(keys) + " | Ppl. (mean +- std) |" + (" eval SE |" if se else "") + " seeds |"
    lines = [head, "|" + "---|" * (len(keys) + 2 + se)]
    for _, r in cfg.iterrows():
        values = " | ".join("" if pd.isna(r.get(k)) else str(r.get(k)) for k in keys)
        mark = undertrained_mark(r, floors)
        ppl = fmt_ppl(r["ppl_mean"], r["ppl_std"], r["seeds"])
        lines.append(f"| {values} | {ppl}{mark} |" + (f" {fmt_se(r)} |" if se else "") + f" {r['seeds']} |")
    lines += floor_rows(floors, keys, 1 + se)
    return "\n".join(lines) + "\n"


def context_label(c) -> str:
    c = int(c)
    return f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else f"{c:,}"
