"""TTT layers (Sun et al., 2024): TTT-Linear and TTT-MLP in both backbones. Their inner loops, every form
and kernel, are ops in kernels/ (`ttt_bench.kernels.ttt_linear`, `ttt_mlp`)."""

from .layer import TTTBlock, TTTCache, TTTLayer

__all__ = ["TTTBlock", "TTTCache", "TTTLayer"]
