"""Mamba baseline: blocks (`block.py`), chunked selective scan (`scan.py`) and its sequential reference."""

from .block import Mamba, MambaBlock, MambaCache
from .scan import selective_scan
from .scan_ref import selective_scan_ref

__all__ = ["Mamba", "MambaBlock", "MambaCache", "selective_scan", "selective_scan_ref"]
