"""The floors a model must beat before its numbers say anything: byte n-gram perplexities of the exact
validation text each run is judged on (ttt_bench/ngram.py), per corpus role and context.

`floors.csv` (role, corpus, seq_len, floor, val_ppl) is written beside every sweep; tables list the floors
and mark the runs that do not beat the 3-gram one (`undertrained`: a model that has not learned its text's
3-gram statistics says nothing about a claim); figures draw DRAWN_FLOORS at each role's longest context,
or at each panel's own (`drawn_floors`).
"""

import json
from pathlib import Path

import pandas as pd

from ...ngram import floors_for

FLOOR_ORDERS = (1, 2, 3, 4, 5)  # every table lists them all
DRAWN_FLOORS = ("unigram", "bigram", "3-gram (Witten-Bell)", "5-gram (Witten-Bell)")  # the figures draw these
TRAINED_PAST = "3-gram"  # the floor every run a verdict uses must beat
COLUMNS = ["role", "corpus", "seq_len", "floor", "val_ppl"]


def text_floors(runs: dict, configs: dict) -> pd.DataFrame:
    """The n-gram floors of every (role, context, validation size) the language-model runs validate on;
    `configs`: run name -> composed config (runs whose config did not compose are left out)."""
    rows, seen = [], set()
    for name, run in runs.items():
        cfg = configs.get(name)
        if cfg is None or "corpus" not in cfg.data:  # not a text (images, MQAR): its experiment's own floors
            continue
        role = run.role or cfg.data.name
        key = (role, int(cfg.data.seq_len), cfg.data.val_tokens)
        if key in seen:
            continue
        seen.add(key)
        for floor, ppl in floors_for(cfg, orders=FLOOR_ORDERS).items():
            rows.append({"role": role, "corpus": run.corpus, "seq_len": key[1], "floor": floor,
                         "val_ppl": ppl})
    return pd.DataFrame(rows, columns=COLUMNS)


def drawn_floors(floors: pd.DataFrame | None, by_context: bool = False) -> dict:
    """role -> {floor: perplexity} of DRAWN_FLOORS at each role's longest context, floors in name order
    (what the figures draw); by_context: (role, context) -> the same at every context (a panel per context
    draws its own)."""
    if floors is None or floors.empty:
        return {}
    if by_context:
        drawn = floors[floors["floor"].isin(DRAWN_FLOORS)]
        return {(r, int(t)): dict(sorted(zip(g["floor"], g["val_ppl"].astype(float), strict=True)))
                for (r, t), g in drawn.groupby(["role", "seq_len"])}
    longest = floors[
        (floors["seq_len"] == floors.groupby("role")["seq_len"].transform("max"))
        & floors["floor"].isin(DRAWN_FLOORS)
    ]
    by_role = {r: dict(zip(g["floor"], g["val_ppl"], strict=True)) for r, g in longest.groupby("role")}
    return json.loads(json.dumps(by_role, sort_keys=True))


def ngram_floor(floors: pd.DataFrame | None, role=None, seq_len=None, kind: str = "bigram") -> float | None:
    """A byte n-gram floor of a validation text (by its role) at a context: `kind` is the floor's name
    without its smoothing ("bigram", "3-gram"); where the floors do not tell texts or contexts apart (no
    such column), the lowest."""
    if floors is None or floors.empty:
        return None
    f = floors[floors["floor"].astype(str).str.split(" ").str[0] == kind]
    if "role" in f:
        f = f[f["role"] == role]
    if "seq_len" in f:
        f = f[f["seq_len"] == (int(seq_len) if pd.notna(seq_len) else None)]
    return float(f["val_ppl"].min()) if len(f) else None


def undertrained(runs: pd.DataFrame, floors: pd.DataFrame | None) -> list[str]:
    """Runs whose validation perplexity does not beat the byte 3-gram floor of their corpus and context."""
    out = []
    for r in runs.itertuples():
        floor = ngram_floor(floors, getattr(r, "role", None), getattr(r, "seq_len", 0) or 0, TRAINED_PAST)
        if floor is not None and r.val_ppl >= floor:
            out.append(r.run)
    return out


def read_drawn_floors(src, by_context: bool = False) -> dict:
    """The floors a sweep folder (or the folder of a registry CSV) holds, as the figures draw them."""
    path = (Path(src) if Path(src).is_dir() else Path(src).parent) / "floors.csv"
    return drawn_floors(pd.read_csv(path), by_context) if path.is_file() else {}
