"""Which path TTT-Linear and TTT-MLP take: the Triton kernels (kernels/, installed as ttt_bench.kernels) or
PyTorch.

`use_triton(x, backend)` is the selection. With `kernel: auto` the kernels are used only on a CUDA device
where they have been checked: once per (GPU name, torch version, Triton version), TTT-Linear's dual-form,
prefill and decode kernels and TTT-MLP's forward and decode kernels run on small random inputs and their
outputs (and, for the kernels with a backward, the gradients of every input) are compared with the PyTorch
implementations they replace (dual_scan.ttt_linear_dual, prefill_reference, decode.decode_reference,
dual_scan.ttt_mlp_dual). One verdict covers them all. The
verdict is kept in a small JSON file under the user cache dir (`cache_path`) with the code
(`code_version`) and the NVIDIA driver (`driver_version`) it was checked with: a passing verdict spares
later processes the check until one of them changes; a failed one is only a record, and every new process
checks again (a failure may be transient, or fixed by a new driver, install or kernel). A mismatch or a
kernel that does not compile sends TTT-Linear and TTT-MLP to the PyTorch dual form, with one warning per
process that says why.
`kernel: triton` forces the kernels without this check; `kernel: torch` or TTT_BENCH_KERNELS=torch never uses
them. `precision()` is the matmul precision the layer runs the dual-form kernels (TTT-Linear's, TTT-MLP's)
in (tf32 by default, see PRECISION); the check compares them in both precisions. `log_path_once` says once
which path a shape takes.
"""

import functools
import hashlib
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ... import kernels
from ...io import write_json
from ...kernels import ttt
from ...kernels.ttt import dual_scan
from ...kernels.ttt.decode import decode_reference, ttt_linear_decode, ttt_mlp_decode

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")

# largest |kernel - PyTorch| over the largest |PyTorch| entry, per tensor: float32 with sums of ~100 terms
TOLERANCE = 1e-4
# the same for the tf32 kernel: every matmul input rounded to 10 mantissa bits. Emulated in the interpreter
# (tests/test_kernels.py) the error is <= 1.3e-3 at f = 16 and 64; a broken kernel is off by O(1), and the
# ieee comparison at TOLERANCE still catches small errors of the kernels' own arithmetic
TF32_TOLERANCE = 1e-2
# the prefill kernel on bfloat16 inputs: its matmul operands rounded to 8 bits and its output written in
# bfloat16 (tests/test_kernel_prefill.py: a few 1e-3 at f = 16-64, the interpreter emulating the rounding)
BF16_TOLERANCE = 1.5e-2

# The precision of the dual-form kernel's matmuls when the layer runs it: "tf32" (tensor cores), not "ieee".
# Exact float32 tl.dot is lowered to FMAs that hold whole rows and columns of the operands in every thread:
# at the paper sizes' head size 64 the ieee backward spills 5.5 KB of registers per thread to local memory
# on sm_80 and sm_90 (with 16 warps; 16 KB with 4), the forward 16 bytes on sm_90, while tf32 keeps forward
# and backward in registers on both (tests/test_kernels_aot.py; the table in docs/speed.md). The cost: the
# inner loop's matmul inputs are rounded to 10 mantissa bits (~1e-3 relative error, TF32_TOLERANCE), which
# the PyTorch path does not do. TTT_BENCH_KERNEL_PRECISION=ieee runs exact matmuls, spills and all.
PRECISION = "tf32"
_verdicts: dict[str, dict] = {}  # this process's verdicts, by key


def precision() -> str:
    """The dual-form kernel's matmul precision for the layer: TTT_BENCH_KERNEL_PRECISION, else PRECISION."""
    chosen = os.environ.get("TTT_BENCH_KERNEL_PRECISION") or PRECISION
    if chosen not in ("ieee", "tf32"):
        raise ValueError(f"TTT_BENCH_KERNEL_PRECISION must be ieee or tf32, got {chosen!r}")
    return chosen


_logged: set = set()


@torch.compiler.disable
def log_path_once(what: str, shape: str, reason: str) -> None:
    """Log once per process which path a kernel-eligible call takes: `reason` empty for the Triton kernel,
    else why its inputs are outside the kernel's domain (e.g. head size 96, the 760m size: PyTorch)."""
    if (what, shape, reason) in _logged:
        return
    _logged.add((what, shape, reason))
    name = {"mlp": "TTT-MLP", "mlp_decode": "TTT-MLP decode"}.get(what, f"TTT-Linear {what}")
    if reason:
        log.warning("%s at %s: PyTorch path, outside the Triton kernel's domain: %s", name, shape, reason)
    else:
        log.info("%s at %s: Triton kernel%s", name, shape,
                 f" ({precision()} matmuls)" if what in ("dual", "mlp") else "")


def cache_path() -> Path:
    """$XDG_CACHE_HOME/ttt-bench/kernel_check.json (~/.cache by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ttt-bench" / "kernel_check.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} (Triton interpreter)"


def key(device: torch.device) -> str:
    """What a verdict holds for: the device's name and the torch and Triton versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"{device_name(device)} | torch {torch.__version__} | triton {triton_version}"


@functools.cache
def code_version() -> str:
    """A hash of the code a verdict is about: the Triton kernels, the TTT ops and the PyTorch forms they are
    compared with (kernels/ttt/), and this check (its cases and tolerances)."""
    ops = Path(kernels.__file__).parent
    sources = [*sorted(ops.glob("*.py")), *sorted((ops / "ttt").glob("*.py")), Path(__file__)]
    return hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()[:16]


def driver_version() -> str:
    """The NVIDIA kernel driver's version (/proc/driver/nvidia/version), "none" where there is none."""
    try:
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return "none"
    return found.group(1) if found else "unknown"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _inputs(device, B=1, H=2, N=2, b=16, f=16, seed=0) -> list[torch.Tensor]:
    """Random TTT-Linear dual-form inputs, every weight off its init (as tests/test_kernels.py): xq, xk,
    xv [B, H, T, f] as views of token-major activations, lr [B, H, T], token_eta [b], W, b, the LN."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(device)
    tokens = lambda: r(B, N * b, H, f).transpose(1, 2)
    lr = (0.3 * torch.rand(B, N * b, H, generator=g)).to(device).transpose(1, 2)
    te = (1.0 / torch.arange(1, b + 1) + 0.1 * torch.rand(b, generator=g)).to(device)
    return [tokens(), tokens(), tokens(), lr, te, r(B, H, f, f, scale=0.3), r(B, H, 1, f, scale=0.3),
            r(H, 1, f, scale=0.2, shift=1.0), r(H, 1, f, scale=0.2)]


def _dual_reference(xq, xk, xv, lr, token_eta, W, b, ln_weight, ln_bias):
    """The PyTorch dual form through the op, on float32 (16-bit inputs upcast): Z, W_last, b_last."""
    up = lambda x: x.to(torch.promote_types(x.dtype, torch.float32))
    Z, params = ttt.linear(up(xq), up(xk), up(xv), lr, token_eta, (W, b), (ln_weight, ln_bias),
                           backend="dual")
    return Z, *params


def _mlp_inputs(device, B=1, H=2, N=2, b=16, f=16, seed=0) -> list[torch.Tensor]:
    """Random TTT-MLP dual-form inputs (XQ, XK, XV, eta, W1, b1, W2, b2, ln_weight, ln_bias), every weight off
    its init, the hidden width 4 f, and eta as the layer makes it (token_eta[t] lr[s], token_eta = 1/(t+1),
    lr = sigmoid(.) / f): as tests/test_kernel_ttt_mlp.py."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(device)
    m = 4 * f
    lr = torch.sigmoid(torch.randn(B, H, N, b, generator=g)) / f
    token_eta = 1.0 / torch.arange(1, b + 1, dtype=torch.float32)
    eta = ttt.eta(token_eta, lr).to(device)
    return [r(B, H, N, b, f), r(B, H, N, b, f), r(B, H, N, b, f), eta,
            r(B, H, f, m, scale=f ** -0.5), r(B, H, 1, m, scale=0.3), r(B, H, m, f, scale=m ** -0.5),
            r(B, H, 1, f, scale=0.3), r(H, 1, f, scale=0.2, shift=1.0), r(H, 1, f, scale=0.2)]


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def kernel_errors(kernel, reference, inputs: list[torch.Tensor], seed: int,
                  backward: bool = True) -> dict[str, float]:
    """Outputs of kernel(*inputs) and reference(*inputs), then (`backward`) the gradients of every input
    under the same random cotangents: each tensor's largest error over the reference's largest entry
    ("output 0", "grad 3", ...)."""
    grads, outs = [], []
    g = torch.Generator().manual_seed(seed)
    cotangents = None
    for fn in (kernel, reference):
        leaves = [t.detach().clone().requires_grad_(backward and t.is_floating_point()) for t in inputs]
        with torch.set_grad_enabled(backward):
            out = _flat(fn(*leaves))
        if backward:
            cotangents = cotangents or [torch.randn(o.shape, generator=g).to(o.device) for o in out]
            torch.autograd.backward(out, cotangents)
            grads.append([t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves])
        outs.append([o.detach() for o in out])
    pairs = (("output", outs), ("grad", grads)) if backward else (("output", outs),)
    return {f"{kind} {i}": _rel_err(a, b) for kind, (ours, ref) in pairs
            for i, (a, b) in enumerate(zip(ours, ref, strict=True))}


def _prefill_inputs(dual: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The prefill kernel's inputs from the dual form's: xq, xk, xv token-major [B, T, H, f] in `dtype`, lr
    [B, H, T], the weights of the first sequence, the LN and the token scaling."""
    xq, xk, xv, lr, te, W, b, ln_w, ln_b = dual
    token_major = lambda x: x.transpose(1, 2).to(dtype)
    return [token_major(xq), token_major(xk), token_major(xv), lr, W[0], b[0], ln_w, ln_b, te]


class KernelCase(NamedTuple):
    """A kernel the layer can select, on random inputs, beside the PyTorch reference it replaces."""

    # dual, dual/tf32, dual/bf16 (16-bit activations in tf32, as the layer passes them under autocast),
    # prefill/bf16, prefill/tf32, decode, mlp/ieee, mlp/tf32, mlp_decode
    name: str
    precision: str  # of the kernel's matmul operands
    kernel: Callable
    reference: Callable
    inputs: list
    seed: int  # of the cotangents
    tolerance: float
    backward: bool = True  # False: a forward-only kernel (prefill, mlp), its outputs alone compared


def kernel_cases(device, f: int = 16, seed: int = 0) -> list[KernelCase]:
    """Every kernel the layer can select, on random inputs at head size f: TTT-Linear's dual form in ieee and
    tf32 matmuls, the prefill kernel (forward only; bfloat16 inputs with bf16 matmul operands, float32 ones in
    tf32), and the decode step (one token, gradient sums carried; xq, xk, xv [B, H, 1, f], lr [B, H], te a
    scalar); TTT-MLP's forward kernel in ieee and tf32 matmuls ("mlp/ieee", "mlp/tf32": outputs and final
    weights against dual_scan.ttt_mlp_dual) and its decode step ("mlp_decode", forward), at the head sizes
    they take (kernels/ttt_mlp.HEAD_SIZES: none at f = 128, where TTT-MLP runs PyTorch)."""
    from ...kernels import ttt_linear, ttt_mlp  # need triton; kernels looked up at each check (tests replace)
    from ...kernels.interpreter import emulate_bf16_dot
    from ...kernels.ttt_linear_prefill import prefill_reference, ttt_linear_prefill

    if torch.device(device).type == "cpu":  # Triton's interpreter: its bf16 tl.dot made a GPU's
        emulate_bf16_dot()

    dual = _inputs(device, f=f, seed=seed)
    xq, xk, xv, lr_all, _, W, b, ln_w, ln_b = dual
    tok = lambda t: t[:, :, :1].contiguous()
    lr, te = lr_all[:, :, 0].contiguous(), torch.tensor(0.5, device=device)
    decode = [tok(xq), tok(xk), tok(xv), lr, te, W, b, 0.1 * W, 0.1 * b, ln_w, ln_b]
    tf32 = lambda *args: ttt_linear.ttt_linear_dual(*args, precision="tf32")
    dual_bf16 = [x.bfloat16() for x in dual[:3]] + dual[3:]
    tf32_prefill = lambda *args: ttt_linear_prefill(*args, precision="tf32")
    mlp, in_precision = [], lambda p: lambda *args: ttt_mlp.ttt_mlp_dual(*args, precision=p)
    if f in ttt_mlp.HEAD_SIZES:
        inputs = _mlp_inputs(device, f=f, seed=seed + 4)
        mlp = [KernelCase(f"mlp/{p}", p, in_precision(p), dual_scan.ttt_mlp_dual, inputs, seed + 4, tol)
               for p, tol in (("ieee", TOLERANCE), ("tf32", TF32_TOLERANCE))]
        weights = inputs[4:8]
        one = [t[:, :, 0, :1].contiguous() for t in inputs[:3]]
        one += [lr, te, *weights, *(0.1 * w for w in weights), *inputs[8:]]
        mlp.append(KernelCase("mlp_decode", "ieee", ttt_mlp_decode, decode_reference, one, seed + 5,
                              TOLERANCE, backward=False))
    dual_ieee = ttt_linear.ttt_linear_dual
    return [KernelCase("dual", "ieee", dual_ieee, _dual_reference, dual, seed + 1, TOLERANCE),
            KernelCase("dual/tf32", "tf32", tf32, _dual_reference, dual, seed + 1, TF32_TOLERANCE),
            KernelCase("dual/bf16", "tf32", tf32, _dual_reference, dual_bf16, seed + 1, BF16_TOLERANCE),
            KernelCase("prefill/bf16", "bf16", ttt_linear_prefill, prefill_reference,
                       _prefill_inputs(dual, torch.bfloat16), seed + 3, BF16_TOLERANCE, backward=False),
            KernelCase("prefill/tf32", "tf32", tf32_prefill, prefill_reference,
                       _prefill_inputs(dual, torch.float32), seed + 3, TF32_TOLERANCE, backward=False),
            KernelCase("decode", "ieee", ttt_linear_decode, decode_reference, decode, seed + 2, TOLERANCE),
            *mlp]


# a kernel's family: the part of its case name before "/"
FAMILIES = ("dual", "prefill", "mlp", "decode", "mlp_decode")


def compare_kernels(device: torch.device) -> dict:
    """Run the Triton kernels against PyTorch on `device`: {"ok", "detail", "failed"}, "failed" the kernel
    families (FAMILIES) with a case off its tolerance or that did not compile or run (the error's first
    line in the detail). Each family is judged on its own: a new forward kernel that fails here does not
    take the checked training kernel away."""
    bad, failed = [], set()
    with torch.autocast(device.type, enabled=False), torch.inference_mode(False), torch.enable_grad():
        try:
            cases = kernel_cases(device)
        except Exception as e:  # noqa: BLE001  (the kernels do not import: every family fails)
            lines = str(e).strip().splitlines()
            return {"ok": False, "failed": list(FAMILIES),
                    "detail": f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]}
        for case in cases:
            family = case.name.split("/")[0]
            try:
                errors = kernel_errors(case.kernel, case.reference, case.inputs, case.seed, case.backward)
            except Exception as e:  # noqa: BLE001  (a compile or launch failure is a failed check)
                lines = str(e).strip().splitlines()
                bad.append(f"{case.name}: {type(e).__name__}: {lines[0] if lines else ''}"[:300])
                failed.add(family)
                continue
            off = [f"{case.name} {tensor}: {err:.1e}" for tensor, err in errors.items()
                   if not err <= case.tolerance]  # NaN included
            bad += off
            failed |= {family} if off else set()
    within = f"{TOLERANCE:g} (tf32: {TF32_TOLERANCE:g}, bf16: {BF16_TOLERANCE:g})"
    return {"ok": not failed, "failed": sorted(failed),
            "detail": "; ".join(bad) if bad else f"outputs and gradients within {within}"}


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def verdict(device: torch.device) -> dict:
    """The check's verdict for `device` ({"ok", "detail", "checked", "tolerance", "code", "driver"}): this
    process's, else the cache file's if it passed with this code and driver, else a new check (recorded in
    the file). Warns once per process when the kernels are rejected."""
    k = key(device)
    if k in _verdicts:
        return _verdicts[k]
    path = cache_path()
    stamp = {"code": code_version(), "driver": driver_version()}
    found = _read_cache(path).get(k)
    if not (isinstance(found, dict) and found.get("ok") is True and stamp.items() <= found.items()):
        log.info("checking the Triton TTT kernels against PyTorch on %s (kept in %s)", k, path)
        found = {**compare_kernels(device), "checked": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "tolerance": TOLERANCE, **stamp}
        try:
            write_json(path, {**_read_cache(path), k: found})
        except OSError as e:  # a read-only home: the verdict holds for this process only
            log.warning("could not record the kernel check in %s: %s", path, e)
    if not found["ok"]:
        rejected = ", ".join(found.get("failed") or FAMILIES)
        warnings.warn(f"Triton TTT kernels rejected on {k} ({found['detail']}); the {rejected} kernels give "
                      "way to the PyTorch dual form, the others run. The next process checks again "
                      "(TTT_BENCH_KERNELS=torch skips the check, model.block.kernel=triton forces the "
                      "kernels)", RuntimeWarning, stacklevel=2)
    _verdicts[k] = found
    return found


@torch.compiler.disable
def triton_verified(device: torch.device, family: str = "dual") -> bool:
    """Whether `kernel: auto` may use the Triton kernels of `family` on `device` (see `verdict`; a verdict
    recorded without "failed", by an older check, holds for every family)."""
    found = verdict(device)
    return found["ok"] or family not in found.get("failed", FAMILIES)


def use_triton(x: torch.Tensor, backend: str = "auto", family: str = "dual") -> bool:
    """Whether to run the Triton kernel of `family` (FAMILIES) on x's device. backend: auto (CUDA only,
    unless TTT_BENCH_KERNELS=torch, and only where that family passed its check against PyTorch on this GPU:
    `triton_verified`), torch (never) or triton (always, unchecked; on CPU only under TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if not kernels.HAS_TRITON or backend == "torch":
        return False
    if backend == "triton":
        return True
    if not x.is_cuda or os.environ.get("TTT_BENCH_KERNELS", "auto") == "torch":
        return False
    return triton_verified(x.device, family)
