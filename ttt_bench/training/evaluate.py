"""Evaluation: mean validation loss, perplexity, bits per byte, and token-index loss curves."""

import math

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batch_size: int = 8, device=None) -> dict:
    """Loss over every sequence of `dataset` (packed [L+1] token windows).

    Returns mean loss, perplexity and the token-index curve: mean loss at each position t of the
    sequence over all validation sequences (Figures 2 right and 14).
    """
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    per_position = None
    n_seqs = 0
    for start in range(0, len(dataset), batch_size):
        indices = range(start, min(start + batch_size, len(dataset)))
        batch = torch.stack([dataset[i] for i in indices]).to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="none")
        loss = loss.view(batch.shape[0], -1).double().sum(0).cpu()
        per_position = loss if per_position is None else per_position + loss
        n_seqs += batch.shape[0]
    model.train(was_training)
    token_index = (per_position / n_seqs).numpy()
    mean = float(token_index.mean())
    return {"val_loss": mean, "val_ppl": math.exp(min(mean, 50.0)), "val_sequences": n_seqs,
            "val_tokens": n_seqs * len(token_index), "token_index_loss": token_index}


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    return loss / math.log(2) / bytes_per_token


def save_token_index(path, token_index: np.ndarray) -> None:
    from ..io import write_atomic

    rows = "\n".join(f"{t + 1},{v:.6f}" for t, v in enumerate(token_index))
    write_atomic(path, "token_index,loss\n" + rows + "\n")
