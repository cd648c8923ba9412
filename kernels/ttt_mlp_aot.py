"""Ahead-of-time compile of TTT-MLP's dual-form kernels (kernels/ttt_mlp.py) for CUDA targets, without a GPU.

With kernels/aot.py's compile and report (`ptxas_report`: registers per thread, spills, shared memory
against the target's per-block limit), for the TTT-MLP kernels' own signatures and grid.
tests/test_kernel_ttt_mlp.py runs it in a subprocess (not under TRITON_INTERPRET=1, where no @jit function
can be compiled):

    python -m ttt_bench.kernels.ttt_mlp_aot                     # f 16 32 64 x warps 4 8 16 x precisions
    python -m ttt_bench.kernels.ttt_mlp_aot --launch            # the launcher's options only
    python -m ttt_bench.kernels.ttt_mlp_aot --kernel backward   # the backward kernel (default: forward)

forward: as at inference (nothing stored); training: the forward storing every mini-batch's G1, G2 for the
backward (STORE_STATES); backward: the backward kernel.
"""

import argparse
import json

import triton

from . import ttt_mlp
from .aot import SHARED_LIMIT, ptxas_report, report, verdict

WARPS = (4, 8, 16)
_INTS = ("N", "H")  # the kernels' integer arguments; every other non-constexpr one is a pointer
KERNELS = ("forward", "training", "backward")
# the pointers in the inputs' dtype (`dtype`); every other one is float32
_ACTIVATIONS = ("XQ", "XK", "XV", "ETA", "Z", "DZ", "DXQ", "DXK", "DXV", "DETA")


def compile_kernel(arch: int, f: int, precision: str = "tf32", num_warps: int | None = None,
                   num_stages: int | None = None, b: int = ttt_mlp.MINI_BATCHES[0],
                   dtype: str = "fp32", kernel: str = "forward") -> dict:
    """Compile `kernel` (KERNELS) for sm_{arch} at head size f (hidden 4 f), mini-batch b, with the inputs
    (XQ, XK, XV, eta; for the backward also the gradients of Z and of those) of `dtype` and the launch
    options (default: the launcher's). Returns registers per thread, spill stores/loads and stack frame
    (bytes per thread, ptxas), shared memory per program, the target's limit, whether the program id is
    widened to int64, compile seconds, `error` where it fails."""
    backward = kernel == "backward"
    fn = ttt_mlp._mlp_dual_bwd_kernel if backward else ttt_mlp._mlp_dual_fwd_kernel
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("Triton's interpreter is on (TRITON_INTERPRET=1): its kernels cannot be compiled")
    launch = ttt_mlp.launch_options(f, precision, kernel, num_warps)
    if num_stages is not None:
        launch["num_stages"] = num_stages
    constexprs = {"F": f, "M": ttt_mlp.EXPANSION * f, "BS": b, "PRECISION": precision}
    if not backward:
        constexprs["STORE_STATES"] = kernel == "training"
    signature = {a: "constexpr" if a in constexprs else "i32" if a in _INTS
                 else f"*{dtype}" if a in _ACTIVATIONS else "*fp32" for a in fn.arg_names}
    # as at a launch: torch's allocations are 16-byte aligned and Triton specializes pointers on that
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a].startswith("*")}
    record = {"kernel": kernel, "arch": arch, "f": f, "precision": precision, "dtype": dtype,
              "b": b, **launch, "limit": SHARED_LIMIT.get(arch)}
    return {**record, **ptxas_report(fn, signature, constexprs, attrs, arch, launch)}


def table(records: list[dict]) -> str:
    """A markdown table, one row per record."""
    lines = ["| kernel | arch | f | precision | dtype | warps, stages | regs | spill st/ld B | "
             "shared KB (limit) | s | verdict |", "|" + "---|" * 11]
    key = lambda r: (r["kernel"], r["arch"], r["f"], r["precision"], r["dtype"], r["num_warps"])
    for r in sorted(records, key=key):
        launch = f"{r['num_warps']}, {r['num_stages']}"
        head = f"| {r['kernel']} | sm_{r['arch']} | {r['f']} | {r['precision']} | {r['dtype']} | {launch} |"
        if r["error"]:
            lines.append(f"{head} - | - | - | {r['seconds']} | {r['error'][:80]} |")
            continue
        lines.append(f"{head} {r['regs']} | {r['spill_stores']}/{r['spill_loads']} | "
                     f"{r['shared'] / 1024:.1f} ({r['limit'] // 1024}) | {r['seconds']} | {verdict(r)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    p.add_argument("--f", type=int, nargs="+", default=list(ttt_mlp.HEAD_SIZES))
    p.add_argument("--precision", nargs="+", default=list(ttt_mlp.PRECISIONS))
    p.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--dtype", default="fp32", help="of XQ, XK, XV, eta, Z: fp32, bf16 or fp16")
    p.add_argument("--kernel", nargs="+", choices=KERNELS, default=["forward"])
    p.add_argument("--launch", action="store_true", help="only the launcher's options (no --warps grid)")
    p.add_argument("--configs", help="a JSON list of [arch, f, precision, num_warps or null] (the forward's) "
                   "or [kernel, arch, f, precision, num_warps or null] instead")
    p.add_argument("--json", action="store_true", help="one JSON record a line instead of the table")
    args = p.parse_args(argv)
    if args.configs:
        configs = [tuple(c) if len(c) == 5 else ("forward", *c) for c in json.loads(args.configs)]
    else:
        warps = [None] if args.launch else args.warps
        configs = [(k, a, f, pr, w) for k in args.kernel for a in args.arch for f in args.f
                   for pr in args.precision for w in warps]
    report((compile_kernel(arch, f, precision, warps, args.stages, dtype=args.dtype, kernel=kernel)
            for kernel, arch, f, precision, warps in configs), args.json, table)


if __name__ == "__main__":
    main()
