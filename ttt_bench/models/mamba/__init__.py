"""Mamba baseline: blocks (`block.py`); the selective scan is an op of kernels/ (ttt_bench.kernels.mamba)."""

from .block import Mamba, MambaBlock, MambaCache

__all__ = ["Mamba", "MambaBlock", "MambaCache"]
