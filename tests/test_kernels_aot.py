"""Every Triton kernel compiled ahead of time for real GPUs, on a machine without one (kernels/aot.py).

The CPU interpreter (TRITON_INTERPRET=1, tests/test_kernels.py) runs the kernels' arithmetic but checks
nothing the GPU compiler checks: a kernel that does not compile for a GPU (as `LN_EPS: tl.constexpr = 1e-6`
did) passes there. Here `triton.compile` runs the whole pipeline down to ptxas for sm_80 (A100) and sm_90
(H100), at every head size of the paper sizes and profiles (16, 32, 64; 128 too), in both precisions of the
chunk kernels (ieee, tf32), with the launch options the launchers use. A configuration fails on a compile
error, on shared memory above the target's per-block limit, on 32-bit offsets (the program id must be
widened to int64 before it is multiplied into an address), and, in the configuration the layer uses by
default on CUDA (the tf32 chunk kernels, ttt_bench/models/ttt/kernel_check.PRECISION, and the decode kernel),
on register spills at head sizes up to 64 (the paper sizes use 64). Other spills (ieee; head size 128) are
reported: the table at the end of the module's output (docs/speed.md has it).

The prefill kernel (kernels/ttt_linear_prefill.py) is compiled with bf16 and with tf32 operands at its
launcher's defaults (`CONFIGS`; the other candidate num_warps are the module's report): each must compile,
fit shared memory and widen its program id; its defaults must not spill up to head size 64, and at the
paper sizes' head size 64 its bf16 default must fit the 512 programs of the 1.3b model at batch 16 on an
H100/H200 (132 SMs) in one wave, the point of the kernel (issue 48). The other launches are reported.

Compiling needs no GPU but not Triton's interpreter: it runs in subprocesses, two in parallel. The whole grid
(72 compiles: 56 of the chunk and decode kernels, about 80 s of compile time, and 16 of the prefill kernel)
takes about a minute on 2 CPU cores.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no CUDA backend")

from ttt_bench.kernels import aot  # noqa: E402

from ttt_bench.models.ttt.kernel_check import PRECISION  # noqa: E402

NO_SPILLS_UP_TO = 64  # head sizes at which the default configuration must keep everything in registers
# but for the chunk kernel's backward on 16-bit activations (bf16 under autocast, the layer's training default
# on CUDA), which converts its tiles to float32 on chip and keeps three layouts' pointers: at head size 64 it
# spills up to this many bytes a thread (52 on sm_90 at 8 warps and 3 stages, 8 on sm_80; none from float32
# activations on sm_80), in place of the float32 copies of the activations it no longer needs
BACKWARD_16_BIT_SPILL_BUDGET = 64
WORKERS = min(2, os.cpu_count() or 1)

# The prefill kernel at its launcher's defaults only: its other candidate num_warps are what
# `python -m ttt_bench.kernels.aot --warps 1,2,4` reports (34 more compiles, about 2 minutes of the suite).
CONFIGS = [pytest.param(kernel, arch, f, precision, warps, id=f"{kernel}-sm_{arch}-f{f}-{precision}-w{warps}")
           for kernel, arch, f, precision, warps in aot.default_grid()
           if kernel != "prefill" or warps == aot.options(kernel, f, precision)["num_warps"]]
PARAMS = ("kernel", "arch", "f", "precision", "num_warps")


def default_configuration(kernel: str, precision: str) -> bool:
    """Whether the layer runs this kernel in this precision by default on CUDA; the prefill kernel (not in
    the layer yet) in either precision of the grid, at its launcher's num_warps."""
    return kernel in ("decode", "prefill") or precision == PRECISION


def compile_in_subprocesses(configs: list[tuple], cache_dir) -> dict[tuple, dict]:
    """Compile `configs` with `python -m ttt_bench.kernels.aot` in WORKERS subprocesses without
    TRITON_INTERPRET (set for this process by conftest.py: under it no @jit function can be compiled), their
    compiled kernels cached in `cache_dir` rather than the user's Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set: no warning

    def run(chunk):
        cmd = [sys.executable, "-m", "ttt_bench.kernels.aot", "--json", "--configs", json.dumps(chunk)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    chunks = [configs[i::WORKERS] for i in range(WORKERS)]
    with ThreadPoolExecutor(WORKERS) as pool:
        records = [r for part in pool.map(run, [c for c in chunks if c]) for r in part]
    return {tuple(r[k] for k in PARAMS): r for r in records}


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """The records of every configuration selected in this session, compiled once (in parallel), and written
    as a table at the module's end (no pytest -s needed)."""
    selected = [tuple(item.callspec.params[k] for k in PARAMS)
                for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec")
                and "kernel" in item.callspec.params]
    records = compile_in_subprocesses(selected, tmp_path_factory.mktemp("triton-cache"))
    yield records
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if records and reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # else teardown output is captured and dropped
            reporter.write_line("")
            reporter.write_line("Triton kernels compiled ahead of time (python -m ttt_bench.kernels.aot):")
            for line in aot.table(sorted(records.values(), key=lambda r: (r["arch"], r["f"]))).splitlines():
                reporter.write_line(line)


@pytest.mark.parametrize(",".join(PARAMS), CONFIGS)
def test_kernel_compiles_for_the_gpu_and_fits(kernel, arch, f, precision, num_warps, compiled):
    r = compiled[kernel, arch, f, precision, num_warps]
    where = f"{kernel} for sm_{arch} at head size {f}, {precision}, {r['num_warps']} warps"
    assert r["num_warps"] == num_warps
    assert r["error"] is None, f"{where} does not compile: {r['error']}"
    assert r["shared"] <= r["limit"], f"{where} needs {r['shared']} bytes of shared memory, over {r['limit']}"
    assert r["int64_offsets"], f"{where}: 32-bit offsets (B*H*T*f >= 2^31 at the paper's batch x context)"
    assert r["blocks_per_sm"] >= 1, f"{where}: not one program fits an SM"
    if default_configuration(kernel, precision) and r["default"] and f <= NO_SPILLS_UP_TO:
        budget = BACKWARD_16_BIT_SPILL_BUDGET if (kernel, precision) == ("backward", "tf32") else 0
        assert max(r["spill_stores"], r["spill_loads"]) <= budget, (
            f"{where} (the default on CUDA) spills {r['spill_stores']} bytes of registers per thread "
            f"({r['regs']} registers): see launch_options in kernels/ttt_linear.py, kernels/ttt_decode.py "
            "and kernels/ttt_linear_prefill.py")
    if kernel == "prefill" and r["default"] and precision == "bf16" and f == 64 and arch == 90:
        assert r["waves_1_3b"] == 1, (
            f"{where}: {r['blocks_per_sm']} programs an SM ({r['regs']} registers, {r['shared']} bytes of "
            "shared memory), so the 1.3b model's 512 (sequence, head) programs at batch 16 take "
            f"{r['waves_1_3b']} waves on 132 SMs")


def test_the_kernels_domain_is_the_compiled_grid():
    """`supported()` takes exactly the head sizes and mini-batch size compiled here (96, the 760m size, is
    outside: PyTorch), and every one has launch options."""
    import torch
    from ttt_bench.kernels import ttt_decode, ttt_linear, ttt_linear_prefill

    lnw = torch.ones(1, 1, 16)
    for f in (8, 16, 32, 64, 96, 128, 256):
        for b in (8, 16, 32, 64):
            inside = f in aot.HEAD_SIZES and b == aot.MINI_BATCH
            assert ttt_linear.supported(torch.zeros(1, 1, 2 * b, f), lnw, lnw, b) == inside, (b, f)
        assert ttt_decode.supported(torch.zeros(1, 1, 1, f), lnw, lnw) == (f in aot.HEAD_SIZES), f
    assert "head size 96" in ttt_linear.why_not(torch.zeros(1, 1, 16, 96), lnw, lnw, 16)
    assert ttt_linear.HEAD_SIZES == ttt_decode.HEAD_SIZES == aot.HEAD_SIZES
    assert ttt_linear.MINI_BATCHES == ttt_linear_prefill.MINI_BATCHES == (aot.MINI_BATCH,)
    for f in (8, 16, 32, 64, 96, 128, 256):
        for b in (8, 16, 32):
            inside = f in aot.HEAD_SIZES and b == aot.MINI_BATCH
            x = torch.zeros(1, 16, 1, f, dtype=torch.bfloat16)
            assert (not ttt_linear_prefill.why_not(x, lnw, lnw, b)) == inside, (f, b)
    for f in aot.HEAD_SIZES:
        for kernel in aot.KERNELS:
            for precision in ttt_linear.PRECISIONS + aot.PREFILL_PRECISIONS:
                if kernel != "prefill" and precision not in ttt_linear.PRECISIONS:
                    continue
                assert set(aot.options(kernel, f, precision)) == {"num_warps", "num_stages"}
    # every prefill launch of the grid: bf16 at each candidate and the default, tf32 at the default
    prefill = {(a, f, p, w) for k, a, f, p, w in aot.default_grid() if k == "prefill"}
    for arch in (80, 90):
        for f in aot.HEAD_SIZES:
            warps = {*ttt_linear_prefill.WARPS, ttt_linear_prefill.launch_options(f, "bf16")["num_warps"]}
            assert {w for a, g, p, w in prefill if (a, g, p) == (arch, f, "bf16")} == warps
            assert {w for a, g, p, w in prefill if (a, g, p) == (arch, f, "tf32")} == {
                ttt_linear_prefill.launch_options(f, "tf32")["num_warps"]}
