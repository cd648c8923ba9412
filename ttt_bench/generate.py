"""Sampling with the model's own decoding cache (KV cache, TTT state, SSM state)."""

import logging

import torch

from .errors import UserError
from .models.graphs import DecodeGraphs

log = logging.getLogger(__name__)


@torch.no_grad()
def sample(
    model,
    prompt_ids: list[int],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    eos_id: int | None = None,
    seed: int = 0,
    graphs: bool | None = None,
) -> list[int]:
    """Prefill the prompt in one pass, then decode one token at a time from the cache; the steps replayed
    from CUDA graphs (`graphs`; None: on a GPU, where the model's caches allow it, models/graphs.py)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[int] = []

    def prefill() -> tuple[list, torch.Tensor]:
        caches = model.init_caches(1, max_len=len(prompt_ids) + max_new_tokens)  # every token it will see
        return caches, model(torch.tensor([prompt_ids + out], device=device), caches)[:, -1:]

    caches, logits = prefill()
    logits = logits[:, -1]
    if graphs is None:
        graphs = device.type == "cuda" and DecodeGraphs.why_not(caches) is None
    graphed = DecodeGraphs(model, caches) if graphs else None

    def step(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal graphed, caches
        if graphed is not None:
            try:
                return graphed(tokens)
            except (RuntimeError, UserError) as e:  # the caches may be half-stepped: prefill them again
                log.warning("decoding eagerly: the CUDA graphs failed (%s)", (str(e).splitlines() or [""])[0])
                graphed = None
                caches, last = prefill()
                return last
        return model(tokens, caches)

    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits.float() / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        token = int(nxt)
        if eos_id is not None and token == eos_id:
            break
        out.append(token)
        logits = step(nxt.view(1, 1))[:, -1]
    return out
