"""Ahead-of-time compile of the TTT-Linear Triton kernels for a CUDA target, on a machine without a GPU.

`triton.compile` of an `ASTSource` for `GPUTarget("cuda", arch, 32)` runs the whole GPU pipeline (Triton IR,
LLVM, PTX, then NVIDIA's ptxas, shipped with Triton) and needs no GPU, so it checks what the CPU interpreter
(TRITON_INTERPRET=1) never does: that the kernels compile at all, how much shared memory a program needs
(`metadata.shared`, against the target's per-block limit) and, from ptxas's own report, the registers per
thread and the bytes spilled to local memory. tests/test_kernels_aot.py runs it; docs/speed.md has the table:

    python -m ttt_bench.kernels.aot            # every kernel x head size x precision, sm_80 and sm_90

The kernels are compiled with the launch options their launchers use (`ttt_linear.launch_options`,
`ttt_decode.launch_options`); the prefill kernel (kernels/ttt_linear_prefill.py) with bf16 inputs and
matmul operands at each candidate num_warps of `ttt_linear_prefill.WARPS` (1, 2, 4) and at its launcher's,
with float32 inputs (tf32) at its launcher's, its launcher's stages throughout; the table marks a launcher's
default launch with a *. Each record also says how many programs of that launch fit an SM
(`blocks_per_sm`, from the registers, warps and shared memory) and so in how many waves the 512 (sequence,
head) programs of the 1.3b model at batch 16 run on the target's SMs.

Not under TRITON_INTERPRET=1: Triton then decorates every @jit function, its own standard library included,
for the interpreter, and none of them can be compiled (the tests, which set it, compile in a subprocess:
`--configs`).
"""

import argparse
import contextlib
import io
import json
import re
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import ttt_decode, ttt_linear, ttt_linear_prefill

# shared memory a block may use (bytes; cudaDevAttrMaxSharedMemoryPerBlockOptin): A100 (sm_80) 163 KB,
# H100 (sm_90) 227 KB
SHARED_LIMIT = {80: 166912, 90: 232448}
# per SM: shared memory (bytes, of which 1 KB reserved per block), registers (a quarter per sub-partition,
# allocated per warp in units of 256), warps, blocks; and the SMs of the GPU (A100; H100 SXM and H200)
SHARED_PER_SM = {80: 167936, 90: 233472}
REGS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
SMS = {80: 108, 90: 132}
PROGRAMS_1_3B = 16 * 32  # (sequence, head) programs of the 1.3b model (32 heads of 64) at batch 16
HEAD_SIZES = ttt_linear.HEAD_SIZES
# forward: as in training (the weights of every mini-batch stored for the backward); inference: the forward
# without them (no gradient needed: evaluation, prefill); prefill: the forward-only kernel of
# ttt_linear_prefill.py (bf16 token-major inputs, few warps)
KERNELS = ("forward", "inference", "backward", "decode", "prefill")
# its matmul operands in the default grid: bf16 (bf16 inputs, the models' dtype) at every candidate num_warps,
# tf32 (float32 inputs) at its launcher's
PREFILL_PRECISIONS = ("bf16", "tf32")
MINI_BATCH = ttt_linear.MINI_BATCHES[0]  # b = 16: the mini-batch size of every paper configuration

# kernel -> (module attribute, the integer arguments; every other non-constexpr argument is an fp32 pointer)


def _stride_args(*names: str) -> tuple:
    """The (batch, head, token) stride arguments of the kernels' tensors named `names`."""
    return tuple(f"{n}_{d}" for n in names for d in "bht")


_KERNELS = {
    "forward": ("ttt_linear", "_dual_fwd_kernel", ("N", "H", *_stride_args("sq", "sk", "sv", "sz", "sl"))),
    "inference": ("ttt_linear", "_dual_fwd_kernel", ("N", "H", *_stride_args("sq", "sk", "sv", "sz", "sl"))),
    "backward": ("ttt_linear", "_dual_bwd_kernel",
                 ("N", "H", *_stride_args("sq", "sl", "sdx"))),
    "decode": ("ttt_decode", "_decode_kernel", ("H",)),
    "prefill": ("ttt_linear_prefill", "_prefill_kernel", (
        "T", "H", "sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "sz_b", "sz_t",
        "sz_h", "sl_b", "sl_h", "sl_t", "sw_b", "sw_h", "sb_b", "sb_h")),
}
_MODULES = {"ttt_linear": ttt_linear, "ttt_decode": ttt_decode, "ttt_linear_prefill": ttt_linear_prefill}
# the prefill kernel's activations (pointers in the inputs' dtype) by matmul precision, and its strides that
# are multiples of 16 elements at every head size when q, k, v and z are [B, T, H, f] tensors (at a launch
# Triton specializes on it: 16-byte loads); lr's strides ([B, H, T] viewed from [B, T, H]) vary
_PREFILL_ACTIVATIONS = ("XQ", "XK", "XV", "Z")
_PREFILL_DTYPE = {"bf16": "*bf16", "fp16": "*fp16", "tf32": "*fp32", "ieee": "*fp32"}
_PREFILL_ALIGNED = ("sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "sz_b", "sz_t",
                    "sz_h", "sw_b", "sw_h", "sb_b", "sb_h")
# the chunk kernels' activations (pointers in the activations' dtype: bf16 under autocast, with tf32 matmuls,
# the layer's training default on CUDA; float32 with ieee) and their strides, multiples of 16 elements for
# [B, T, H, f] tensors at every head size (lr's, [B, H, T] viewed from [B, T, H], vary)
_DUAL_ACTIVATIONS = {"forward": ("XQ", "XK", "XV", "Z"), "inference": ("XQ", "XK", "XV", "Z"),
                     "backward": ("XQ", "XK", "XV", "DZ", "DXQ", "DXK", "DXV")}
_DUAL_DTYPE = {"tf32": "*bf16", "ieee": "*fp32"}
_DUAL_ALIGNED = _stride_args("sq", "sk", "sv", "sz", "sdx")
_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def options(kernel: str, f: int, precision: str) -> dict:
    """The launch options (num_warps, num_stages) the launcher uses for `kernel` at head size f."""
    if kernel == "decode":
        return ttt_decode.launch_options(f)
    if kernel == "prefill":
        return ttt_linear_prefill.launch_options(f, precision)
    return ttt_linear.launch_options(f, precision, backward=kernel == "backward")


def blocks_per_sm(arch: int, regs: int, warps: int, shared: int) -> int:
    """How many programs (blocks) of `warps` warps, `regs` registers a thread and `shared` bytes of shared
    memory fit one SM of sm_{arch} at once (the CUDA occupancy rules; 0 where not even one does)."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 4 * ((REGS_PER_SM // 4) // regs_per_warp) // warps  # a quarter of the file per sub-partition
    by_shared = SHARED_PER_SM[arch] // (shared + 1024)
    return min(BLOCKS_PER_SM, WARPS_PER_SM // warps, by_regs, by_shared)


def compile_kernel(kernel: str, arch: int, f: int, precision: str = "ieee", b: int = MINI_BATCH,
                   launch: dict | None = None, num_warps: int | None = None) -> dict:
    """Compile `kernel` (forward, inference, backward, decode or prefill) for sm_{arch} at head size f,
    mini-batch b and the dot precision (ignored by decode; for prefill bf16, fp16, tf32 or ieee), with
    `launch` (num_warps, num_stages; default: the launcher's), its num_warps replaced by `num_warps` if given.
    Returns a record: registers per thread, spill bytes (stores, loads) and stack frame per thread (ptxas),
    shared memory per program and the target's limit, the programs that fit an SM and the waves of the
    1.3b model's 512 programs, whether the launch is the launcher's default, whether the program id is
    widened to int64 before the address arithmetic, compile seconds, and `error` (the compiler's message)
    where it did not compile."""
    module, attr, ints = _KERNELS[kernel]
    fn = getattr(_MODULES[module], attr)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("Triton's interpreter is on (TRITON_INTERPRET=1): its kernels cannot be compiled; "
                           "run without it (tests/test_kernels_aot.py compiles in a subprocess)")
    default = options(kernel, f, precision)
    launch = dict(default if launch is None else launch)
    if num_warps is not None:
        launch["num_warps"] = num_warps
    constexprs = {"F": f}
    if kernel == "prefill":
        constexprs.update(BS=b, DOT=precision, STORE_STATE=True)
    elif kernel != "decode":
        constexprs.update(BS=b, PRECISION=precision)
    if kernel in ("forward", "inference"):
        constexprs["STORE_STATES"] = kernel == "forward"
    signature = {a: "constexpr" if a in constexprs else "i32" if a in ints else "*fp32" for a in fn.arg_names}
    if kernel == "prefill":
        signature.update({a: _PREFILL_DTYPE[precision] for a in _PREFILL_ACTIVATIONS})
    elif kernel in _DUAL_ACTIVATIONS:
        signature.update({a: _DUAL_DTYPE[precision] for a in _DUAL_ACTIVATIONS[kernel]})
    # as at a launch: torch's allocations are 16-byte aligned and Triton specializes pointers on that (and
    # integers that are multiples of 16)
    aligned = _PREFILL_ALIGNED if kernel == "prefill" else _DUAL_ALIGNED
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a].startswith("*") or a in aligned}
    record = {"kernel": kernel, "arch": arch, "f": f, "precision": precision if kernel != "decode" else "-",
              "b": b, **launch, "default": launch == default, "limit": SHARED_LIMIT.get(arch)}
    report = ptxas_report(fn, signature, constexprs, attrs, arch, launch)
    if report["error"] is None:
        blocks = blocks_per_sm(arch, report["regs"], launch["num_warps"], report["shared"])
        report.update(blocks_per_sm=blocks,
                      waves_1_3b=-(-PROGRAMS_1_3B // (blocks * SMS[arch])) if blocks else None)
    return {**record, **report}


def ptxas_report(fn, signature: dict, constexprs: dict, attrs: dict, arch: int, launch: dict) -> dict:
    """Compile the @jit function `fn` for sm_{arch} with `launch` (num_warps, num_stages) and read what the
    GPU compiler says: registers per thread, spill bytes (stores, loads) and stack frame per thread (ptxas),
    shared memory per program, whether the program id is widened to int64 before the address arithmetic,
    compile seconds; or `error`, the compiler's message, where it did not compile."""
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(log):
            triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed: registers and spills
            triton.knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its report
            source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch)
    except Exception as e:  # noqa: BLE001  (a compile error is the record's verdict)
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        cause = e.__cause__ or e.__context__
        while cause is not None and (cause.__cause__ or cause.__context__) is not None:
            cause = cause.__cause__ or cause.__context__
        detail = f"{type(cause).__name__}: {str(cause).splitlines()[0]}" if cause else (lines or [""])[-1]
        return {"error": f"{type(e).__name__}: {detail}"[:400],
                "seconds": round(time.perf_counter() - start, 2)}
    text = log.getvalue()
    spill, regs = _PTXAS.search(text), _REGS.search(text)
    if not (spill and regs):
        raise RuntimeError(f"no ptxas report for {fn.__name__} sm_{arch}: {text[-500:]!r}")
    stack, stores, loads = (int(g) for g in spill.groups())
    # int64 offsets: the program id (sequence x head) widened before any address arithmetic multiplies it
    pid = re.search(r"(%\w+) = tt.get_program_id x : i32", compiled.asm["ttir"])
    int64 = bool(pid) and f"arith.extsi {pid.group(1)} : i32 to i64" in compiled.asm["ttir"]
    return {"regs": int(regs.group(1)), "stack": stack, "spill_stores": stores, "spill_loads": loads,
            "shared": compiled.metadata.shared, "int64_offsets": int64, "error": None,
            "seconds": round(time.perf_counter() - start, 2)}


def default_grid(archs=(80, 90), head_sizes=HEAD_SIZES, precisions=ttt_linear.PRECISIONS,
                 prefill_precisions=PREFILL_PRECISIONS, prefill_warps=ttt_linear_prefill.WARPS):
    """(kernel, arch, f, precision, num_warps) of every kernel the layer can launch (decode has no precision)
    with its launcher's num_warps, and of the prefill kernel with 16-bit operands at every candidate
    num_warps and its launcher's, in the other precisions at its launcher's."""
    for arch in archs:
        for f in head_sizes:
            for kernel in KERNELS:
                if kernel == "prefill":
                    for precision in prefill_precisions:
                        default = options(kernel, f, precision)["num_warps"]
                        sixteen = precision in ("bf16", "fp16")
                        for warps in sorted({*prefill_warps, default}) if sixteen else [default]:
                            yield kernel, arch, f, precision, warps
                    continue
                for precision in precisions if kernel != "decode" else ("-",):
                    yield kernel, arch, f, precision, options(kernel, f, precision)["num_warps"]


def verdict(r: dict) -> str:
    """ok, or why not: a compile error, shared memory above the limit, register spills."""
    if r["error"]:
        return "compile error"
    if r["limit"] is not None and r["shared"] > r["limit"]:
        return "shared > limit"
    return "spills" if r["spill_stores"] or r["spill_loads"] else "ok"


def table(records: list[dict]) -> str:
    """A markdown table of the records: one row per kernel, head size, precision and num_warps (the
    launcher's default marked *), a column group per target (registers per thread, spill stores/loads in
    bytes per thread, shared memory per program, programs per SM and the waves of the 1.3b model's 512)."""
    archs = sorted({r["arch"] for r in records})
    rows, by_config = {}, {}
    for r in records:
        key = (KERNELS.index(r["kernel"]), r["f"], r["precision"], r["num_warps"])
        rows.setdefault(key, r)
        by_config[key + (r["arch"],)] = r
    group = " sm_{0} regs | sm_{0} spill st/ld B | sm_{0} shared KB (<= {1}) | sm_{0} blocks/SM, waves |"
    head = "| kernel | f | precision | warps, stages |" + "".join(
        group.format(a, SHARED_LIMIT[a] // 1024) for a in archs) + " verdict |"
    lines = [head, "|" + "---|" * (4 + 4 * len(archs) + 1)]
    for key in sorted(rows):
        first = rows[key]
        launch = f"{first['num_warps']}, {first['num_stages']}" + ("*" if first.get("default") else "")
        cells = [first["kernel"], str(first["f"]), first["precision"], launch]
        verdicts = []
        for a in archs:
            r = by_config.get(key + (a,))
            if r is None or r["error"]:
                cells += ["-", "-", "-", "-"]
                verdicts.append(f"sm_{a}: {r['error'][:60] if r else 'not compiled'}")
                continue
            cells += [str(r["regs"]), f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared'] / 1024:.1f}",
                      f"{r['blocks_per_sm']}, {r['waves_1_3b']}"]
            if verdict(r) != "ok":
                verdicts.append(f"sm_{a}: {verdict(r)}")
        lines.append("| " + " | ".join(cells + ["; ".join(verdicts) or "ok"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    p.add_argument("--f", type=int, nargs="+", default=list(HEAD_SIZES))
    p.add_argument("--precision", nargs="+", default=list(ttt_linear.PRECISIONS))
    p.add_argument("--kernel", nargs="+", default=list(KERNELS))
    p.add_argument("--prefill-precision", nargs="+", default=list(PREFILL_PRECISIONS),
                   choices=ttt_linear_prefill.PRECISIONS, help="the prefill kernel's matmul operands")
    p.add_argument("--warps", type=int, nargs="+", default=list(ttt_linear_prefill.WARPS),
                   help="the prefill kernel's num_warps candidates")
    p.add_argument("--configs", help="a JSON list of [kernel, arch, f, precision(, num_warps)] to compile "
                   "instead (num_warps: the launcher's if left out)")
    p.add_argument("--json", action="store_true", help="one JSON record a line instead of the table")
    args = p.parse_args(argv)
    configs = json.loads(args.configs) if args.configs else [
        c for c in default_grid(args.arch, args.f, args.precision, args.prefill_precision, args.warps)
        if c[0] in args.kernel]
    report((compile_kernel(kernel, arch, f, precision if precision != "-" else "ieee",
                           num_warps=warps[0] if warps else None)
            for kernel, arch, f, precision, *warps in configs), args.json, table)


def report(records, as_json: bool, table) -> list[dict]:
    """Print each compile record as one JSON line as it comes (--json), or all of them at the end as
    `table(records)`; returns them."""
    done = []
    for r in records:
        done.append(r)
        if as_json:
            print(json.dumps(r), flush=True)
    if not as_json:
        print(table(done))
    return done


if __name__ == "__main__":
    main()
