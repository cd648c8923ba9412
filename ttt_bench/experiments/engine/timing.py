"""When a timing may decide a claim (Figures 3/15, Figure 8's forward time): it was warmed up (the first call
untimed), repeated (the median of at least MIN_REPEATS calls, their spread kept) and taken with no other
work competing for the machine, measured during the timing (bench.common.OtherWork). A timing that misses
one of these, or whose ratio lies within the spread of its repeats, is "inconclusive", said with the
reason; a measurement made before the load was recorded is re-measured, not trusted.

A CPU timing needs the record of the load during it (`loaded_during`); on a GPU, other host work slows a
timing little, so only the repeats are required there."""

import pandas as pd

MIN_REPEATS = 3


def _on_gpu(rows: pd.DataFrame) -> bool:
    return "device" in rows and rows["device"].astype(str).str.startswith("cuda").all()


def _flag(rows: pd.DataFrame, column: str) -> bool:
    return column in rows and rows[column].astype(str).str.lower().eq("true").any()


def doubt(rows: pd.DataFrame) -> str | None:
    """Why these timings cannot decide a claim, or None when they can."""
    if "repeats" not in rows:
        return "its repeats were not recorded (measured before the toolkit did): re-measure"
    repeats = pd.to_numeric(rows["repeats"], errors="coerce")
    if not (repeats >= MIN_REPEATS).all():
        return f"fewer than {MIN_REPEATS} repeats ({repeats.min():.0f} recorded): re-measure"
    if _on_gpu(rows):
        return None
    if "loaded_during" not in rows or rows["loaded_during"].isna().all():
        return "the load during the timing was not recorded (measured before the toolkit did): re-measure"
    if _flag(rows, "loaded_during") or _flag(rows, "under_load"):
        busy = pd.to_numeric(rows.get("busy_cores_during"), errors="coerce").max()
        return f"under load: other work kept up to {busy:.1f} cores busy during the timing"
    return None


def spread(rows: pd.DataFrame, column: str = "spread") -> pd.Series:
    """The repeats' range relative to their median, per row (0 where not recorded)."""
    return pd.to_numeric(rows[column], errors="coerce").fillna(0.0) if column in rows else pd.Series(
        0.0, index=rows.index)


def spread_text(rows: pd.DataFrame) -> str:
    """The largest relative spread of these timings' repeats, for a verdict's sentence."""
    return f"largest spread {spread(rows).max():.0%}" if "spread" in rows else "spread not recorded"


def beyond_spread(ratio: float, spread_a: float, spread_b: float) -> bool:
    """Whether a ratio a/b of two medians differs from 1 by more than the two timings' relative spreads
    together: a difference inside them could be the machine's noise."""
    return abs(ratio - 1.0) > spread_a + spread_b
