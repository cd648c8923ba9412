"""Figures from made-up registries: every figure is written as PNG and PDF and reads as the paper's do (one
style per method, mean ± std over seeds, n-gram floors, y labels, legends outside the axes, b=T)."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from tests.helpers import inner_losses, latency_bench, minibatch_registry, scaling_registry
from ttt_bench.experiments import latency, minibatch, recall, scaling
from ttt_bench.experiments.engine import plotting as P

FLOORS = {
    "pile": {"unigram": 28.1, "bigram": 11.9, "5-gram (Kneser-Ney)": 5.2},
    "books": {"unigram": 24.5, "bigram": 10.3, "5-gram (Kneser-Ney)": 4.1},
}


def _written(paths, pdf: bool = False) -> None:
    assert {p.suffix for p in paths} == ({".png", ".pdf"} if pdf else {".png"})
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)


def _floor_lines(ax) -> list[float]:
    return sorted(ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_color() == P.FLOOR_COLOUR)


def _legend_outside(fig) -> None:
    """The figure's legend lies entirely below or beside every axes (no legend inside a panel)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert fig.legends and all(ax.get_legend() is None for ax in fig.axes)
    for leg in fig.legends:
        box = leg.get_window_extent(r)
        for ax in fig.axes:
            if ax.axison:
                assert not box.overlaps(ax.get_window_extent(r)), ax.get_title()


def test_styles_are_fixed_per_method():
    assert P.method_style("TF pretrain") == P.method_style("Transformer")
    assert P.method_style("Linear attention [41]") == P.method_style("Linear attention")
    assert P.method_style("Some new method") == P.method_style("Some new method")
    colours = {P.method_style(k)[0] for k in P.METHOD_STYLES if k != "TF pretrain"}
    assert len(colours) == len(P.METHOD_STYLES) - 1
    assert set(P.PAPER_NAMES.values()) <= set(P.METHOD_STYLES)


def test_nice_log_ticks_are_few_and_round():
    assert P.nice_log_ticks(3.7e11, 8.9e12) == [5e11, 1e12, 2e12, 5e12]
    assert P.nice_log_ticks(5, 30) == [5, 10, 20]
    narrow = P.nice_log_ticks(15.7, 16.7)
    assert 2 <= len(narrow) <= 7 and all(15.7 <= t <= 16.7 for t in narrow)


def test_aggregate_over_seeds():
    reg = scaling_registry()
    agg = P.aggregate(P.plotted_runs(reg))
    assert (agg["n_seeds"] == 3).all() and (agg["ppl_std"] > 0).all()
    one = P.aggregate(P.plotted_runs(reg.drop(columns=["config", "seed", "corpus"])))
    assert (one["n_seeds"] == 1).all() and len(one) == int((reg["status"] == "finished").sum())
    assert P.seeds_note([3, 3]) == "mean ± std over 3 seeds" and P.seeds_note([1]) == "1 seed"


def test_scaling_and_context(tmp_path):
    reg = scaling_registry()
    fig = scaling.scaling_figure(reg, FLOORS)
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == 3
    for ax in panels:
        assert ax.get_ylabel().startswith("Perplexity (mean ± std over 3 seeds")
        assert ax.get_xscale() == ax.get_yscale() == "log"
        role = "pile" if "pile-mini" in ax.get_title() else "books"
        assert _floor_lines(ax) == sorted(FLOORS[role].values())
        lo, hi = ax.get_ylim()
        assert lo <= min(FLOORS[role].values()) and hi >= max(FLOORS[role].values())
        assert all(t.get_text() for t in ax.get_yticklabels())  # plain numbers, no empty majors
        assert not any(t.get_text() for t in ax.yaxis.get_minorticklabels())
    assert [ax.get_title() for ax in panels] == [
        "pile-mini, context 256",
        "books-mini, context 128",
        "books-mini, context 512",
    ]
    books128 = [c for c in panels[1].containers if c.get_label() == "Transformer"]
    assert len(books128[0].lines[0].get_xdata()) == 3  # xs, s, m; not the matched pretraining
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "Mamba (single point)" in labels and "TTT-Linear (M)" in labels
    assert any("unigram" in lab for lab in labels)
    colours = {}
    for ax in panels:
        for c in ax.containers:
            colours.setdefault(c.get_label().split(" (single")[0], set()).add(c.lines[0].get_color())
    assert all(len(v) == 1 for v in colours.values())
    assert colours["TTT-Linear (M)"] == {P.method_style("TTT-Linear (M)")[0]}
    _legend_outside(fig)
    plt.close(fig)
    _written(P.save(scaling.scaling_figure(reg, FLOORS), tmp_path / "scaling"))
    plt.close(scaling.scaling_figure(reg))  # no floors
    # a panel per context draws its own context's floors (floors.csv has one set per role and context)
    per_context = {("pile", 256): {"bigram": 11.0}, ("books", 128): {"bigram": 10.5},
                   ("books", 512): {"bigram": 9.8}}
    fig = scaling.scaling_figure(reg, panel_floors=per_context)
    assert [_floor_lines(ax) for ax in fig.axes if ax.axison] == [[11.0], [10.5], [9.8]]
    plt.close(fig)

    fig = scaling.context_figure(reg, FLOORS)
    (ax,) = fig.axes
    assert "books-mini" in ax.get_title() and ax.get_ylabel()
    assert _floor_lines(ax) == sorted(FLOORS["books"].values())
    _legend_outside(fig)
    plt.close(fig)
    _written(P.save(scaling.context_figure(reg, FLOORS), tmp_path / "context"))


def test_old_registry_without_seed_columns(tmp_path):
    reg = scaling_registry()
    reg = reg[reg["seed"] == 0].drop(columns=["config", "seed", "corpus"])
    fig = scaling.scaling_figure(reg)
    assert all("corpus not recorded" in ax.get_title() for ax in fig.axes if ax.axison)
    assert all("1 seed" in ax.get_ylabel() for ax in fig.axes if ax.axison)
    plt.close(fig)
    _written(P.save(scaling.context_figure(reg), tmp_path / "context"))


def test_token_index(tmp_path):
    reg = scaling_registry(tmp_path / "sweep")
    curves = scaling.read_token_index(scaling.token_index_runs(reg), tmp_path / "sweep")
    fig = scaling.token_index_figure(reg, curves, floors=FLOORS)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and "mean ± std over 3 seeds" in ax.get_ylabel()
    assert "books-mini, context 512" in ax.get_title()
    names = [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert names == ["Mamba (reference)", "Transformer (depth-matched)", "TTT-Linear (M) (width-matched)"]
    assert len(ax.collections) == 3  # a band per configuration
    assert _floor_lines(ax) == sorted(FLOORS["books"].values())
    plt.close(fig)
    _written(P.save(scaling.token_index_figure(reg, curves, floors=FLOORS), tmp_path / "token_index"))
    with pytest.raises(ValueError):
        scaling.token_index_figure(reg[reg["matched"].isna()], curves)
    with pytest.raises(ValueError):  # matched runs, but none of their curves
        scaling.token_index_figure(reg, curves.iloc[:0])


def test_minibatch(tmp_path):
    reg, timing = minibatch_registry()
    fig = minibatch.minibatch_figure(reg, timing, FLOORS)
    ours, paper, time_ax = fig.axes
    assert [t.get_text() for t in ours.get_xticklabels()][-1] == "b=T"
    assert [t.get_text() for t in time_ax.get_xticklabels()][-1] == "b=T"
    assert ours.get_ylabel() == "Perplexity (mean ± std over 3 seeds)"
    assert paper.get_ylabel() == "Paper perplexity (125M, Llama tokens)"
    assert time_ax.get_ylabel() == "Forward time (ms)" and time_ax.get_yscale() == "log"
    assert not _floor_lines(ours) and not _floor_lines(paper)  # every floor far from perplexities of ~16
    near = {"pile": {"unigram": 28.1, "bigram": 13.0, "3-gram (Witten-Bell)": 9.0, "5-gram": 5.2}}
    near_fig = minibatch.minibatch_figure(reg, timing, near)  # the 3-gram floor decides: always drawn
    assert _floor_lines(near_fig.axes[0]) == [9.0, 13.0]
    plt.close(near_fig)
    assert "pile-mini" in ours.get_title() and "128" in ours.get_title()
    assert len(fig.axes) == 3  # no twin axes
    _legend_outside(fig)
    plt.close(fig)
    _written(P.save(minibatch.minibatch_figure(reg, timing, FLOORS), tmp_path / "minibatch"))
    plt.close(minibatch.minibatch_figure(reg, None))  # no timing, no floors


def test_inner_loss_and_latency(tmp_path):
    fig = minibatch.inner_loss_figure(inner_losses())
    assert all(ax.get_ylabel() for ax in fig.axes if ax.axison) and len(fig.legends) == 1
    _legend_outside(fig)
    plt.close(fig)
    _written(P.save(minibatch.inner_loss_figure(inner_losses()), tmp_path / "inner_loss"))
    fig = latency.latency_figure(latency_bench())
    for ax in fig.axes:
        assert ax.get_ylabel() and [t.get_text() for t in ax.get_xticklabels()] == ["1k", "2k", "4k", "8k"]
    colours = {c.get_label(): c.lines[0].get_color() for ax in fig.axes for c in ax.containers}
    assert colours["TTT-Linear (M)"] == P.method_style("TTT-Linear (M)")[0]
    _legend_outside(fig)
    plt.close(fig)
    _written(P.save(latency.latency_figure(latency_bench()), tmp_path / "latency"))


def test_plot_cli_reads_the_sweeps_floors(tmp_path):
    from ttt_bench.cli import plot

    from ttt_bench.experiments.engine.floors import read_drawn_floors

    sweep = tmp_path / "sweep"
    reg = scaling_registry(sweep)
    reg.to_csv(sweep / "registry.csv", index=False)
    rows = [{"role": role, "corpus": f"{role}-mini", "seq_len": 512, "floor": name, "val_ppl": v}
            for role, floors in FLOORS.items() for name, v in floors.items()]
    pd.DataFrame(rows).to_csv(sweep / "floors.csv", index=False)
    assert read_drawn_floors(sweep)["pile"] == {"bigram": 11.9, "unigram": 28.1}  # the drawn ones
    assert read_drawn_floors(tmp_path) == {}
    assert read_drawn_floors(sweep, by_context=True)[("books", 512)] == {"bigram": 10.3, "unigram": 24.5}
    plot.run(["token-index", str(sweep), "--out", str(tmp_path / "figs"), "--pdf"])  # vector art too
    _written([tmp_path / "figs" / "token_index.png", tmp_path / "figs" / "token_index.pdf"], pdf=True)


def test_recall_panels_per_width_and_the_state_size_frontier(tmp_path):
    rng = np.random.default_rng(0)
    rows = [
        {"run": f"{m}-{w}-{n}-{s}", "status": "finished", "label": label, "width": w, "pairs": n,
         "seq_len": 64, "state_floats": state * w,
         "val_accuracy": float(np.clip(1.2 - n / (w * k) + 0.02 * rng.standard_normal(), 0, 1))}
        for m, label, state, k in (("tf", "Transformer", 512, 1.0), ("mamba", "Mamba", 64, 0.1))
        for w in (32, 64) for n in (4, 8, 16) for s in range(3)
    ]
    reg = pd.DataFrame(rows)
    fig = recall.recall_figure(reg)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["width 32", "width 64", "accuracy vs state size (darker: more pairs)"]
    assert all(ax.get_ylabel() == "answer accuracy" for ax in fig.axes)
    colours = {c.get_label(): c.lines[0].get_color() for c in fig.axes[0].containers}
    assert colours["Mamba"] == P.method_style("Mamba")[0]
    assert "3 seeds" in fig._suptitle.get_text()
    _legend_outside(fig)
    plt.close(fig)
    (tmp_path / "sweep").mkdir()
    reg.to_csv(tmp_path / "sweep" / "registry.csv", index=False)
    from ttt_bench.cli import plot

    plot.run(["recall", str(tmp_path / "sweep"), "--out", str(tmp_path / "figs")])
    _written(list((tmp_path / "figs").iterdir()))  # the PNG alone without --pdf
