"""TTT's inner loop as ops (ops.py: `linear`, `mlp`, `step`, `linear_prefill`, each with a `backend`), and
the PyTorch code behind them: the inner models (learner.py), the token-by-token reference (naive.py), the
primal and dual forms (forms.py) and the fast dual form (dual_scan.py); decode.py gives the Triton decode
kernel its backward."""

from .ops import BACKENDS, PREFILL_BACKENDS, STEP_BACKENDS, eta, linear, linear_prefill, mlp, step

__all__ = ["BACKENDS", "PREFILL_BACKENDS", "STEP_BACKENDS", "eta", "linear", "linear_prefill", "mlp", "step"]
