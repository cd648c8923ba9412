"""Mamba's selective scan as an op (ops.py: `selective_scan` with a `backend`, `mamba_inner`), and the code
behind it: the sequential reference (scan_ref.py), the chunked PyTorch scan (scan.py) and the C++ CPU kernel
(scan_cpu.py, scan_cpu.cpp)."""

from .ops import BACKENDS, backend_for, mamba_inner, selective_scan, selective_state_update

__all__ = ["BACKENDS", "backend_for", "mamba_inner", "selective_scan", "selective_state_update"]
