"""The experiments, one module each, on a small shared engine (engine/; docs/architecture.md).

EXPERIMENTS lists them in the order `make reproduce` runs them and the claim table lists their claims;
`reproduce.py`, `ttt-bench ablate` and `ttt-bench plot` find everything through it. Adding an experiment is
a sweep config (conf/sweep/<name>.yaml), a module with an `Experiment` subclass, and a line here.
"""

from . import budgets, curves, latency, longrange, minibatch, mttt, recall, scaling, table1, units
from .engine.experiment import Experiment

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        budgets.EXPERIMENT,  # a row of the claim table across Table 1, Figure 8 and the scaling grid
        units.EXPERIMENT,  # the paper's effects per byte, which the claims read their power against
        table1.EXPERIMENT,
        minibatch.EXPERIMENT,
        scaling.EXPERIMENT,
        latency.EXPERIMENT,
        recall.EXPERIMENT,
        longrange.EXPERIMENT,
        mttt.PATCHES,
        mttt.PIXELS,
        mttt.ABLATION,
        curves.EXPERIMENT,  # no step of its own: `ttt-bench plot curves` of ad-hoc runs
    )
}


def steps() -> list[str]:
    """The experiments that are steps of `make reproduce` (those with a report section), in order."""
    return [name for name, e in EXPERIMENTS.items() if e.section is not None]


def sweeps() -> list[str]:
    """The experiments `ttt-bench ablate` trains (those with a sweep of training runs)."""
    return [name for name, e in EXPERIMENTS.items() if e.trains]


def plots() -> dict:
    """Every figure `ttt-bench plot` draws, by name."""
    return {name: p for e in EXPERIMENTS.values() for name, p in e.plots.items()}
