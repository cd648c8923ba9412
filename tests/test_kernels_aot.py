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

Compiling needs no GPU but not Triton's interpreter: it runs in subprocesses, two in parallel. The whole grid
(56 compiles, about 80 s of compile time) takes about 45 s on 2 CPU cores.
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
WORKERS = min(2, os.cpu_count() or 1)

CONFIGS = [pytest.param(kernel, arch, f, precision, id=f"{kernel}-sm_{arch}-f{f}-{precision}")
           for kernel, arch, f, precision in aot.default_grid()]


def default_configuration(kernel: str, precision: str) -> bool:
    """Whether the layer runs this kernel in this precision by default on CUDA."""
    return kernel == "decode" or precision == PRECISION


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
    return {(r["kernel"], r["arch"], r["f"], r["precision"]): r for r in records}


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """The records of every configuration selected in this session, compiled once (in parallel), and written
    as a table at the module's end (no pytest -s needed)."""
    selected = [tuple(item.callspec.params[k] for k in ("kernel", "arch", "f", "precision"))
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


@pytest.mark.parametrize("kernel,arch,f,precision", CONFIGS)
def test_kernel_compiles_for_the_gpu_and_fits(kernel, arch, f, precision, compiled):
    r = compiled[kernel, arch, f, precision]
    where = f"{kernel} for sm_{arch} at head size {f}, {precision}, {r['num_warps']} warps"
    assert r["error"] is None, f"{where} does not compile: {r['error']}"
    assert r["shared"] <= r["limit"], f"{where} needs {r['shared']} bytes of shared memory, over {r['limit']}"
    assert r["int64_offsets"], f"{where}: 32-bit offsets (B*H*T*f >= 2^31 at the paper's batch x context)"
    if default_configuration(kernel, precision) and f <= NO_SPILLS_UP_TO:
        assert r["spill_stores"] == r["spill_loads"] == 0, (
            f"{where} (the layer's default on CUDA) spills {r['spill_stores']} bytes of registers per thread "
            f"({r['regs']} registers): see launch_options in kernels/ttt_linear.py and kernels/ttt_decode.py")


def test_the_kernels_domain_is_the_compiled_grid():
    """`supported()` takes exactly the head sizes and mini-batch size compiled here (96, the 760m size, is
    outside: PyTorch), and every one has launch options."""
    import torch
    from ttt_bench.kernels import ttt_decode, ttt_linear

    lnw = torch.ones(1, 1, 16)
    for f in (8, 16, 32, 64, 96, 128, 256):
        for b in (8, 16, 32, 64):
            inside = f in aot.HEAD_SIZES and b == aot.MINI_BATCH
            assert ttt_linear.supported(torch.zeros(1, 1, 1, b, f), lnw, lnw) == inside, (b, f)
        assert ttt_decode.supported(torch.zeros(1, 1, 1, f), lnw, lnw) == (f in aot.HEAD_SIZES), f
    assert "head size 96" in ttt_linear.why_not(torch.zeros(1, 1, 1, 16, 96), lnw, lnw)
    assert ttt_linear.HEAD_SIZES == ttt_decode.HEAD_SIZES == aot.HEAD_SIZES
    assert ttt_linear.MINI_BATCHES == (aot.MINI_BATCH,)
    for f in aot.HEAD_SIZES:
        for kernel in aot.KERNELS:
            for precision in ttt_linear.PRECISIONS:
                assert set(aot.options(kernel, f, precision)) == {"num_warps", "num_stages"}
