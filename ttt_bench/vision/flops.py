"""FLOPs of the MTTT ViTs, counted rather than derived: torch's FlopCounterMode over one forward (and
backward) pass on one image, so the inner loop's gradient steps and the second-order backward are included as
they run. Matrix multiplications and attention only (2 FLOPs per multiply-add), like the paper's relative
FLOPs (Tables 1 and 3 report them relative to linear attention)."""

import torch
from torch.utils.flop_counter import FlopCounterMode


def count_flops(model: torch.nn.Module, token_dim: int, num_tokens: int, backward: bool = False) -> int:
    """FLOPs of one image through `model` (forward, or forward + backward of the summed logits)."""
    was_training = model.training
    model.train(backward)
    param = next(model.parameters())
    tokens = torch.zeros(1, num_tokens, token_dim, dtype=param.dtype, device=param.device)
    with FlopCounterMode(display=False) as counter:
        if backward:
            model(tokens).sum().backward()
        else:
            with torch.no_grad():
                model(tokens)
    if backward:
        model.zero_grad(set_to_none=True)
    model.train(was_training)
    return int(counter.get_total_flops())
