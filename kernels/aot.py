"""Ahead-of-time compile of the TTT-Linear Triton kernels for a CUDA target, on a machine without a GPU.

`triton.compile` of an `ASTSource` for `GPUTarget("cuda", arch, 32)` runs the whole GPU pipeline (Triton IR,
LLVM, PTX, then NVIDIA's ptxas, shipped with Triton) and needs no GPU, so it checks what the CPU interpreter
(TRITON_INTERPRET=1) never does: that the kernels compile at all, how much shared memory a program needs
(`metadata.shared`, against the target's per-block limit) and, from ptxas's own report, the registers per
thread and the bytes spilled to local memory. tests/test_kernels_aot.py runs it; docs/speed.md has the table:

    python -m ttt_bench.kernels.aot            # every kernel x head size x precision, sm_80 and sm_90

The kernels are compiled with the launch options their launchers use (`ttt_linear.launch_options`,
`ttt_decode.launch_options`). Not under TRITON_INTERPRET=1: Triton then decorates every @jit function, its
own standard library included, for the interpreter, and none of them can be compiled (the tests, which set
it, compile in a subprocess: `--configs`).
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

from . import ttt_decode, ttt_linear

# shared memory a block may use (bytes; cudaDevAttrMaxSharedMemoryPerBlockOptin): A100 (sm_80) 163 KB,
# H100 (sm_90) 227 KB
SHARED_LIMIT = {80: 166912, 90: 232448}
HEAD_SIZES = ttt_linear.HEAD_SIZES
# forward: as in training (the weights of every mini-batch stored for the backward); inference: the forward
# without them (no gradient needed: evaluation, prefill)
KERNELS = ("forward", "inference", "backward", "decode")
MINI_BATCH = ttt_linear.MINI_BATCHES[0]  # b = 16: the mini-batch size of every paper configuration

# kernel -> (module attribute, the integer arguments; every other non-constexpr argument is an fp32 pointer)
_KERNELS = {
    "forward": ("ttt_linear", "_dual_fwd_kernel", ("N", "H")),
    "inference": ("ttt_linear", "_dual_fwd_kernel", ("N", "H")),
    "backward": ("ttt_linear", "_dual_bwd_kernel", ("N", "H")),
    "decode": ("ttt_decode", "_decode_kernel", ("H",)),
}
_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def options(kernel: str, f: int, precision: str) -> dict:
    """The launch options (num_warps, num_stages) the launcher uses for `kernel` at head size f."""
    if kernel == "decode":
        return ttt_decode.launch_options(f)
    return ttt_linear.launch_options(f, precision, backward=kernel == "backward")


def compile_kernel(kernel: str, arch: int, f: int, precision: str = "ieee", b: int = MINI_BATCH,
                   launch: dict | None = None) -> dict:
    """Compile `kernel` (forward, backward or decode) for sm_{arch} at head size f, mini-batch b and the
    dot precision (ignored by decode), with `launch` (num_warps, num_stages; default: the launcher's).
    Returns a record: registers per thread, spill bytes (stores, loads) and stack frame per thread (ptxas),
    shared memory per program and the target's limit, whether the program id is widened to int64 before the
    address arithmetic, compile seconds, and `error` (the compiler's message) where it did not compile."""
    module, attr, ints = _KERNELS[kernel]
    fn = getattr({"ttt_linear": ttt_linear, "ttt_decode": ttt_decode}[module], attr)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("Triton's interpreter is on (TRITON_INTERPRET=1): its kernels cannot be compiled; "
                           "run without it (tests/test_kernels_aot.py compiles in a subprocess)")
    launch = dict(options(kernel, f, precision) if launch is None else launch)
    constexprs = {"F": f}
    if kernel != "decode":
        constexprs.update(BS=b, PRECISION=precision)
    if kernel in ("forward", "inference"):
        constexprs["STORE_STATES"] = kernel == "forward"
    signature = {a: "constexpr" if a in constexprs else "i32" if a in ints else "*fp32" for a in fn.arg_names}
    # as at a launch: torch's allocations are 16-byte aligned and Triton specializes pointers on that
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if signature[a] == "*fp32"}
    record = {"kernel": kernel, "arch": arch, "f": f, "precision": precision if kernel != "decode" else "-",
              "b": b, **launch, "limit": SHARED_LIMIT.get(arch)}
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
        error = f"{type(e).__name__}: {detail}"[:400]
        return {**record, "error": error, "seconds": round(time.perf_counter() - start, 2)}
    text = log.getvalue()
    spill, regs = _PTXAS.search(text), _REGS.search(text)
    if not (spill and regs):
        raise RuntimeError(f"no ptxas report for {kernel} sm_{arch} f={f}: {text[-500:]!r}")
    stack, stores, loads = (int(g) for g in spill.groups())
    # int64 offsets: the program id (sequence x head) widened before any address arithmetic multiplies it
    pid = re.search(r"(%\w+) = tt.get_program_id x : i32", compiled.asm["ttir"])
    int64 = bool(pid) and f"arith.extsi {pid.group(1)} : i32 to i64" in compiled.asm["ttir"]
    return {**record, "regs": int(regs.group(1)), "stack": stack, "spill_stores": stores,
            "spill_loads": loads, "shared": compiled.metadata.shared, "int64_offsets": int64, "error": None,
            "seconds": round(time.perf_counter() - start, 2)}


def default_grid(archs=(80, 90), head_sizes=HEAD_SIZES, precisions=ttt_linear.PRECISIONS):
    """(kernel, arch, f, precision) of every kernel the layer can launch; decode has no precision."""
    for arch in archs:
        for f in head_sizes:
            for kernel in KERNELS:
                for precision in precisions if kernel != "decode" else ("-",):
                    yield kernel, arch, f, precision


def verdict(r: dict) -> str:
    """ok, or why not: a compile error, shared memory above the limit, register spills."""
    if r["error"]:
        return "compile error"
    if r["limit"] is not None and r["shared"] > r["limit"]:
        return "shared > limit"
    return "spills" if r["spill_stores"] or r["spill_loads"] else "ok"


def table(records: list[dict]) -> str:
    """A markdown table of the records: one row per kernel, head size and precision, a column group per
    target (registers per thread, spill stores/loads in bytes per thread, shared memory per program)."""
    archs = sorted({r["arch"] for r in records})
    rows, by_config = {}, {}
    for r in records:
        key = (KERNELS.index(r["kernel"]), r["f"], r["precision"])
        rows.setdefault(key, r)
        by_config[key + (r["arch"],)] = r
    group = " sm_{0} regs | sm_{0} spill st/ld B | sm_{0} shared KB (<= {1}) |"
    head = "| kernel | f | precision | warps, stages |" + "".join(
        group.format(a, SHARED_LIMIT[a] // 1024) for a in archs) + " verdict |"
    lines = [head, "|" + "---|" * (4 + 3 * len(archs) + 1)]
    for key in sorted(rows):
        first = rows[key]
        launch = f"{first['num_warps']}, {first['num_stages']}"
        cells = [first["kernel"], str(first["f"]), first["precision"], launch]
        verdicts = []
        for a in archs:
            r = by_config.get(key + (a,))
            if r is None or r["error"]:
                cells += ["-", "-", "-"]
                verdicts.append(f"sm_{a}: {r['error'][:60] if r else 'not compiled'}")
                continue
            cells += [str(r["regs"]), f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared'] / 1024:.1f}"]
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
    p.add_argument("--configs", help="a JSON list of [kernel, arch, f, precision] to compile instead")
    p.add_argument("--json", action="store_true", help="one JSON record a line instead of the table")
    args = p.parse_args(argv)
    configs = json.loads(args.configs) if args.configs else [
        c for c in default_grid(args.arch, args.f, args.precision) if c[0] in args.kernel]
    records = []
    for kernel, arch, f, precision in configs:
        r = compile_kernel(kernel, arch, f, precision if precision != "-" else "ieee")
        records.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
    if not args.json:
        print(table(records))


if __name__ == "__main__":
    main()
