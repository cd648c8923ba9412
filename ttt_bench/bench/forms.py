"""`ttt-bench bench forms`: TTT-Linear forward + backward, primal vs dual form (Section 2.5: the dual form
"trains more than 5x faster"): the dual form as it runs in PyTorch (`dual`), with its batched elementwise
work fused by torch.compile (`dual-fused`, the layer's `fused` option), and the fused Triton kernel where the
layer runs it (`triton (tf32)`: on a CUDA GPU where the kernels passed their check, at head sizes and a
mini-batch size they take), and in the core, on a CUDA GPU with fla-core installed, flash-linear-attention's
chunk and fused_chunk TTT-Linear (its variant: a learning rate per token, the residual around Zb; the
parity on what both compute is tests/test_fla_parity.py).

scope=layer times the whole TTTLayer (projections, RoPE, inner loop, post-norm, gate, output projection) in
each form; scope=core times only the inner loop, the op `ttt.linear` (kernels/ttt) in each backend, on
inputs laid out as the layer's.
Each row is labelled by the code it runs: the PyTorch rows pin the layer to PyTorch (`kernel: torch`); the
Triton rows exist where the layer, as it runs by default (`kernel: auto`), says it takes the kernel
(`TTTLayer.dual_kernel`), and call it as the layer does, in the matmul precision the layer chose.
Each call is a training step's fwd+bwd: a dense upstream gradient, and the gradients of the input and the
parameters returned, not accumulated (as after `zero_grad(set_to_none=True)`).
"""

import argparse
import functools
import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from ..config import env
from ..errors import UserError
from . import common

SCOPES = ("layer", "core")
QUICK = {"d_model": 64, "seq_len": 128, "tokens": 256}  # --quick, for the options left at their defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--mini-batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per call: batch = tokens / seq_len")
    parser.add_argument("--scopes", default="layer,core", help="layer, core or both")
    parser.add_argument("--quick", action="store_true",
                        help="d_model 64, 256 tokens of 128, where not given explicitly")
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                        help="also time dual-fused (torch.compile: seconds of compiling before the timing)")
    common.add_device_arguments(parser)


def _layer(args, form: str = "dual", fused: bool = False, kernel: str = "torch"):
    from ttt_bench.models.ttt import TTTLayer

    return TTTLayer(args.d_model, args.n_heads, mini_batch_size=args.mini_batch_size, form=form,
                    share_qk=True, use_gate=True, fused=fused, kernel=kernel)


def _dims(args) -> tuple[int, int, int, int, int]:
    """B, H, N, b, f of the inner loop's inputs."""
    H, b = args.n_heads, args.mini_batch_size
    return args.tokens // args.seq_len, H, args.seq_len // b, b, args.d_model // H


def kernel_precision(args, device, dtype) -> str | None:
    """The matmul precision of the Triton kernel if the layer as it runs by default (`kernel: auto`) takes it
    for the inner loop's inputs on `device` (either scope), else None (PyTorch): asked of the layer itself,
    for activations of `dtype` (the kernel reads them as they are)."""
    layer = _layer(args, kernel="auto").to(device)
    B, H, N, b, f = _dims(args)
    xq = torch.empty(B, H, N * b, f, device=device, dtype=dtype)
    return layer.dual_kernel(xq, layer.initial_params(B)[1], layer.ln())


def _layer_case(args, impl, precision, device, dtype):
    if impl == f"triton ({precision})":  # the layer as it runs by default, which takes the kernel here
        layer = _layer(args, kernel="auto")
    else:  # a PyTorch form
        layer = _layer(args, form=impl.split("-")[0], fused=impl == "dual-fused")
    layer = layer.to(device, dtype)
    x = torch.randn(args.tokens // args.seq_len, args.seq_len, args.d_model, device=device, dtype=dtype,
                    requires_grad=True)
    return _fwd_bwd(lambda: layer(x), [x, *layer.parameters()])


def _core_case(args, impl, precision, device, dtype):
    from ttt_bench.kernels import ttt

    B, H, N, b, f = _dims(args)
    r = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device=device, dtype=dtype)).requires_grad_()

    def view():  # xq, xk, xv [B, H, T, f] laid out [B, T, H, f], as the layer's projections give them
        return torch.randn(B, N * b, H, f, device=device, dtype=dtype).transpose(1, 2).requires_grad_()

    xq, xk, xv = view(), view(), view()
    lr, token_eta = r(B, H, N * b, scale=0.01), r(b)
    params, ln = (r(B, H, f, f, scale=0.02), r(B, H, 1, f, scale=0.02)), (r(H, 1, f), r(H, 1, f))
    backend = "triton" if impl.startswith("triton") else impl.split("-")[0]
    run = lambda: ttt.linear(xq, xk, xv, lr, token_eta, params, ln, backend=backend, precision=precision,
                             fused=impl == "dual-fused")[0]
    return _fwd_bwd(run, [xq, xk, xv, lr, token_eta, *params, *ln])


def fla_version(device) -> str | None:
    """fla-core's version where its TTT-Linear kernels can be timed: installed, on a CUDA device."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from importlib.metadata import version

        import fla.ops.ttt  # noqa: F401

        return version("fla-core")
    except ImportError:
        return None


def _fla_case(args, impl, precision, device, dtype):
    """flash-linear-attention's chunk or fused_chunk TTT-Linear on the core's shapes, token-major [B, T, H, f]
    as fla takes them, a learning rate per token (fla's variant: tests/test_fla_parity.py says where it
    differs from the paper's), LN weight and bias [H, f], initial weights W0, b0."""
    from fla.ops.ttt import chunk_ttt_linear, fused_chunk_ttt_linear

    B, H, N, b, f = _dims(args)
    r = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device=device, dtype=dtype)).requires_grad_()
    eta = (0.01 * torch.rand(B, N * b, H, 1, device=device, dtype=dtype)).requires_grad_()
    inputs = (r(B, N * b, H, f), r(B, N * b, H, f), r(B, N * b, H, f), r(H, f), r(H, f), eta,
              r(B, H, f, f, scale=0.02), r(B, H, 1, f, scale=0.02))
    fn = fused_chunk_ttt_linear if impl.startswith("fla fused_chunk") else chunk_ttt_linear
    return _fwd_bwd(lambda: fn(*inputs[:6], scale=1.0, chunk_size=b, initial_state=inputs[6],
                               initial_state_bias=inputs[7], output_final_state=True)[0], inputs)


def cases(args, scope: str, device, dtype) -> dict[str, Callable[[], Callable]]:
    """{row label: a builder of its fwd+bwd} for one scope: the PyTorch forms, then the Triton kernel where
    the layer takes it, labelled with its precision ("triton (tf32)"); in the core, on a CUDA GPU with
    fla-core installed, flash-linear-attention's two TTT-Linear kernels ("fla chunk (fla-core 0.6.0)")."""
    precision = kernel_precision(args, device, dtype)
    impls = ["primal", "dual"] + ["dual-fused"] * args.fused + [f"triton ({precision})"] * bool(precision)
    case = _layer_case if scope == "layer" else _core_case
    built = {impl: functools.partial(case, args, impl, precision, device, dtype) for impl in impls}
    if scope == "core" and (fla := fla_version(device)):
        for kernel in ("chunk", "fused_chunk"):
            impl = f"fla {kernel} (fla-core {fla})"
            built[impl] = functools.partial(_fla_case, args, impl, precision, device, dtype)
    return built


def _fwd_bwd(forward, inputs):
    """One fwd+bwd: the output's gradient a dense tensor (a `.sum()` would give a stride-0 one, which each
    consumer copies), the inputs' gradients returned rather than accumulated into `.grad`."""
    inputs = [t for t in inputs if t.requires_grad]
    with torch.no_grad():
        dy = torch.randn_like(forward())
    return lambda: torch.autograd.grad(forward(), inputs, dy)


def check(args) -> None:
    """What is timed is what the row says: known scopes, whole sequences, whole mini-batches."""
    if unknown := [s for s in args.scopes.split(",") if s not in SCOPES]:
        raise UserError(f"--scopes {args.scopes}: unknown scope {unknown[0]!r}; use layer, core or "
                        "layer,core")
    T, b, tokens = args.seq_len, args.mini_batch_size, args.tokens
    if tokens < T:
        raise UserError(f"--tokens {tokens} is less than one sequence of --seq-len {T}; use --tokens {T} "
                        "or more")
    if tokens % T:
        raise UserError(f"--tokens {tokens} is not a whole number of sequences of --seq-len {T}; use a "
                        f"multiple, e.g. --tokens {tokens - tokens % T}")
    if T % b:
        raise UserError(f"--mini-batch-size {b} does not divide --seq-len {T} (its last {T % b} tokens would "
                        f"not be timed); use a multiple of {b}, e.g. --seq-len {max(b, T - T % b)}")


def compile_cache() -> Path:
    """Where torch.compile keeps its compiled code (Inductor's and Triton's caches): in the toolkit's cache
    folder ($TTT_BENCH_CACHE, default ~/.cache/ttt-bench), not in $TMPDIR, unless TORCHINDUCTOR_CACHE_DIR
    says otherwise. To take effect it must run before torch._dynamo is imported (importing the models does),
    which sets TORCHINDUCTOR_CACHE_DIR to its own default."""
    root = Path(env("TTT_BENCH_CACHE", str(Path.home() / ".cache" / "ttt-bench")))
    folder = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "torch-compile")))
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    return folder


def run(args) -> pd.DataFrame:
    if args.quick:  # an option given explicitly is kept, and checked
        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        for key, value in QUICK.items():
            if getattr(args, key) == defaults.get_default(key):
                setattr(args, key, value)
    check(args)
    device = common.setup(args)
    dtype = common.DTYPES[args.dtype]
    rows = []
    for scope in args.scopes.split(","):
        fns, mem = {}, {}
        for impl, build in cases(args, scope, device, dtype).items():
            fns[impl] = build()
            if impl == "dual-fused":
                fns[impl]()  # compiles: not part of the form's peak memory
            with common.peak_memory(device) as m:  # untimed: memory, and a first warm-up
                fns[impl]()
            mem[impl] = m["mb"]
        seconds = common.time_interleaved(fns, device, args.warmup, args.repeats)  # round-robin
        for impl in fns:
            rows.append(dict(scope=scope, impl=impl, tokens=args.tokens, seq_len=args.seq_len,
                             d_model=args.d_model, n_heads=args.n_heads, mini_batch_size=args.mini_batch_size,
                             ms_fwd_bwd=1e3 * seconds[impl], tokens_per_s=args.tokens / seconds[impl],
                             peak_mem_mb=mem[impl], device=str(device), dtype=args.dtype,
                             threads=args.threads))
    df = pd.DataFrame(rows)
    for impl in ("primal", "dual"):
        baseline = df[df.impl == impl].set_index("scope").ms_fwd_bwd
        df[f"speedup_vs_{impl}"] = df.scope.map(baseline) / df.ms_fwd_bwd
    return df


def summary(df: pd.DataFrame) -> list[str]:
    return [f"torch.compile cache: {compile_cache()}"] if (df.impl == "dual-fused").any() else []
