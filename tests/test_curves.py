"""Each run's validation curve is kept with its step folder (curves.csv), a run whose optimisation failed is
flagged in the table rather than averaged in silently, and `plot curves` draws a step folder by
configuration (issue 47, point 3)."""

import math

import pandas as pd
from ttt_bench.cli.main import main

from ttt_bench.experiments.engine.curves import stalled
from ttt_bench.experiments.table1 import table1_markdown

FLOORS = pd.DataFrame({"role": "pile", "corpus": "pile-mini", "seq_len": 128,
                       "floor": ["unigram", "bigram", "3-gram (Witten-Bell)"], "val_ppl": [25.0, 13.0, 7.8]})


def registry() -> pd.DataFrame:
    rows = [("1-linear_attention-s0", "1-linear_attention", 0, 1, 7.5), ("1-linear_attention-s1",
            "1-linear_attention", 1, 1, 7.6), ("transformer-s0", "transformer", 0, None, 21.0),
            ("transformer-s1", "transformer", 1, None, 7.2)]
    return pd.DataFrame([{"run": r, "config": c, "seed": s, "row": row, "val_ppl": v, "status": "finished",
                          "label": c, "role": "pile", "seq_len": 128, "paper_ppl": None}
                         for r, c, s, row, v in rows])


def curves() -> pd.DataFrame:
    """Transformer seed 0 sits on the unigram plateau (above log 25 = 3.22 nats) at mid-training; the others
    fall."""
    out = []
    for run in registry()["run"]:
        for step in (500, 1000, 1500, 2000):
            loss = math.log(26.0) if run == "transformer-s0" else 3.0 - step / 2000
            out.append({"run": run, "step": step, "tokens": step * 1024, "val_loss": loss})
    return pd.DataFrame(out)


def test_a_run_still_on_the_unigram_plateau_at_mid_training_is_stalled():
    assert stalled(registry(), curves(), FLOORS) == ["transformer-s0"]
    assert stalled(registry(), None, FLOORS) == []


def test_table1_stars_a_row_with_a_stalled_run_and_names_it():
    _, md = table1_markdown(registry(), FLOORS, curves())
    assert "*transformer (reference)*\\*" in md
    assert "stalled" in md and "transformer-s0" in md.split("stalled")[-1]
    assert "| 1-linear_attention |" in md  # the other rows unmarked
    assert "stalled" not in table1_markdown(registry(), FLOORS)[1]


def test_plot_curves_draws_a_step_folder_by_configuration(tmp_path, capsys):
    registry().to_csv(tmp_path / "registry.csv", index=False)
    curves().to_csv(tmp_path / "curves.csv", index=False)
    FLOORS.to_csv(tmp_path / "floors.csv", index=False)
    main(["plot", "curves", str(tmp_path), "--out", str(tmp_path / "fig")])
    assert (tmp_path / "fig" / "curves.png").stat().st_size > 10_000
