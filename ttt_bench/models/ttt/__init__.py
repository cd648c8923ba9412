"""TTT layers (Sun et al., 2024): TTT-Linear and TTT-MLP, primal and dual forms, both backbones."""

from .dual_scan import ttt_linear_dual, ttt_mlp_dual
from .forms import ttt_scan
from .layer import TTTBlock, TTTCache, TTTLayer

__all__ = ["TTTBlock", "TTTCache", "TTTLayer", "ttt_linear_dual", "ttt_mlp_dual", "ttt_scan"]
