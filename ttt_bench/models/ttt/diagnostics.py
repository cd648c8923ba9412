"""Inner-loop diagnostics of Figures 5 and 17: the TTT loss per layer and position.

    with record_inner_losses(model) as rec:
        for batch in batches:
            model(batch)
    rec.losses()        # {layer_idx: {"w0": [T], "prev": [T], "now": [T]}} numpy arrays
    rec.save(path)      # the same, as an .npz with keys "layer{i}_{w0,prev,now}"

For every token x_t: l(W_0; x_t) (the initial weights theta_init), l(W_{t-1}; x_t) (before the step
that uses x_t) and l(W_t; x_t) (after it), with l of Equation 4; averaged over heads and sequences.
Recording recomputes the inner loop in primal form without gradients, so use it for evaluation only;
calls with a decoding cache are not recorded.
"""

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .layer import TTTLayer

KEYS = ("w0", "prev", "now")


class InnerLossRecorder:
    def __init__(self):
        self.sums: dict[int, torch.Tensor] = {}  # layer -> [T, 3] sums over sequences
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [T] number of sequences

    def add(self, layer_idx: int, losses: torch.Tensor, n_sequences: int) -> None:
        """losses [T, 3]: the mean over n_sequences sequences (and heads) at each position."""
        losses = losses.detach().double().cpu() * n_sequences
        T = losses.shape[0]
        s = self.sums.get(layer_idx, torch.zeros(0, 3, dtype=torch.float64))
        c = self.counts.get(layer_idx, torch.zeros(0, dtype=torch.float64))
        if s.shape[0] < T:  # longer sequences than seen so far: grow
            s = torch.cat([s, s.new_zeros(T - s.shape[0], 3)])
            c = torch.cat([c, c.new_zeros(T - c.shape[0])])
        s[:T] += losses
        c[:T] += n_sequences
        self.sums[layer_idx], self.counts[layer_idx] = s, c

    def losses(self) -> dict[int, dict[str, np.ndarray]]:
        out = {}
        for layer in sorted(self.sums):
            mean = (self.sums[layer] / self.counts[layer].clamp_min(1)[:, None]).numpy()
            out[layer] = {key: mean[:, i] for i, key in enumerate(KEYS)}
        return out

    def save(self, path: str | Path) -> None:
        np.savez(
            path, **{f"layer{layer}_{key}": v for layer, d in self.losses().items() for key, v in d.items()}
        )


def recordable_layers(model: torch.nn.Module) -> list[TTTLayer]:
    """The TTT layers with an inner loss (every learner but the kernel learner of Theorem 2)."""
    return [m for m in model.modules() if isinstance(m, TTTLayer) and m.learner != "kernel"]


@contextmanager
def record_inner_losses(model: torch.nn.Module):
    """Record the inner losses of every parametric TTT layer of `model` while the context is open."""
    rec = InnerLossRecorder()
    layers = recordable_layers(model)
    for m in layers:
        m.diagnostics = rec
    try:
        yield rec
    finally:
        for m in layers:
            m.diagnostics = None
