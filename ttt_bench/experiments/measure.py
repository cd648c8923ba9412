"""Measurements beyond a training run: Table 1 as Markdown, Figure 8 (right)'s forward time of one TTT layer
split into the W's and the z's, and Figures 5/17's inner losses of a trained TTT model."""

import time
from functools import partial

import pandas as pd
import torch

from ..models.ttt.dual_scan import ttt_linear_dual


def table1(registry: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Table 1 with our perplexity and the paper's, each with its Diff. column (change from the row above)."""
    df = registry.sort_values("row")
    ours = pd.to_numeric(df["val_ppl"], errors="coerce").where(df["status"] == "finished")
    table = pd.DataFrame(
        {
            "Configuration": df["label"].values,
            "Ppl.": ours.round(2).values,
            "Diff.": ours.diff().round(2).values,
            "Paper Ppl.": df["paper_ppl"].values,
            "Paper Diff.": df["paper_ppl"].diff().round(2).values,
            "status": df["status"].values,
        }
    )
    fmt = lambda v, signed=False: "-" if pd.isna(v) else (f"{v:+.2f}" if signed else f"{v:.2f}")
    lines = ["| Configuration | Ppl. | Diff. | Paper Ppl. | Paper Diff. |", "|---|---:|---:|---:|---:|"]
    for _, r in table.iterrows():
        ppl = fmt(r["Ppl."]) if r["status"] == "finished" else r["status"]
        lines.append(
            f"| {r['Configuration']} | {ppl} | {fmt(r['Diff.'], True)} | {fmt(r['Paper Ppl.'])} | "
            f"{fmt(r['Paper Diff.'], True)} |"
        )
    return table, "\n".join(lines) + "\n"


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
