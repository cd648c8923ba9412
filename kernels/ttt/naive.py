"""A naive TTT layer inner loop, token by token (Figure 6), for tests: nothing here is fast.

Each token's gradient is taken by torch.autograd on Equation 4 (with the 1/2 of Appendix A), at the
weights W_{t'} at the end of the previous mini-batch (Section 2.4; mini_batch_size=1 is Figure 6's
online GD, mini_batch_size=T batch GD); the weights then step as Equation 6 and the output is
Equation 5. `create_graph` keeps the outer loop differentiable (gradients of gradients, Section 2.2).
"""

import torch

from . import learner
from .learner import Params


def naive_ttt(params: Params, XQ, XK, XV, lr, token_eta, mini_batch_size: int, ln=None) -> tuple:
    """XQ/XK/XV [B, H, T, f], lr [B, H, T] (the learned inner learning rate of each token), token_eta [b]
    (scaling of the i-th token of a mini-batch), weights [B, H, ...] as in learner.py -> (Z [B, H, T, f], the
    weights after the last complete mini-batch)."""
    T = XQ.shape[2]
    outs = []
    with torch.enable_grad():
        for t in range(T):
            i = t % mini_batch_size
            if i == 0:  # a new mini-batch: gradients are taken at the current weights W_{t'}
                anchor = tuple(
                    p if p is None or p.requires_grad else p.detach().requires_grad_() for p in params
                )
                acc = [None if p is None else torch.zeros_like(p) for p in anchor]
            x_k, x_v = XK[:, :, t : t + 1], XV[:, :, t : t + 1]
            l = 0.5 * learner.loss(anchor, x_k, x_v, ln).sum()  # independent heads and sequences: sum is fine
            wrt = [p for p in anchor if p is not None]
            g = iter(torch.autograd.grad(l, wrt, create_graph=True))
            step = lr[:, :, t, None, None]
            acc = [None if a is None else a + step * next(g) for a in acc]
            # W_t = W_{t'} - token_eta[i] * sum_{s <= t in this mini-batch} lr_s grad l(W_{t'}; x_s)   (Eq. 6)
            W_t = tuple(None if p is None else p - token_eta[i] * a for p, a in zip(anchor, acc, strict=True))
            outs.append(learner.predict(W_t, XQ[:, :, t : t + 1], ln))  # z_t = f(theta_Q x_t; W_t)   (Eq. 5)
            if i == mini_batch_size - 1:
                params = W_t
    return torch.cat(outs, 2), params
