"""TTT layers (Sun et al., 2024): TTT-Linear and TTT-MLP, primal and dual forms, both backbones."""

from .forms import ttt_linear_dual, ttt_scan
from .layer import TTTBlock, TTTCache, TTTLayer

__all__ = ["TTTBlock", "TTTCache", "TTTLayer", "ttt_linear_dual", "ttt_scan"]
