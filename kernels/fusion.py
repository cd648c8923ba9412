"""Optional fusion of elementwise work by torch.compile: the TTT layer's `fused` option (docs/speed.md)."""

import torch

_compiled = {}


def fuse(fn, fused: bool):
    """fn as it is, or with fused=True compiled by torch.compile (once per function and shape): its
    elementwise passes over whole activations become a few loops. On CPUs such passes are memory-bound, and
    a loop that reads its inputs once saves most of their traffic. fn keeps its outputs' layouts explicit,
    so that both return the same."""
    if not fused:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]
