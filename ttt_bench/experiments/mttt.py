"""The MTTT tables (Learning to (Learn at Test Time), 2023; docs/mttt.md): Table 1 (patches,
conf/sweep/mttt_patches.yaml), Table 3 (raw pixels, mttt_pixels.yaml) and Table 2 (ablations,
mttt_ablation.yaml), with the inner loss over the inner steps (Figures 1 right, 3 and 4).

Each table is an experiment: its rows, each its own list of overrides on `task=image` (no ladder); its
table of test accuracy over seeds beside the paper's, parameters and FLOPs relative to the sweep's
`reference` row (FLOPs counted per image by train.py, vision/flops.py); the floors a reviewer asks for
(majority class, a linear classifier on the same pixels); its claims, with the paper's accuracies read from
the sweep's `paper_acc`.
"""

import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra.utils import instantiate
from matplotlib.ticker import MaxNLocator

from ..io import read_table, write_atomic
from .engine import plotting as P
from .engine.experiment import Experiment, Section, read_csv
from .engine.plan import Run, composed, configuration
from .engine.registry import finished_runs
from .engine.stats import difference, mean_sd
from .engine.verdicts import FAILS, HOLDS, MISSING, UNDERTRAINED, Claim, Verdict, compare, status_of

LINEAR_FLOOR = "linear classifier on the pixels"


def image_data_overrides(data_dir: str | None) -> list[str]:
    """Fashion-MNIST under `data_dir`, else the embedded synthetic images."""
    if data_dir is None:
        return ["data=synthetic_images"]
    return ["data=fashion_mnist", f"paths.data_dir={Path(data_dir).resolve()}"]


def mttt_table(reg: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """One row per configuration, in the sweep's order: test accuracy (mean +- sd over seeds, in %), the
    paper's, parameters (M, and relative to the reference row) and forward FLOPs per image relative to it."""
    df = finished_runs(reg)
    order = list(dict.fromkeys(reg["config"])) if reg is not None and "config" in reg else []
    rows = []
    ref_name = (
        reg["reference"].dropna().iloc[0]
        if reg is not None and "reference" in reg and reg["reference"].notna().any()
        else None
    )
    ref = df[df["config"] == ref_name]
    ref_flops = ref["forward_flops_per_image"].mean() if len(ref) else np.nan
    ref_params = ref["params"].mean() if len(ref) else np.nan
    for config in order:
        runs = df[df["config"] == config]
        info = reg[reg["config"] == config].iloc[0]
        acc = runs["test_accuracy"] * 100
        rows.append(
            {
                "config": config,
                "label": info.get("label", config),
                "seeds": len(runs),
                "test_acc": acc.mean() if len(runs) else np.nan,
                "test_acc_sd": acc.std() if len(runs) > 1 else np.nan,
                "acc_text": mean_sd(acc) if len(runs) else "not run",
                "paper_acc": info.get("paper_acc"),
                "params_m": runs["params"].mean() / 1e6 if len(runs) else np.nan,
                "params_rel": runs["params"].mean() / ref_params if len(runs) else np.nan,
                "paper_params_m": info.get("paper_params_m"),
                "flops_rel": runs["forward_flops_per_image"].mean() / ref_flops if len(runs) else np.nan,
                "paper_flops": info.get("paper_flops"),
            }
        )
    table = pd.DataFrame(rows)

    def fmt(v, spec):
        return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else format(v, spec)

    lines = [
        "| drop-in layer | test acc. (%) | paper acc. (%) | params (M) | paper params (M) | FLOPs "
        "| paper FLOPs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        lines.append(
            f"| {r.label} | {r.acc_text} (n={r.seeds}) | {fmt(r.paper_acc, '.1f')} | "
            f"{fmt(r.params_m, '.3f')} | {fmt(r.paper_params_m, '.1f')} | {fmt(r.flops_rel, '.2f')}x | "
            f"{fmt(r.paper_flops, '.1f')}{'' if r.paper_flops is None or pd.isna(r.paper_flops) else 'x'} |"
        )
    return table, "\n".join(lines) + "\n"



def run_inner_losses(r) -> pd.DataFrame | None:
    """A finished run's validation inner losses (layer, step, inner_loss) with its config and seed, from its
    inner_losses.csv; none for a model without an inner loop (attention); None when its folder is not on
    this machine."""
    if not isinstance(getattr(r, "run_dir", None), str):
        return None
    path = Path(r.run_dir) / "inner_losses.csv"
    if not path.is_file():
        return pd.DataFrame() if (Path(r.run_dir) / "metrics.json").is_file() else None
    f = read_table(path, required=("split", "layer", "step", "inner_loss"),
                   numeric=("layer", "step", "inner_loss"), fix="restore it, or train the run again")
    return f[f["split"] == "val"].drop(columns="split").assign(config=r.config, seed=r.seed)


def inner_loss_table(per_run: pd.DataFrame | None) -> pd.DataFrame:
    """Mean validation inner loss per (config, layer, step) over seeds, from the runs' `run_inner_losses`."""
    if per_run is None or per_run.empty:
        return pd.DataFrame(columns=["config", "layer", "step", "inner_loss", "seeds"])
    return per_run.groupby(["config", "layer", "step"], as_index=False).agg(
        inner_loss=("inner_loss", "mean"), seeds=("seed", "nunique")
    )


def image_floors(overrides: list[str]) -> dict[str, float]:
    """Test accuracy (%) of the baselines a reviewer asks for, on a run's own data, resolution and split: the
    training split's majority class, and a linear classifier on the pixels the models see (ridge regression
    onto one-hot labels in closed form, its penalty chosen on the validation split)."""
    dm = instantiate(composed(overrides).data)
    dm.prepare_data()

    def xy(ds):
        x = torch.cat([b["tokens"].flatten(1) for b in ds.batches(4096)]).double()
        return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1), ds.labels

    splits = (dm.train_dataset(), dm.val_dataset(), dm.test_dataset())
    (xtr, ytr), (xva, yva), (xte, yte) = (xy(d) for d in splits)
    gram, target = xtr.T @ xtr, xtr.T @ torch.nn.functional.one_hot(ytr, dm.num_classes).double()
    solve = lambda lam: torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=gram.dtype), target)
    accuracy = lambda w, x, y: 100 * ((x @ w).argmax(1) == y).double().mean().item()
    best = max((10.0**k for k in range(-2, 5)), key=lambda lam: accuracy(solve(lam), xva, yva))
    return {"majority class": 100 * (yte == ytr.mode().values).double().mean().item(),
            LINEAR_FLOOR: accuracy(solve(best), xte, yte)}


def floors_text(floors: dict[str, float], table: pd.DataFrame) -> str:
    """The floors under a table, and the rows that do not beat the linear one (under-trained)."""
    linear = floors[LINEAR_FLOOR]
    below = [r.label for r in table.itertuples() if not r.test_acc > linear]
    text = "Floors on the same images and split: " + ", ".join(f"{k} {v:.1f}%" for k, v in floors.items())
    return text + (f". **Under-trained** (not above the linear floor): {', '.join(below)}.\n" if below else
                   ". Every row is above the linear floor.\n")


def inner_steps_figure(inner: pd.DataFrame, titles: dict | None = None, min_steps: int = 2):
    """Figures 1 right/3/4: mean inner loss against the inner step, one panel per TTT configuration with at
    least `min_steps` inner steps (titled from `titles`: config -> text), one line per layer; None when there
    is nothing to draw."""
    configs = [c for c, g in inner.groupby("config") if g["step"].max() >= min_steps]
    if not configs:
        return None
    fig, axes = P.plt.subplots(1, len(configs), figsize=(4 * len(configs), 3), squeeze=False)
    for ax, config in zip(axes[0], configs, strict=True):
        for layer, g in inner[inner["config"] == config].groupby("layer"):
            ax.plot(g["step"], g["inner_loss"], marker="o", label=f"layer {layer + 1}")
        ax.set_title((titles or {}).get(config, config), fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("t (loss at W_t; last: l(W_T; X))")
        ax.set_ylabel("inner loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---- claims ----


def linear_floor(r, sweep: str) -> float | None:
    """The linear classifier's test accuracy (%) on a sweep's images (image_floors.csv), if measured."""
    floors = r.csv(sweep, "image_floors.csv")
    if floors is None or floors.empty:
        return None
    return float(floors.set_index("floor")["test_acc"].get(LINEAR_FLOOR, np.nan))


def accuracy_claim(sweep: str, a: str, b: str, expect: str, paper: str = "", paper_gap: float | None = None,
                   margin_points: float | None = None):
    """Config a's test accuracy against b's over seeds; `paper_gap`: the paper's difference in points, which
    an inconclusive result whose MDE exceeds it could not have seen (underpowered); `margin_points`: the
    equivalence margin of '=' in points (default: verdicts.EQUIVALENCE_MARGIN of b)."""

    def judge(r) -> Verdict:
        df = finished_runs(r.csv(sweep))
        if df.empty:
            return Verdict(MISSING, f"no finished {sweep} runs")
        df["test_acc_pct"] = df["test_accuracy"] * 100  # in %, as the paper's
        label = lambda c: str(df.loc[df["config"] == c, "label"].iloc[0]) if (df["config"] == c).any() else c
        rows = df[df["config"].isin([a, b])]
        reference = rows.loc[rows["config"] == b, "test_acc_pct"]
        effect = None if paper_gap is None or reference.empty else paper_gap / abs(reference.mean())
        margin = None if margin_points is None or reference.empty else margin_points / abs(reference.mean())
        v = compare(rows[rows["config"] == a], rows[rows["config"] == b], (label(a), label(b)), expect, None,
                    paper=paper, value="test_acc_pct", paper_effect=effect, margin=margin)
        return undertrained_if_below(v, below_linear_floor(r, sweep, rows))

    return judge


def below_linear_floor(r, sweep: str, rows: pd.DataFrame) -> dict[str, list[str]]:
    """The runs among `rows` (of `sweep`) whose test accuracy does not beat the linear classifier on the
    same pixels, keyed by that floor's text: as the language models' 3-gram floor, a verdict that reads one
    is under-trained."""
    floor = linear_floor(r, sweep)
    below = [] if floor is None else rows.loc[rows["test_accuracy"] * 100 <= floor, "run"].tolist()
    return {f"{LINEAR_FLOOR} ({floor:.1f}%)": below} if below else {}


def undertrained_if_below(v: Verdict, below: dict[str, list[str]]) -> Verdict:
    if not below or v.status == MISSING:
        return v
    why = "; ".join(f"{len(runs)} of the runs do not beat the {floor}" for floor, runs in below.items())
    runs = [run for group in below.values() for run in group]
    return Verdict(UNDERTRAINED, f"{v.sentence}; {why}: under-trained", {**v.numbers, "undertrained": runs})


def gap_larger_on_pixels(paper: dict[str, float]):
    """MTTT-MLP's gain over linear attention is larger on pixels than on patches (per-seed gains); `paper`:
    the paper's gain per sweep."""

    def judge(r) -> Verdict:
        gains, below = {}, {}
        for sweep in ("mttt_patches", "mttt_pixels"):
            df = finished_runs(r.csv(sweep))
            mlp = df[df["config"] == "mttt_mlp"].set_index("seed")["test_accuracy"]
            la = df[df["config"] == "linear_attention"].set_index("seed")["test_accuracy"]
            common = mlp.index.intersection(la.index)
            if len(common) == 0:
                return Verdict(MISSING, f"no finished MTTT-MLP and linear-attention pairs in {sweep}")
            gains[sweep] = (mlp[common] - la[common]) * 100
            used = df[df["config"].isin(["mttt_mlp", "linear_attention"]) & df["seed"].isin(common)]
            for floor, runs in below_linear_floor(r, sweep, used).items():
                below.setdefault(floor, []).extend(runs)
        d = difference(gains["mttt_pixels"], gains["mttt_patches"])
        status = status_of(d, ">", 0.0)
        sentence = (
            f"MTTT-MLP minus linear attention: pixels {gains['mttt_pixels'].mean():+.1f} vs patches "
            f"{gains['mttt_patches'].mean():+.1f} points, difference {d.text()} (paper: "
            f"{paper['mttt_pixels']:+.1f} vs {paper['mttt_patches']:+.1f})"
        )
        v = Verdict(status, sentence, {k: v.tolist() for k, v in gains.items()})
        return undertrained_if_below(v, below)

    return judge


def inner_loss_falls(r) -> Verdict:
    """Every layer's mean inner loss falls at every step of MTTT-MLP T = 4 (patches) and SGD T = 4
    (pixels)."""
    checked, bad = [], []
    for sweep, config in (("mttt_patches", "mttt_mlp_t4"), ("mttt_pixels", "mttt_mlp_sgd4")):
        inner = r.csv(sweep, "inner_loss.csv")
        if inner is None or inner.empty:
            continue
        df = inner[inner["config"] == config]
        for layer, g in df.groupby("layer"):
            losses = g.sort_values("step")["inner_loss"].to_numpy()
            checked.append(f"{sweep} layer {layer}")
            if not (np.diff(losses) < 0).all():
                bad.append(f"{sweep} layer {layer}: {np.round(losses, 4).tolist()}")
    if not checked:
        return Verdict(MISSING, "no inner losses of MTTT-MLP with T = 4")
    if bad:
        return Verdict(FAILS, "not monotone in " + "; ".join(bad))
    return Verdict(HOLDS, f"falls at every step in all {len(checked)} layers checked (validation images)")


# ---- the experiments ----


class MTTTTable(Experiment):
    """One MTTT table: `claims_of(experiment)` states its claims (comparisons of its rows, by config name)."""

    paper = "MTTT"

    def __init__(self, name: str, section: Section, comparisons: list[tuple], extra_claims=()):
        self.name, self.section = name, section
        self.comparisons, self.extra_claims = comparisons, list(extra_claims)

    def paper_acc(self, config: str) -> float | None:
        return next((r.get("paper_acc") for r in self.sweep["runs"] if r["name"] == config), None)

    def configurations(self, profile: str, data_dir: str | None) -> list[Run]:
        settings = self.sweep["profiles"][profile]
        base = ["task=image", *image_data_overrides(data_dir), *settings["overrides"]]
        # a profile may run a subset of the rows (smoke: the pipeline, not the table)
        only = settings.get("rows")
        return [configuration(row["name"], base + list(row["overrides"]), row["label"], row=i + 1,
                              role="images", paper_acc=row.get("paper_acc"),
                              paper_params_m=row.get("paper_params_m"), paper_flops=row.get("paper_flops"),
                              reference=self.sweep["reference"])
                for i, row in enumerate(self.sweep["runs"]) if only is None or row["name"] in only]

    def measure(self, step, trained, ctx) -> None:
        """The accuracy floors on the runs' own images, and each run's inner losses."""
        reg = trained.registry
        floors = image_floors(shlex.split(reg["overrides"].iloc[0]))
        step.csv("image_floors.csv", pd.DataFrame([{"floor": k, "test_acc": v} for k, v in floors.items()]))
        step.per_run("inner_losses_per_run.csv", finished_runs(reg), run_inner_losses)

    def tabulate(self, folder: Path) -> None:
        reg = read_csv(folder, "registry.csv")
        if reg is None:
            return
        table, md = mttt_table(reg)
        floors = read_csv(folder, "image_floors.csv")
        if floors is not None:
            md += "\n" + floors_text(dict(zip(floors["floor"], floors["test_acc"], strict=True)), table)
        write_atomic(folder / f"{self.name}_table.csv", table.to_csv(index=False))
        write_atomic(folder / f"{self.name}.md", md)
        inner = inner_loss_table(read_csv(folder, "inner_losses_per_run.csv"))
        write_atomic(folder / "inner_loss.csv", inner.to_csv(index=False))
        runs = finished_runs(reg).drop_duplicates("config").set_index("config")
        titles = {c: f"{r.label}\n{r.data}, {r.num_tokens} tokens of {r.patch_size}x{r.patch_size} pixels "
                  f"({r.image_size}x{r.image_size} images)" for c, r in runs.iterrows()}
        fig = inner_steps_figure(inner, titles)
        if fig is not None:
            fig.savefig(folder / "inner_loss.png", dpi=120)
            P.plt.close(fig)

    def paper_gap(self, a: str, b: str) -> float | None:
        pa, pb = self.paper_acc(a), self.paper_acc(b)
        return None if pa is None or pb is None else abs(pa - pb)

    @property
    def margin_points(self) -> float | None:
        """The table's equivalence margin: half the smallest difference the paper reports among its
        directional claims, in points (None: none known, the default margin)."""
        gaps = [g for _, _, _, a, b, expect in self.comparisons
                if expect != "=" and (g := self.paper_gap(a, b))]
        return min(gaps) / 2 if gaps else None

    @property
    def claims(self) -> list[Claim]:
        out = []
        for claim_id, figure, sentence, a, b, expect in self.comparisons:
            pa, pb = self.paper_acc(a), self.paper_acc(b)
            paper = f" (paper: {pa:.1f} vs {pb:.1f})" if pa is not None and pb is not None else ""
            gap = self.paper_gap(a, b) if expect != "=" else None
            margin = self.margin_points if expect == "=" else None
            out.append(Claim(claim_id, figure, sentence,
                             accuracy_claim(self.name, a, b, expect, paper, gap, margin)))
        return out + [c(self) if callable(c) and not isinstance(c, Claim) else c for c in self.extra_claims]


def _gap_claim(pixels: MTTTTable) -> Claim:
    paper = {e.name: e.paper_acc("mttt_mlp") - e.paper_acc("linear_attention") for e in (PATCHES, pixels)}
    return Claim("mttt.pixels_gap", "MTTT Table 3", "MTTT-MLP's gain over linear attention is larger on "
                 "pixels than on patches.", gap_larger_on_pixels(paper))


PATCHES = MTTTTable(
    "mttt_patches",
    Section(
        "MTTT Table 1 and Figures 1/3: image classification from patches",
        "ImageNet, 16x16 patches (n = 196), ViT-Small: MTTT-Linear matches linear attention with the "
        "identity "
        "map (72.8 vs 73.0), MTTT-MLP beats both (74.6) at 1.5x the FLOPs, self-attention is best (76.5); "
        "more full-batch inner steps help up to T = 4, and the inner loss falls at every step in every "
        "layer.",
        ["mttt_patches.md", "inner_loss.png"],
        ["MTTT Table 1", "MTTT Figure 1", "MTTT Figures 3/4"],
    ),
    [
        ("mttt.linear_equivalence", "MTTT Table 1", "MTTT-Linear matches linear attention with the identity "
         "map (the same function; tests/test_mttt.py checks it exactly).", "mttt_linear",
         "linear_attention_identity", "="),
        ("mttt.mlp_beats_linear_attention", "MTTT Table 1",
         "MTTT-MLP outperforms linear attention (patches).", "mttt_mlp", "linear_attention", ">"),
        ("mttt.self_attention_best", "MTTT Table 1", "Self-attention performs best on patches (it beats "
         "MTTT-MLP).", "self_attention", "mttt_mlp", ">"),
        ("mttt.more_steps", "MTTT Figure 1", "More inner steps help: MTTT-MLP with T = 4 beats T = 1.",
         "mttt_mlp_t4", "mttt_mlp", ">"),
    ],
    [Claim("mttt.inner_loss_falls", "MTTT Figures 3/4", "The inner loss falls at every inner step, in every "
           "layer (full-batch GD on patches, SGD on pixels).", inner_loss_falls)],
)
PIXELS = MTTTTable(
    "mttt_pixels",
    Section(
        "MTTT Table 3 and Figure 4: image classification from raw pixels",
        "ImageNet from 224x224 pixels (n = 50,176), ViT-Tiny: MTTT-MLP 61.9 vs linear attention 53.7 "
        "(identity map 49.9, MTTT-Linear 50.0), and T = 4 steps of inner SGD 65.2 at the same FLOPs; "
        "self-attention does not fit in memory.",
        ["mttt_pixels.md", "inner_loss.png"],
        ["MTTT Table 3"],
    ),
    [
        ("mttt.pixels_mlp_beats_linear", "MTTT Table 3", "On pixels MTTT-MLP outperforms linear attention.",
         "mttt_mlp", "linear_attention", ">"),
        ("mttt.pixels_sgd", "MTTT Table 3", "On pixels, T = 4 steps of inner SGD beat one full-batch step at "
         "the same FLOPs.", "mttt_mlp_sgd4", "mttt_mlp", ">"),
    ],
    [_gap_claim],
)
ABLATION = MTTTTable(
    "mttt_ablation",
    Section(
        "MTTT Table 2: Decoder LN and trained W_0",
        "Both Decoder LN and training W_0 in the outer loop prove important for MTTT-MLP (ImageNet patches; "
        "the table's values are not in the text we have).",
        ["mttt_ablation.md"],
        ["MTTT Table 2"],
    ),
    [
        ("mttt.ablation_ln", "MTTT Table 2", "Decoder LN is important: MTTT-MLP without it is worse.", "full",
         "no_ln", ">"),
        ("mttt.ablation_w0", "MTTT Table 2", "Training W_0 is important: MTTT-MLP with W_0 frozen is worse.",
         "full", "no_w0", ">"),
    ],
)
