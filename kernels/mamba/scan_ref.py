"""Sequential reference of Mamba's selective scan: one Python step per token (slow, for tests).

Same arguments and layout as `scan.selective_scan`: (batch, length, channels).
"""

import torch
import torch.nn.functional as F


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       initial_state=None, return_last_state=False):
    """h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,  y_t = C_t h_t + D u_t,  y *= silu(z).

    u, delta, z: [b, l, d]; A: [d, n]; B, C: [b, l, n]; D, delta_bias: [d]; initial_state: [b, d, n].
    """
    if delta_bias is not None:
        delta = delta + delta_bias
    if delta_softplus:
        delta = F.softplus(delta)
    b, l, d = u.shape
    h = u.new_zeros(b, d, A.shape[1]) if initial_state is None else initial_state
    ys = []
    for t in range(l):
        decay = torch.exp(delta[:, t, :, None] * A)
        h = decay * h + (delta[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + u * D
    if z is not None:
        y = y * F.silu(z)
    return (y, h) if return_last_state else y
