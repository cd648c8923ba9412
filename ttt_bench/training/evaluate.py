"""Evaluation: mean validation loss, perplexity, bits per byte, and token-index loss curves."""

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batch_size: int = 8, device=None) -> dict:
    """Loss over every sequence of `dataset` (packed [L+1] token windows).

    Returns mean loss, perplexity and the token-index curve: mean loss at each position t of the
    sequence over all validation sequences (Figures 2 right and 14). A dataset with a `loss_mask(i)` ([L]
    booleans, e.g. MQAR's answer positions) counts the masked positions only, and adds `val_accuracy`
    (argmax == target); positions no sequence counts are NaN in the curve. A dataset with `documents` (the
    document of each sequence) adds the bootstrap standard error of the loss over documents (`val_loss_se`).
    """
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    mask_of = getattr(dataset, "loss_mask", None)
    loss_sum = count = correct = None
    n_seqs, per_sequence = 0, []
    for start in range(0, len(dataset), batch_size):
        indices = range(start, min(start + batch_size, len(dataset)))
        batch = torch.stack([dataset[i] for i in indices]).to(device)
        logits = model(batch[:, :-1]).float()
        targets = batch[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
        mask = (torch.stack([mask_of(i) for i in indices]).to(device).bool() if mask_of
                else torch.ones_like(targets, dtype=torch.bool))
        hits = (logits.argmax(-1) == targets) & mask
        parts = ((loss.double() * mask).sum(0).cpu(), mask.sum(0).double().cpu(), hits.sum(0).double().cpu())
        loss_sum, count, correct = parts if loss_sum is None else (
            loss_sum + parts[0], count + parts[1], correct + parts[2])
        n_seqs += batch.shape[0]
        per_sequence.append(torch.stack([(loss.double() * mask).sum(1), mask.sum(1).double()], 1).cpu())
    model.train(was_training)
    token_index = (loss_sum / count).numpy()  # NaN where no sequence counts the position
    mean = float(loss_sum.sum() / count.sum().clamp_min(1))
    result = {
        "val_loss": mean,
        "val_ppl": math.exp(min(mean, 50.0)),
        "val_sequences": n_seqs,
        "val_tokens": int(count.sum()),
        "token_index_loss": token_index,
    }
    documents = getattr(dataset, "documents", None)
    if documents is not None:
        result["val_loss_se"] = document_bootstrap_se(torch.cat(per_sequence).numpy(), documents)
    if mask_of:
        result["val_accuracy"] = float(correct.sum() / count.sum().clamp_min(1))
    return result


def document_bootstrap_se(sums: np.ndarray, documents: np.ndarray, resamples: int = 2000) -> float:
    """Standard error of the mean loss (summed loss / counted tokens, `sums` [n, 2] per sequence) when the
    validation documents are resampled with replacement (scipy's bootstrap, paired over the two sums): how
    much the number would move on another draw of documents like these. NaN with one document."""
    ids, doc = np.unique(documents, return_inverse=True)
    if len(ids) < 2:
        return float("nan")
    loss, tokens = (np.bincount(doc, weights=sums[:, k], minlength=len(ids)) for k in (0, 1))
    boot = stats.bootstrap((loss, tokens), lambda a, b, axis=-1: a.sum(axis) / b.sum(axis), paired=True,
                           vectorized=True, n_resamples=resamples, method="percentile",
                           rng=np.random.default_rng(0))
    return float(boot.standard_error)


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    return loss / math.log(2) / bytes_per_token


def save_token_index(path, token_index: np.ndarray) -> None:
    from ..io import write_atomic

    rows = "\n".join(f"{t + 1},{v:.6f}" for t, v in enumerate(token_index))
    write_atomic(path, "token_index,loss\n" + rows + "\n")


def save_inner_losses(path, table) -> None:
    """inner_losses.csv (layer, position, w0, prev, now) beside the run, for `ttt-bench plot inner-loss`."""
    from ..io import write_atomic

    if table is not None:
        write_atomic(path, table.to_csv(index=False))


@torch.no_grad()
def inner_losses(model: torch.nn.Module, dataset, max_sequences: int = 16, batch_size: int = 4):
    """Figures 5/17: l(W_0; x_t), l(W_{t-1}; x_t), l(W_t; x_t) per TTT layer and position t, averaged over
    the first `max_sequences` sequences of `dataset`; None for a model without parametric TTT layers."""
    import pandas as pd

    from ..models.ttt.diagnostics import record_inner_losses, recordable_layers

    if not recordable_layers(model):
        return None
    was_training = model.training
    model.eval()
    n, device = min(max_sequences, len(dataset)), next(model.parameters()).device
    with record_inner_losses(model) as rec:
        for start in range(0, n, batch_size):
            batch = torch.stack([dataset[i] for i in range(start, min(start + batch_size, n))])
            model(batch[:, :-1].to(device))
    model.train(was_training)
    losses = rec.losses()
    rows = [
        pd.DataFrame({"layer": layer, "position": range(1, len(d["w0"]) + 1), **d})
        for layer, d in losses.items()
    ]
    return pd.concat(rows, ignore_index=True)


@torch.no_grad()
def evaluate_classifier(model: torch.nn.Module, dataset, batch_size: int = 64, split: str = "val",
                        device=None) -> tuple[dict, list[dict]]:
    """Cross-entropy and accuracy of an image classifier over a split (an `ImageTokens`), and for TTT layers
    the mean inner losses over its images: rows {split, layer, step, inner_loss} (MTTT's Figures 1/3/4)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    loss_sum = correct = 0.0
    count = 0
    inner_sum = None
    for batch in dataset.batches(batch_size):
        tokens, labels = batch["tokens"].to(device), batch["label"].to(device)
        logits = model(tokens).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        inner = model.inner_losses() if hasattr(model, "inner_losses") else None
        if inner is not None:
            inner = inner.double().cpu() * len(labels)
            inner_sum = inner if inner_sum is None else inner_sum + inner
        count += len(labels)
    model.train(was_training)
    result = {f"{split}_loss": loss_sum / max(count, 1), f"{split}_accuracy": correct / max(count, 1),
              f"{split}_images": count}
    rows = [] if inner_sum is None else [
        {"split": split, "layer": layer, "step": t, "inner_loss": float(v) / count}
        for layer, values in enumerate(inner_sum) for t, v in enumerate(values)]
    return result, rows


def evaluate_splits(model: torch.nn.Module, dm, batch_size: int, out_dir) -> dict:
    """An image classifier on the validation and the held-out test split: their losses and accuracies, and
    for TTT layers the inner losses per layer and step written to out_dir/inner_losses.csv."""
    val, val_rows = evaluate_classifier(model, dm.val_dataset(), batch_size, "val")
    test, test_rows = evaluate_classifier(model, dm.test_dataset(), batch_size, "test")
    if val_rows:
        import pandas as pd

        save_inner_losses(Path(out_dir) / "inner_losses.csv", pd.DataFrame(val_rows + test_rows))
    return {**val, **test}
