"""`kernel: auto` takes TTT-Linear's Triton kernels only where they matched PyTorch on the device
(ttt_bench/models/ttt/kernel_check.py), and `ttt-bench doctor` says which path each model takes. Without a GPU
the selection logic runs on a stand-in CUDA tensor with the check's comparison monkeypatched or run on the
CPU (Triton's interpreter, TRITON_INTERPRET=1 from conftest.py); the real check on a GPU runs where there is
one."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from ttt_bench.cli.main import main

from ttt_bench.models.ttt import kernel_check
from ttt_bench.models.ttt.kernel_check import use_triton

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from ttt_bench.kernels import ttt_linear as triton_linear  # noqa: E402

GPU = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # what use_triton reads of a CUDA tensor


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty user cache dir, no verdict in this process, and a GPU by the name of "Test GPU" whose check
    is the real comparison, run on the GPU where there is one, else on the CPU (Triton's interpreter: a
    compiled kernel cannot read CPU tensors); `fresh.calls` counts the checks."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TTT_BENCH_KERNELS", raising=False)
    monkeypatch.setattr(kernel_check, "_verdicts", {})
    monkeypatch.setattr(kernel_check, "device_name", lambda device: "Test GPU")
    compare, calls = kernel_check.compare_kernels, []

    def here(device):
        calls.append(device)
        return compare(torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    monkeypatch.setattr(kernel_check, "compare_kernels", here)
    return SimpleNamespace(calls=calls, cache=tmp_path / "ttt-bench" / "kernel_check.json")


def test_the_kernels_match_pytorch_on_this_device(one_thread):
    """The check itself, on the GPU where there is one, else in Triton's CPU interpreter."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = kernel_check.compare_kernels(device)
    assert result["ok"], result["detail"]


def test_auto_selects_triton_after_one_passing_check_cached_per_device_and_versions(fresh, monkeypatch):
    assert use_triton(GPU) and len(fresh.calls) == 1
    assert use_triton(GPU) and len(fresh.calls) == 1  # this process's verdict
    import triton

    key = f"Test GPU | torch {torch.__version__} | triton {triton.__version__}"
    recorded = json.loads(fresh.cache.read_text())
    assert recorded[key]["ok"] and recorded[key]["tolerance"] == kernel_check.TOLERANCE
    monkeypatch.setattr(kernel_check, "_verdicts", {})  # a new process: the file's verdict, no new check
    assert use_triton(GPU) and len(fresh.calls) == 1
    monkeypatch.setattr(triton, "__version__", "0.0-other")  # another Triton: checked again
    assert use_triton(GPU) and len(fresh.calls) == 2 and len(json.loads(fresh.cache.read_text())) == 2
    # never checked: forced on or off, or not on CUDA
    assert use_triton(GPU, "triton") and not use_triton(GPU, "torch")
    assert not use_triton(torch.zeros(1)) and len(fresh.calls) == 2
    monkeypatch.setenv("TTT_BENCH_KERNELS", "torch")
    assert not use_triton(GPU)


def test_a_kernel_that_disagrees_falls_back_to_pytorch_with_one_warning(fresh, monkeypatch):
    dual = triton_linear.ttt_linear_dual

    def off_by_a_bit(*args, **kwargs):
        Z, *rest = dual(*args, **kwargs)
        return (Z * 1.001, *rest)

    monkeypatch.setattr(triton_linear, "ttt_linear_dual", off_by_a_bit)
    expected = "rejected on Test GPU.*dual output 0.*PyTorch dual form"
    with pytest.warns(RuntimeWarning, match=expected) as caught:
        assert not use_triton(GPU)
        assert not use_triton(GPU)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    (verdict,) = json.loads(fresh.cache.read_text()).values()
    assert not verdict["ok"] and "dual output 0" in verdict["detail"] and verdict["failed"] == ["dual"]
    # each family on its own: the prefill, TTT-MLP and decode kernels passed and still run
    assert all(use_triton(GPU, family=f) for f in ("prefill", "mlp", "decode")) and len(fresh.calls) == 1


def test_a_kernel_that_does_not_compile_falls_back_to_pytorch(fresh, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("triton.compiler.errors.CompilationError: at 12:4: unsupported\nmore lines")

    monkeypatch.setattr(triton_linear, "ttt_linear_dual", broken)
    with pytest.warns(RuntimeWarning, match="CompilationError"):
        assert not use_triton(GPU)
    (verdict,) = json.loads(fresh.cache.read_text()).values()
    assert not verdict["ok"] and verdict["detail"].startswith("dual: RuntimeError: triton.compiler")
    assert "dual/tf32: RuntimeError" in verdict["detail"] and verdict["failed"] == ["dual"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_this_gpu_runs_the_checked_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernel_check, "_verdicts", {})
    assert use_triton(torch.zeros(1, device="cuda"))
    assert next(iter(json.loads((tmp_path / "ttt-bench" / "kernel_check.json").read_text()).values()))["ok"]


def test_doctor_reports_the_machine_and_each_models_kernel_path(capsys, monkeypatch, tmp_path):
    (tmp_path / "pile-mini").mkdir()
    (tmp_path / "pile-mini" / "train.jsonl.zst").write_bytes(b"")
    monkeypatch.setenv("TTT_BENCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    main(["doctor"])
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert lines["torch"].startswith(f"torch: {torch.__version__}")
    for key in ("CPU load", "CUDA", "bf16", "Triton", "mamba-ssm", "causal-conv1d", "decoding"):
        assert key in lines, out
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 2.0, 1.0))  # another job holds the cores
    main(["doctor"])
    assert "(busy: beside other jobs, `export OMP_WAIT_POLICY=PASSIVE`" in capsys.readouterr().out
    assert f"{tmp_path} [pile-mini]" in out
    paths = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(paths) == {"transformer", "ttt_linear", "ttt_mlp", "ttt_kernel", "mamba", "linear_attention"}
    if torch.cuda.is_available():
        assert "Triton kernels" in paths["ttt_linear"] or "rejected" in paths["ttt_linear"]
    else:
        assert lines["CUDA"].startswith("CUDA: not available")
        assert lines["decoding"] == "decoding: eager (CUDA graphs on a GPU)"
        assert "PyTorch dual form" in paths["ttt_linear"] and "CUDA-only" in paths["ttt_linear"]


# -- the kernel check's verdicts -----------------------------------------------------------------------------

CUDA0 = torch.device("cuda", 0)  # only its name is read, and that is monkeypatched


@pytest.fixture
def checks(monkeypatch, tmp_path):
    """An empty cache, a GPU named "Test GPU", and a comparison of the kernels that returns `checks.result`
    and counts its calls; `checks.new_process()` forgets this process's verdicts."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernel_check, "device_name", lambda device: "Test GPU")
    state = SimpleNamespace(calls=0, result={"ok": False, "detail": "dual output 0: 1.0e+00"},
                            cache=tmp_path / "ttt-bench" / "kernel_check.json",
                            new_process=lambda: monkeypatch.setattr(kernel_check, "_verdicts", {}))

    def compare(device):
        state.calls += 1
        return dict(state.result)

    monkeypatch.setattr(kernel_check, "compare_kernels", compare)
    state.new_process()
    return state


def test_a_failed_kernel_check_is_recorded_but_the_next_process_checks_again(checks):
    with pytest.warns(RuntimeWarning, match="rejected on Test GPU.*The next process checks again"):
        assert not kernel_check.verdict(CUDA0)["ok"]
        assert not kernel_check.verdict(CUDA0)["ok"] and checks.calls == 1  # once per process
    (recorded,) = json.loads(checks.cache.read_text()).values()
    assert not recorded["ok"] and recorded["code"] == kernel_check.code_version()
    checks.new_process()
    checks.result = {"ok": True, "detail": "within tolerance"}  # e.g. a transient failure, or a new install
    assert kernel_check.verdict(CUDA0)["ok"] and checks.calls == 2
    checks.new_process()
    assert kernel_check.verdict(CUDA0)["ok"] and checks.calls == 2  # a pass is kept


def test_a_passing_verdict_is_checked_again_with_a_new_driver_or_kernel_code(checks, monkeypatch):
    checks.result = {"ok": True, "detail": "within tolerance"}
    assert kernel_check.verdict(CUDA0)["ok"] and checks.calls == 1
    for stamp, value in (("driver_version", "999.99"), ("code_version", "another kernel")):
        checks.new_process()
        monkeypatch.setattr(kernel_check, stamp, lambda value=value: value)
        assert kernel_check.verdict(CUDA0)["ok"]
    assert checks.calls == 3
    checks.new_process()
    assert kernel_check.verdict(CUDA0)["ok"] and checks.calls == 3
