"""The MTTT experiments as sweeps, tables and claims (docs/mttt.md): conf/sweep/mttt_patches.yaml (the
paper's Table 1), mttt_pixels.yaml (Table 3) and mttt_ablation.yaml (Table 2), and the inner loss over the
steps (Figures 1 right, 3 and 4).

- `plan_mttt`: a sweep's rows, each its own list of overrides on `task=image` (no ladder);
- `mttt_table`: accuracy over seeds beside the paper's, parameters and FLOPs relative to the sweep's
  `reference` row (the paper's linear attention), FLOPs counted per image by train.py (vision/flops.py);
- `inner_loss_table`: the mean inner loss per layer and step of every TTT run (`run_inner_losses`);
- `mttt_claims`: the claims, judged on the registries like the language-model ones (experiments/claims.py).
"""

from pathlib import Path

import numpy as np
import pandas as pd

MTTT_SWEEPS = ("mttt_patches", "mttt_pixels", "mttt_ablation")


def image_data_overrides(data_dir: str | None) -> list[str]:
    """Fashion-MNIST under `data_dir`, else the embedded synthetic images."""
    if data_dir is None:
        return ["data=synthetic_images"]
    return ["data=fashion_mnist", f"paths.data_dir={Path(data_dir).resolve()}"]


def plan_mttt(sweep: dict, profile: str, data_dir: str | None) -> dict:
    from .sweeps import _run

    settings = sweep["profiles"][profile]
    base = ["task=image", *image_data_overrides(data_dir), *settings["overrides"]]
    only = settings.get("rows")  # a profile may run a subset of the rows (smoke: the pipeline, not the table)
    runs = {}
    for i, row in enumerate(sweep["runs"]):
        if only is not None and row["name"] not in only:
            continue
        runs[row["name"]] = _run(
            base + list(row["overrides"]),
            label=row["label"],
            row=i + 1,
            role="images",
            paper_acc=row.get("paper_acc"),
            paper_params_m=row.get("paper_params_m"),
            paper_flops=row.get("paper_flops"),
            reference=sweep["reference"],
        )
    return runs


def _finished(reg: pd.DataFrame | None) -> pd.DataFrame:
    if reg is None or reg.empty or "status" not in reg:
        return pd.DataFrame(columns=["config", "seed", "test_accuracy"])
    df = reg[reg["status"] == "finished"].copy()
    for col in ("test_accuracy", "val_accuracy", "forward_flops_per_image", "non_embedding_params", "params"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def mttt_table(reg: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """One row per configuration, in the sweep's order: test accuracy (mean +- sd over seeds, in %), the
    paper's, parameters (M, and relative to the reference row) and forward FLOPs per image relative to it."""
    from .stats import mean_sd

    df = _finished(reg)
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
    inner_losses.csv; None when its folder is not on this machine."""
    path = Path(str(getattr(r, "run_dir", ""))) / "inner_losses.csv"
    if not path.is_file():
        return None
    f = pd.read_csv(path)
    return f[f["split"] == "val"].drop(columns="split").assign(config=r.config, seed=r.seed)


def inner_loss_table(per_run: pd.DataFrame | None) -> pd.DataFrame:
    """Mean validation inner loss per (config, layer, step) over seeds, from the runs' `run_inner_losses`."""
    if per_run is None or per_run.empty:
        return pd.DataFrame(columns=["config", "layer", "step", "inner_loss", "seeds"])
    return per_run.groupby(["config", "layer", "step"], as_index=False).agg(
        inner_loss=("inner_loss", "mean"), seeds=("seed", "nunique")
    )


# ---- claims (added to experiments/claims.py's CLAIMS) ----


def _accuracy_claim(sweep: str, a: str, b: str, expect: str, paper: str = ""):
    def judge(r):
        from .claims import INCONCLUSIVE, MISSING, Verdict, compare

        reg = (r.mttt or {}).get(sweep) if isinstance(r.mttt, dict) else None
        df = _finished(reg)
        if df.empty:
            return Verdict(MISSING, f"no finished {sweep} runs")
        df["test_acc_pct"] = df["test_accuracy"] * 100  # in %, as the paper's
        label = lambda c: str(df.loc[df["config"] == c, "label"].iloc[0]) if (df["config"] == c).any() else c
        rows = df[df["config"].isin([a, b])]
        v = compare(rows[rows["config"] == a], rows[rows["config"] == b], (label(a), label(b)), expect, None,
                    paper=paper, value="test_acc_pct")
        floor = linear_floor(r, sweep)
        below = [] if floor is None else rows.loc[rows["test_acc_pct"] <= floor, "run"].tolist()
        if below and v.status != MISSING:  # as the language models' bigram floor: under-trained runs
            why = f"{len(below)} of the runs do not beat the linear classifier on the pixels ({floor:.1f}%)"
            v = Verdict(INCONCLUSIVE, f"{v.sentence}; {why}: under-trained",
                        {**v.numbers, "undertrained": below})
        return v

    return judge


def linear_floor(r, sweep: str) -> float | None:
    """The linear classifier's test accuracy (%) on a sweep's images (image_floors.csv), if measured."""
    floors = (r.mttt_floors or {}).get(sweep) if isinstance(r.mttt_floors, dict) else None
    if floors is None or floors.empty:
        return None
    return float(floors.set_index("floor")["test_acc"].get("linear classifier on the pixels", np.nan))


def _gap_larger_on_pixels(r):
    """MTTT-MLP's gain over linear attention is larger on pixels than on patches (per-seed gains)."""
    from .claims import FAILS, HOLDS, INCONCLUSIVE, MISSING, Verdict
    from .stats import difference

    gains = {}
    for sweep in ("mttt_patches", "mttt_pixels"):
        df = _finished((r.mttt or {}).get(sweep) if isinstance(r.mttt, dict) else None)
        mlp = df[df["config"] == "mttt_mlp"].set_index("seed")["test_accuracy"]
        la = df[df["config"] == "linear_attention"].set_index("seed")["test_accuracy"]
        common = mlp.index.intersection(la.index)
        if len(common) == 0:
            return Verdict(MISSING, f"no finished MTTT-MLP and linear-attention pairs in {sweep}")
        gains[sweep] = (mlp[common] - la[common]) * 100
    d = difference(gains["mttt_pixels"], gains["mttt_patches"])
    status = {1: HOLDS, -1: FAILS, 0: INCONCLUSIVE, None: INCONCLUSIVE}[d.sign()]
    sentence = (
        f"MTTT-MLP minus linear attention: pixels {gains['mttt_pixels'].mean():+.1f} vs patches "
        f"{gains['mttt_patches'].mean():+.1f} points, difference {d.text()} (paper: +8.2 vs +1.4)"
    )
    return Verdict(status, sentence, {k: v.tolist() for k, v in gains.items()})


def _inner_loss_falls(r):
    """Every layer's mean inner loss falls at every step of MTTT-MLP T = 4 (patches) and SGD T = 4
    (pixels)."""
    from .claims import FAILS, HOLDS, MISSING, Verdict

    checked, bad = [], []
    for sweep, config in (("mttt_patches", "mttt_mlp_t4"), ("mttt_pixels", "mttt_mlp_sgd4")):
        inner = (r.mttt_inner or {}).get(sweep) if isinstance(r.mttt_inner, dict) else None
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


def mttt_claims(Claim) -> list:
    P, X, A = "mttt_patches", "mttt_pixels", "mttt_ablation"
    return [
        Claim(
            "mttt.linear_equivalence",
            "MTTT Table 1",
            "MTTT-Linear matches linear attention with the "
            "identity map (the same function; tests/test_mttt.py checks it exactly).",
            _accuracy_claim(P, "mttt_linear", "linear_attention_identity", "=", " (paper: 72.8 vs 73.0)"),
        ),
        Claim(
            "mttt.mlp_beats_linear_attention",
            "MTTT Table 1",
            "MTTT-MLP outperforms linear attention (patches).",
            _accuracy_claim(P, "mttt_mlp", "linear_attention", ">", " (paper: 74.6 vs 73.2)"),
        ),
        Claim(
            "mttt.self_attention_best",
            "MTTT Table 1",
            "Self-attention performs best on patches (it beats MTTT-MLP).",
            _accuracy_claim(P, "self_attention", "mttt_mlp", ">", " (paper: 76.5 vs 74.6)"),
        ),
        Claim(
            "mttt.more_steps",
            "MTTT Figure 1",
            "More inner steps help: MTTT-MLP with T = 4 beats T = 1.",
            _accuracy_claim(P, "mttt_mlp_t4", "mttt_mlp", ">"),
        ),
        Claim(
            "mttt.inner_loss_falls",
            "MTTT Figures 3/4",
            "The inner loss falls at every inner step, in "
            "every layer (full-batch GD on patches, SGD on pixels).",
            _inner_loss_falls,
        ),
        Claim(
            "mttt.pixels_mlp_beats_linear",
            "MTTT Table 3",
            "On pixels MTTT-MLP outperforms linear attention.",
            _accuracy_claim(X, "mttt_mlp", "linear_attention", ">", " (paper: 61.9 vs 53.7)"),
        ),
        Claim(
            "mttt.pixels_sgd",
            "MTTT Table 3",
            "On pixels, T = 4 steps of inner SGD beat one full-batch step at the same FLOPs.",
            _accuracy_claim(X, "mttt_mlp_sgd4", "mttt_mlp", ">", " (paper: 65.2 vs 61.9)"),
        ),
        Claim(
            "mttt.pixels_gap",
            "MTTT Table 3",
            "MTTT-MLP's gain over linear attention is larger on pixels than on patches.",
            _gap_larger_on_pixels,
        ),
        Claim(
            "mttt.ablation_ln",
            "MTTT Table 2",
            "Decoder LN is important: MTTT-MLP without it is worse.",
            _accuracy_claim(A, "full", "no_ln", ">"),
        ),
        Claim(
            "mttt.ablation_w0",
            "MTTT Table 2",
            "Training W_0 is important: MTTT-MLP with W_0 frozen is worse.",
            _accuracy_claim(A, "full", "no_w0", ">"),
        ),
    ]


def estimate_image(cfg, cpu_train_flops: float) -> dict:
    """A planned image run's images ("tokens" of the plan), training FLOPs (counted on one image of the
    composed model, forward and backward) and minutes at `cpu_train_flops`."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from ..vision.flops import count_flops

    p = int(cfg.data.patch_size)
    model = instantiate(
        OmegaConf.to_container(cfg.model, resolve=True),
        num_classes=int(cfg.data.get("num_classes", 10)),
        token_dim=p * p,
        num_tokens=int(cfg.data.seq_len),
    )
    images = float(cfg.recipe.total_images)
    flops = count_flops(model, p * p, int(cfg.data.seq_len), backward=True) * images
    return {"tokens": images, "train_flops": flops, "minutes": flops / cpu_train_flops / 60}


# ---- the reproduce steps (reproduce.py: one step per table) ----

MTTT_SECTIONS = {  # step -> (title, what the paper found, files of the step folder, claim sections)
    "mttt_patches": (
        "MTTT Table 1 and Figures 1/3: image classification from patches",
        "ImageNet, 16x16 patches (n = 196), ViT-Small: MTTT-Linear matches linear attention with the "
        "identity "
        "map (72.8 vs 73.0), MTTT-MLP beats both (74.6) at 1.5x the FLOPs, self-attention is best (76.5); "
        "more full-batch inner steps help up to T = 4, and the inner loss falls at every step in every "
        "layer.",
        ["mttt_patches.md", "inner_loss.png"],
        ["MTTT Table 1", "MTTT Figure 1", "MTTT Figures 3/4"],
    ),
    "mttt_pixels": (
        "MTTT Table 3 and Figure 4: image classification from raw pixels",
        "ImageNet from 224x224 pixels (n = 50,176), ViT-Tiny: MTTT-MLP 61.9 vs linear attention 53.7 "
        "(identity map 49.9, MTTT-Linear 50.0), and T = 4 steps of inner SGD 65.2 at the same FLOPs; "
        "self-attention does not fit in memory.",
        ["mttt_pixels.md", "inner_loss.png"],
        ["MTTT Table 3"],
    ),
    "mttt_ablation": (
        "MTTT Table 2: Decoder LN and trained W_0",
        "Both Decoder LN and training W_0 in the outer loop prove important for MTTT-MLP (ImageNet patches; "
        "the table's values are not in the text we have).",
        ["mttt_ablation.md"],
        ["MTTT Table 2"],
    ),
}


def inner_loss_figure(inner: pd.DataFrame, titles: dict | None = None, min_steps: int = 2):
    """Figures 1 right/3/4: mean inner loss against the inner step, one panel per TTT configuration with at
    least `min_steps` inner steps (titled from `titles`: config -> text), one line per layer; None when there
    is nothing to draw."""
    configs = [c for c, g in inner.groupby("config") if g["step"].max() >= min_steps]
    if not configs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 3), squeeze=False)
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


def plot_inner_loss(inner: pd.DataFrame, path: Path, titles: dict | None = None) -> bool:
    """The step's inner-loss PNG (configurations with T > 1); False when there is nothing to draw."""
    fig = inner_loss_figure(inner, titles)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def image_floors(overrides: list[str]) -> dict[str, float]:
    """Test accuracy (%) of the baselines a reviewer asks for, on a run's own data, resolution and split: the
    training split's majority class, and a linear classifier on the pixels the models see (ridge regression
    onto one-hot labels in closed form, its penalty chosen on the validation split)."""
    import torch
    from hydra.utils import instantiate

    from ..config import compose

    dm = instantiate(compose("train", overrides).data)
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
            "linear classifier on the pixels": accuracy(solve(best), xte, yte)}


def floors_text(floors: dict[str, float], table: pd.DataFrame) -> str:
    """The floors under a table, and the rows that do not beat the linear one (under-trained)."""
    linear = floors["linear classifier on the pixels"]
    below = [r.label for r in table.itertuples() if not r.test_acc > linear]
    text = "Floors on the same images and split: " + ", ".join(f"{k} {v:.1f}%" for k, v in floors.items())
    return text + (f". **Under-trained** (not above the linear floor): {', '.join(below)}.\n" if below else
                   ". Every row is above the linear floor.\n")


def step_mttt(name: str, ctx: dict, sweep_step) -> None:
    """One MTTT table as a reproduce step: the sweep, its table beside the paper's and the accuracy floors,
    the inner losses."""
    import shlex

    from ..io import write_atomic

    step, reg = sweep_step(name, ctx)
    table, md = mttt_table(reg)
    floors = image_floors(shlex.split(reg["overrides"].iloc[0]))
    step.csv("image_floors.csv", pd.DataFrame([{"floor": k, "test_acc": v} for k, v in floors.items()]))
    md += "\n" + floors_text(floors, table)
    step.csv(f"{name}_table.csv", table)
    write_atomic(step.dir / f"{name}.md", md)
    inner = inner_loss_table(step.per_run("inner_losses_per_run.csv", _finished(reg), run_inner_losses))
    step.csv("inner_loss.csv", inner)
    runs = _finished(reg).drop_duplicates("config").set_index("config")
    titles = {c: f"{r.label}\n{r.data}, {r.num_tokens} tokens of {r.patch_size}x{r.patch_size} pixels "
              f"({r.image_size}x{r.image_size} images)" for c, r in runs.iterrows()}
    plot_inner_loss(inner, step.dir / "inner_loss.png", titles)
    step.done(reg)
