"""`ttt-bench bench` end to end on tiny sizes: the suites run and write the CSV the plots read. No timing is
checked here (timings never belong in unit tests)."""

import argparse
import os
import shutil

import pandas as pd
import pytest
import torch
from ttt_bench.cli.main import main
from ttt_bench.kernels.mamba import scan_cpu

from tests.conftest import BENCH_TINY
from ttt_bench.bench import models


def test_models_suite_writes_every_phase_of_every_model(tmp_path, capsys):
    out = tmp_path / "models.csv"
    names = ",".join([*models.MODELS, "no_such_model"])
    main(["bench", "models", "--models", names, "--out", str(out), *BENCH_TINY])
    df = pd.read_csv(out)
    required = {"model", "context", "phase", "latency_ms_per_token", "tokens_per_s", "mfu", "peak_mem_mb"}
    assert required <= set(df.columns)
    timed = df.dropna(subset=["latency_ms_per_token"])
    for name in models.MODELS:
        rows = timed[timed.model == name]
        expected = [("decode", 32), ("decode", 64), ("prefill", 32), ("prefill", 64), ("train", 32)]
        assert sorted(zip(rows.phase, rows.context, strict=True)) == expected, name
    assert (timed.tokens_per_s > 0).all() and (timed[timed.phase == "train"].mfu > 0).all()
    assert "does not exist" in df[df.model == "no_such_model"].note.item()
    printed = capsys.readouterr().out
    assert "train throughput ttt_linear / transformer" in printed and f"wrote {out}" in printed


def test_a_model_out_of_memory_is_a_row_with_a_note_and_the_others_are_timed(tmp_path, monkeypatch):
    """A prefill that does not fit (before decode steps too) is a row "out of memory", not a crash."""
    build = models.Bench.model

    def model(self, name, seq_len):
        m = build(self, name, seq_len)
        if name == "mamba":
            def forward(*args, **kwargs):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB")
            m.forward = forward
        return m

    monkeypatch.setattr(models.Bench, "model", model)
    out = tmp_path / "models.csv"
    main(["bench", "models", "--models", "transformer,mamba", "--phases", "prefill,decode", "--out", str(out),
          *BENCH_TINY])
    df = pd.read_csv(out)
    mamba = df[df.model == "mamba"]
    assert (mamba.note == "out of memory").all() and mamba.latency_ms_per_token.isna().all()
    assert set(mamba.phase) <= {"prefill", "decode"} and not mamba.empty
    timed = df[(df.model == "transformer")].dropna(subset=["latency_ms_per_token"])
    assert sorted(zip(timed.phase, timed.context, strict=True)) == [("decode", 32), ("decode", 64),
                                                                    ("prefill", 32), ("prefill", 64)]


def test_forms_suite_times_primal_and_dual(tmp_path):
    out = tmp_path / "forms.csv"
    fused = shutil.which("c++") is not None  # torch.compile on CPU needs a C++ compiler
    main(["bench", "forms", "--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--tokens", "64",
          "--warmup", "1", "--repeats", "1", "--threads", "1", "--device", "cpu", "--out", str(out),
          "--fused" if fused else "--no-fused"])
    df = pd.read_csv(out)
    impls = ("dual", "dual-fused", "primal") if fused else ("dual", "primal")
    expected = [(scope, impl) for scope in ("core", "layer") for impl in impls]
    assert sorted(zip(df.scope, df.impl, strict=True)) == expected
    assert (df.ms_fwd_bwd > 0).all() and (df[df.impl == "dual"].speedup_vs_dual == 1).all()


def test_presets_fill_only_defaults():
    parser = argparse.ArgumentParser()
    models.add_arguments(parser)
    args = parser.parse_args(["--preset", "cpu-ref", "--threads", "1"])
    models.apply_preset(args, parser)
    assert (args.d_model, args.n_layers, args.n_heads, args.tokens_per_step) == (256, 4, 4, 16384)
    assert args.threads == 1 and args.contexts == "1024-16384"
    assert models.parse_contexts("1024-16384") == [1024, 2048, 4096, 8192, 16384]
    assert models.parse_contexts("64,256") == [64, 256]


def test_bad_arguments_fail_with_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "no_such_suite"])
    with pytest.raises(SystemExit) as e:
        main(["bench", "models", "--phases", "prefil", *BENCH_TINY])
    assert e.value.code == 2 and "unknown phases" in capsys.readouterr().err


def test_scan_suite_times_every_implementation(tmp_path):
    out = tmp_path / "scan.csv"
    main(["bench", "scan", "--batch", "1", "--seqlen", "32", "--ref-seqlen", "16", "--d-model", "8",
          "--warmup", "0", "--repeats", "1", "--threads", "1", "--out", str(out)])
    df = pd.read_csv(out)
    expected = [("chunked", 32), ("mambapy_pscan", 16), ("mambapy_pscan", 32), ("sequential_ref", 16)]
    if scan_cpu.available():
        expected.insert(1, ("kernel", 32))
    assert sorted(zip(df.impl, df.seqlen, strict=True)) == expected
    assert (df.median_ms > 0).all() and (df[df.impl == "mambapy_pscan"].speedup_vs_mambapy == 1).all()


def test_a_timing_records_its_conditions_and_says_when_it_was_taken_under_load(tmp_path, capsys, monkeypatch):
    """Every bench CSV carries the cores other work kept busy just before it, the load average before and
    after, the threads and `under_load`; busy cores beyond those the timing leaves free mark it (issue 35,
    point 8). The busy cores are measured, not the load average, which still counts the previous timing's
    own threads for a minute."""
    from ttt_bench.bench import common

    assert 0 <= common.busy_cores(0.2) <= (os.cpu_count() or 1) + 0.01
    monkeypatch.setattr(common, "busy_cores", lambda: 64.0)  # a busy machine
    main(["bench", "forms", "--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--tokens", "64",
          "--repeats", "1", "--out", str(tmp_path / "f.csv")])
    out = capsys.readouterr().out
    df = pd.read_csv(tmp_path / "f.csv")
    assert {"busy_cores_before", "load_before", "load_after", "threads_used", "under_load"} <= set(df.columns)
    assert df["under_load"].all() and "TAKEN UNDER LOAD" in out
    assert common.under_load(0.0, threads=1) is False


@pytest.mark.parametrize("selected,precision", [(False, None), (True, "tf32"), (True, "ieee")])
def test_forms_rows_are_labelled_by_the_path_they_run_triton_or_pytorch(selected, precision, monkeypatch):
    """Each row of `bench forms` runs the code its label names (issue 48): the PyTorch rows the PyTorch forms
    even where the layer would pick the Triton kernel, and a `triton (<precision>)` row, in both scopes,
    only where the layer takes the kernel, called in the precision the layer uses. The layer's selection is
    sent to the Triton path (on CPU the kernels run in Triton's interpreter, TRITON_INTERPRET=1)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from ttt_bench.kernels.ttt import dual_scan
    from ttt_bench.kernels.ttt import forms as ttt_forms

    from ttt_bench import kernels
    from ttt_bench.bench import forms
    from ttt_bench.models.ttt import kernel_check

    ran = []  # the paths each fwd+bwd took

    def spy(module, name, path):  # records path(args) of each call of module.name
        real = getattr(module, name)

        def call(*args, **kwargs):
            ran.append(path(*args, **kwargs))
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    spy(kernels, "ttt_linear_dual", lambda *_, precision="ieee", **__: f"triton ({precision})")
    spy(dual_scan, "ttt_linear_dual", lambda *_, fused=False, **__: "dual-fused" if fused else "dual")
    spy(ttt_forms, "ttt_scan", lambda form, *_, **__: form)
    if selected:  # every backend but "torch" takes the dual-form kernel, unchecked
        monkeypatch.setattr(kernel_check, "use_triton",
                            lambda x, backend="auto", family="dual": backend != "torch" and family == "dual")
        monkeypatch.setenv("TTT_BENCH_KERNEL_PRECISION", precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser()
    forms.add_arguments(parser)
    args = parser.parse_args(["--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--tokens", "64",
                              "--no-fused", "--device", device])
    expected = ["primal", "dual"] + [f"triton ({precision})"] * selected
    for scope in forms.SCOPES:
        rows = {label: build() for label, build in forms.cases(args, scope, torch.device(device),
                                                               torch.float32).items()}
        assert list(rows) == expected, scope
        for label, fwd_bwd in rows.items():
            ran.clear()
            fwd_bwd()
            assert set(ran) == {label}, (scope, label, ran)
    # outside the kernels' domain (head size 8) the layer runs PyTorch, and there is no Triton row
    args.d_model = 16
    assert forms.kernel_precision(args, torch.device(device), torch.float32) is None
