"""The GPU campaign (`make gpu-campaign`, issue 33): four stages, each resumable, into one
folder (`--out`, default results/gpu/) with a markdown summary.

  check  `ttt-bench doctor`; the CUDA test subset (pytest -k "triton or kernel or cuda" over test_kernels,
         test_kernel_check, test_ttt_layer, in a subprocess); the Triton TTT-Linear kernels (dual form in
         ieee and tf32 matmuls, and the decode kernel) against the PyTorch implementations run in float64, at
         head sizes 16, 32, 64, 128: outputs and gradients of every input, each as its largest error over
         the largest reference entry, within kernel_check.TOLERANCE (ieee, decode) or TF32_TOLERANCE (tf32)
         -> check.csv, doctor.txt, pytest.txt
  bench  `ttt-bench bench forms` (TTT-Linear fwd+bwd: primal, dual, dual-fused, Triton at the 125m width)
         -> bench_forms.csv; `ttt-bench bench models` at 125m in bf16, prefill and decode latency per token at
         1k-16k for transformer (SDPA), ttt_linear, ttt_mlp, mamba -> bench_models_125m.csv; the same at 1.3b,
         prefill only at 1k, 4k, 16k (Figure 3) -> bench_prefill_1.3b.csv
  train  `ttt-bench train trainer=gpu` (bf16-mixed) of each model at 125m on the synthetic corpus (no files
         needed), 20 steps of 16k tokens, one process per model: first/last losses, whether the loss fell, no
         non-finite loss and no skipped step, tokens/s and peak memory (torch.cuda.max_memory_allocated)
         -> train.csv (run folders, with their checkpoints, stay in --work, not in --out)
  figure3 Figure 3 / 15 at the paper's settings: `ttt-bench bench models` at 1.3b, prefill at batch 16 from 1k
         to 16k and at 32k, then 16k and 32k at batch 8; decode steps at 125m, batch 512, 1k and 2k
         -> bench_prefill_1.3b_b16.csv, bench_prefill_1.3b_b16_32k.csv, bench_prefill_1.3b_b8_32k.csv,
         bench_decode_125m_b512.csv

Measured on one H200 (results/gpu/RUN.md): check 38 s, bench 161 s, train 144 s, figure3 121 s; each
stage fits a lease of 15 minutes of device time, start and install included.

A stage whose outputs exist with its marker (`<out>/<stage>.done`) is skipped unless --force; every file is
written atomically (io.write_atomic), so a stage cut off keeps the stages before it. SUMMARY.md is rebuilt
from the finished stages' sections (<out>/sections/<stage>.md): the machine (GPU model, driver, torch,
CUDA, Triton), each command with its wall time, and the key numbers.

--dry runs every stage on the CPU in tiny form (size xs, short contexts, a few steps, the Triton interpreter
for the kernels, --device cpu), writing the same files: what `make test` runs (tests/test_campaign.py).
Without a GPU and without --dry the command says so in one line and exits 2.
"""

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("check", "bench", "train", "figure3")
MODELS = ("transformer", "ttt_linear", "ttt_mlp", "mamba")
HEAD_SIZES = (16, 32, 64, 128)
PYTEST_K = "triton or kernel or cuda"
PYTEST_FILES = ("tests/test_kernels.py", "tests/test_kernel_check.py", "tests/test_ttt_layer.py")
REPO = Path(__file__).resolve().parent.parent

# The `ttt-bench bench` arguments of each bench stage's parts: (real, dry).
F3 = ["--models", "transformer,ttt_linear"]
F3_1B = ["--size", "1.3b", "--dtype", "bfloat16", "--phases", "prefill"]
BENCH = {
    "bench": {
        "forms": (["--d-model", "768", "--n-heads", "12", "--seq-len", "2048", "--tokens", "16384",
                   "--repeats", "3"],
                  ["--quick", "--no-fused", "--repeats", "1", "--warmup", "0", "--device", "cpu"]),
        "models_125m": (["--size", "125m", "--dtype", "bfloat16", "--phases", "prefill,decode", "--contexts",
                         "1024-16384", "--batch", "4", "--decode-batch", "16", "--repeats", "2"],
                        ["--preset", "quick", "--phases", "prefill,decode", "--contexts", "64,128",
                         "--repeats", "1", "--warmup", "0", "--decode-tokens", "2", "--device", "cpu"]),
        "prefill_1.3b": (["--size", "1.3b", "--dtype", "bfloat16", "--phases", "prefill", "--contexts",
                          "1024,4096,16384", "--batch", "1", "--repeats", "1"],
                         ["--preset", "quick", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
                          "--phases", "prefill", "--contexts", "64", "--repeats", "1", "--warmup", "0",
                          "--device", "cpu"]),
    },
    # Figure 3 / 15 at the paper's settings: prefill at 1.3b with batch 16 from 1k to 16k, then 32k on its own
    # (a cap or an out-of-memory there keeps the shorter contexts); the Transformer's preallocated KV cache
    # at 16 x 32k does not fit an H200, so 16k and 32k again at batch 8. Decode steps at batch 512 at 125m:
    # a 1.3b Transformer's KV cache at batch 512 does not fit one GPU beyond ~1k tokens, and our PyTorch
    # Mamba scan's prefill of 512 x 1k tokens does not fit either.
    "figure3": {
        part: ([*F3, *real], [*F3, "--preset", "quick", "--warmup", "0", "--device", "cpu", *dry])
        for part, real, dry in [
            ("prefill_1.3b_b16", [*F3_1B, "--contexts", "1024-16384", "--batch", "16", "--repeats", "2"],
             ["--phases", "prefill", "--contexts", "64,128", "--batch", "2", "--repeats", "1"]),
            ("prefill_1.3b_b16_32k", [*F3_1B, "--contexts", "32768", "--batch", "16", "--repeats", "1"],
             ["--phases", "prefill", "--contexts", "256", "--batch", "2", "--repeats", "1"]),
            ("prefill_1.3b_b8_32k", [*F3_1B, "--contexts", "16384,32768", "--batch", "8", "--repeats", "1"],
             ["--phases", "prefill", "--contexts", "128,256", "--batch", "1", "--repeats", "1"]),
            ("decode_125m_b512", ["--size", "125m", "--dtype", "bfloat16", "--phases", "decode", "--contexts",
                                  "1024,2048", "--decode-batch", "512", "--decode-tokens", "8"],
             ["--phases", "decode", "--contexts", "64", "--decode-batch", "8", "--decode-tokens", "2"]),
        ]
    },
}
BENCH_OUT = {part: f"bench_{part}.csv" for parts in BENCH.values() for part in parts}
OUTPUTS = {"check": ["check.csv", "doctor.txt", "pytest.txt"], "train": ["train.csv"],
           **{stage: [BENCH_OUT[part] for part in parts] for stage, parts in BENCH.items()}}

# `ttt-bench train` overrides: (real, dry). 20 steps of 16 sequences of 1024 tokens at 125m; the synthetic
# corpus cut to what the steps read (plus validation), so tokenizing it takes seconds.
TRAIN = (["size=125m", "trainer=gpu", "trainer.max_steps=20", "data.seq_len=1024", "data.micro_batch_size=16",
          "recipe.tokens_per_batch=16384", "data.corpus.train_docs=100", "data.corpus.validation_docs=8",
          "data.val_tokens=65536"],
         ["size=xs", "trainer=cpu", "trainer.max_steps=6", "data.seq_len=64", "data.micro_batch_size=4",
          "recipe.tokens_per_batch=256", "data.corpus.train_docs=12", "data.corpus.validation_docs=2",
          "data.val_tokens=1024"])
TRAIN_COMMON = ["data=synthetic", "trainer.enable_progress_bar=false", "eval_every_n_steps=100000",
                "checkpoint_every_n_steps=100000"]

# Runs `ttt-bench train` and prints the process's peak memory at exit (CUDA allocator, else the CPU's RSS).
PEAK_WRAPPER = (
    "import atexit, resource, sys, torch\n"
    "def peak():\n"
    "    mb = (torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() and "
    "torch.cuda.is_initialized() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    "    kind = 'cuda' if torch.cuda.is_available() else 'cpu-rss'\n"
    "    print(f'CAMPAIGN_PEAK_MB {mb:.1f} {kind}', flush=True)\n"
    "atexit.register(peak)\n"
    "from ttt_bench.cli.main import main\n"
    "main(['train', *sys.argv[1:]])\n"
)


def write(path: Path, text: str) -> None:
    from ttt_bench.io import write_atomic

    write_atomic(path, text)


def gpu_info() -> dict:
    """The machine: GPU model and driver (torch.cuda, nvidia-smi), torch, CUDA and Triton versions."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "triton": triton_version, "gpu": "no GPU",
            "driver": "no GPU"}
    if torch.cuda.is_available():
        info["gpu"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True)
        if smi.returncode == 0 and smi.stdout.strip():
            info["driver"] = smi.stdout.strip().splitlines()[0].split(",")[1].strip()
            info["nvidia_smi"] = smi.stdout.strip().replace("\n", "; ")
    return info


class Stage:
    """One stage's commands, wall times and key numbers, for its section of SUMMARY.md."""

    def __init__(self, name: str, out: Path, dry: bool):
        self.name, self.out, self.dry = name, out, dry
        self.commands: list[tuple[str, float, str]] = []
        self.numbers: list[str] = []
        self.start = time.perf_counter()

    def timed(self, command: str, fn):
        start = time.perf_counter()
        status = "ok"
        try:
            return fn()
        except Exception as e:
            status = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            raise
        finally:
            self.commands.append((command, time.perf_counter() - start, status))
            print(f"[campaign] {self.name}: {command} ({self.commands[-1][1]:.1f} s, {status})", flush=True)

    def run(self, argv: list[str], shown: str | None = None, env: dict | None = None, timeout: float = 540):
        """A subprocess in the repository root: its CompletedProcess (stdout and stderr together)."""
        shown = shown or shlex.join(argv)

        def go():
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **(env or {})})
            done.output = done.stdout + done.stderr
            return done

        done = self.timed(shown, go)
        if done.returncode:
            self.commands[-1] = (*self.commands[-1][:2], f"exit {done.returncode}")
        return done

    def finish(self) -> None:
        wall = time.perf_counter() - self.start
        lines = [f"## {self.name}{' (dry run, CPU)' if self.dry else ''}", "",
                 f"Finished {time.strftime('%Y-%m-%d %H:%M:%S')}, {wall:.0f} s.", "",
                 "| command | wall (s) | status |", "|---|---|---|"]
        lines += [f"| `{c}` | {s:.1f} | {st} |" for c, s, st in self.commands]
        lines += ["", *[f"- {n}" for n in self.numbers], ""]
        write(self.out / "sections" / f"{self.name}.md", "\n".join(lines))
        write(self.out / f"{self.name}.done", json.dumps({"finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                          "wall_s": round(wall, 1), "dry": self.dry}) + "\n")


# -- check -------------------------------------------------------------------------------------------------


def kernel_rows(device, dry: bool) -> list[dict]:
    """The Triton kernels against the PyTorch implementations in float64, on kernel_check's cases and
    errors: one row per kernel, precision, head size."""
    import torch

    from ttt_bench.kernels import ttt_linear
    from ttt_bench.models.ttt import kernel_check

    double = lambda fn: lambda *x: fn(*[t.double() for t in x])
    rows = []
    for f in HEAD_SIZES:
        for case in kernel_check.kernel_cases(device, f, seed=f):
            name, precision, kernel, reference, inputs, seed, tol = case
            kernel_name = name if name == "decode" else f"dual/{precision}"  # "dual" is kernel_check's ieee
            row = dict(kernel=kernel_name, precision=precision, head_size=f, device=str(device),
                       interpreter=os.environ.get("TRITON_INTERPRET") == "1", tolerance=tol)
            dual = kernel_check._inputs(device, f=f)  # the dual form's domain decides for both kernels
            if why := ttt_linear.why_not(dual[0], dual[5], dual[6]):
                rows.append({**row, "status": "unsupported", "note": f"PyTorch path: {why}"})
                continue
            try:
                with torch.autocast(torch.device(device).type, enabled=False), torch.enable_grad():
                    errs = kernel_check.kernel_errors(kernel, double(reference), inputs, seed)
            except Exception as e:  # noqa: BLE001  (a compile or launch failure is a failed row)
                lines = str(e).strip().splitlines()
                failure = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
                rows.append({**row, "status": "error", "note": failure})
                continue
            worst_name, worst = max(errs.items(), key=lambda kv: kv[1])
            out_err = max([v for k, v in errs.items() if k.startswith("output")], default=0.0)
            grad_err = max([v for k, v in errs.items() if k.startswith("grad")], default=0.0)
            ok = all(math.isfinite(v) and v <= tol for v in errs.values())
            note = "interpreter: tf32 not emulated (exact matmuls)" if dry and precision == "tf32" else ""
            rows.append({**row, "status": "pass" if ok else "FAIL", "max_output_err": out_err,
                         "max_grad_err": grad_err, "worst": f"{name} {worst_name} {worst:.1e}", "note": note})
    return rows


def stage_check(st: Stage) -> None:
    import pandas as pd
    import torch

    from ttt_bench import doctor

    doc = st.timed("ttt-bench doctor", doctor.report)
    write(st.out / "doctor.txt", "\n".join(doc) + "\n")
    files = PYTEST_FILES if not st.dry else ("tests/test_kernel_check.py",)  # dry: one file, the same -k
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", PYTEST_K]
    done = st.run(argv, shown=shlex.join(["pytest", "-q", *files, "-k", PYTEST_K]))
    write(st.out / "pytest.txt", done.output)
    tail = [ln for ln in done.output.strip().splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    line = tail[-1].strip("= ") if tail else f"no summary line (exit {done.returncode})"
    st.numbers.append(f"CUDA test subset: {line}")
    device = torch.device("cpu" if st.dry else "cuda")
    rows = st.timed(f"Triton kernels vs float64 PyTorch at head sizes {HEAD_SIZES} on {device}",
                    lambda: kernel_rows(device, st.dry))
    df = pd.DataFrame(rows)
    write(st.out / "check.csv", df.to_csv(index=False))
    for (kernel, _precision), g in df.groupby(["kernel", "precision"], sort=False):
        cells = []
        for _, r in g.iterrows():
            err = r.get("worst") if r["status"] in ("pass", "FAIL") else r.get("note", "")
            cells.append(f"f={r['head_size']} {r['status']} ({err})")
        st.numbers.append(f"{kernel} (tolerance {g['tolerance'].iloc[0]:g}): " + "; ".join(cells))


# -- bench -------------------------------------------------------------------------------------------------


def run_suite(suite_name: str, argv: list[str], out: Path):
    """A suite of ttt_bench.bench through its Python function, as `ttt-bench bench SUITE argv` does."""
    import importlib

    suite = importlib.import_module(f"ttt_bench.bench.{suite_name}")
    parser = argparse.ArgumentParser(prog=f"ttt-bench bench {suite_name}")
    suite.add_arguments(parser)
    df = suite.run(parser.parse_args(argv))
    write(out, df.to_csv(index=False))
    return df


def stage_bench(st: Stage) -> None:
    from ttt_bench.bench.models import summary as models_summary

    for part, (real, dry) in BENCH[st.name].items():
        suite = "forms" if part == "forms" else "models"
        argv = dry if st.dry else real
        out = st.out / BENCH_OUT[part]
        df = st.timed(shlex.join(["ttt-bench", "bench", suite, *argv, "--out", str(out)]),
                      lambda suite=suite, argv=argv, out=out: run_suite(suite, argv, out))
        if suite == "forms":
            for _, r in df.iterrows():
                st.numbers.append(f"forms {r['scope']} {r['impl']}: {r['ms_fwd_bwd']:.2f} ms fwd+bwd, "
                                  f"{r['speedup_vs_dual']:.2f}x the dual form's speed")
        else:
            st.numbers += [f"{part}: {line}" for line in models_summary(df)]
            notes = df["note"].dropna() if "note" in df else []
            st.numbers += [f"{part}: note {n}" for n in sorted(set(notes))]


# -- train -------------------------------------------------------------------------------------------------


def stage_train(st: Stage, work: Path) -> None:
    import pandas as pd

    rows = []
    for model in MODELS:
        runs = work / "train" / model
        shutil.rmtree(runs, ignore_errors=True)
        overrides = [f"model={model}", *(TRAIN[1] if st.dry else TRAIN[0]), *TRAIN_COMMON,
                     f"paths.runs={runs}", f"paths.cache={work / 'cache'}"]
        done = st.run([sys.executable, "-c", PEAK_WRAPPER, *overrides],
                      shown=shlex.join(["ttt-bench", "train", *overrides]))
        logs = st.out / "logs"
        write(logs / f"train_{model}.log", done.output)
        row = dict(model=model, exit=done.returncode)
        peak = re.findall(r"CAMPAIGN_PEAK_MB ([\d.]+) (\S+)", done.output)
        if peak:
            row["peak_mem_mb"], row["peak_mem_kind"] = float(peak[-1][0]), peak[-1][1]
        metrics = sorted(runs.rglob("metrics.json"))
        losses_csv = sorted(runs.rglob("losses.csv"))
        if metrics:
            m = json.loads(metrics[-1].read_text())
            keys = ("size", "params", "steps", "tokens_seen", "tokens_per_s", "steady_tokens_per_s",
                    "skipped_steps", "val_loss", "wall_time_s")
            row.update({k: m.get(k) for k in keys})
        if losses_csv:
            loss = pd.read_csv(losses_csv[-1])["loss"].astype(float)
            k = max(1, min(3, len(loss) // 3))
            row["first_loss"], row["last_loss"] = loss.iloc[:k].mean(), loss.iloc[-k:].mean()
            row["all_finite"] = bool(loss.map(math.isfinite).all())
            row["loss_fell"] = bool(row["last_loss"] < row["first_loss"])
        row["ok"] = bool(done.returncode == 0 and row.get("all_finite") and row.get("loss_fell")
                         and not row.get("skipped_steps"))
        if done.returncode:
            row["error"] = (done.stderr.strip().splitlines() or [""])[-1][:300]
        rows.append(row)
        st.numbers.append(
            f"{model}: {'ok' if row['ok'] else 'NOT OK'}; loss {row.get('first_loss', float('nan')):.3f} -> "
            f"{row.get('last_loss', float('nan')):.3f}, {row.get('steady_tokens_per_s') or 'n/a'} tokens/s "
            f"(steady), peak {row.get('peak_mem_mb', float('nan')):.0f} MB ({row.get('peak_mem_kind', '?')})"
            + (f"; {row['error']}" if row.get("error") else ""))
        write(st.out / "train.csv", pd.DataFrame(rows).to_csv(index=False))  # a stage cut off keeps its rows


# -- driver ------------------------------------------------------------------------------------------------


def finished(out: Path, stage: str) -> bool:
    return (out / f"{stage}.done").exists() and all((out / f).exists() and (out / f).stat().st_size
                                                    for f in OUTPUTS[stage])


def write_summary(out: Path, info: dict, dry: bool) -> None:
    """SUMMARY.md: the machine, then the section of every finished stage, in stage order."""
    head = ["# GPU campaign" + (" (dry run on the CPU: no GPU result)" if dry else ""), "",
            "Written by `python -m ttt_bench.campaign` (`make gpu-campaign`); docs/gpu_campaign.md.", "",
            f"- GPU: {info['gpu']}", f"- driver: {info['driver']}",
            f"- torch {info['torch']}, CUDA {info['cuda']}, Triton {info['triton']}, Python {info['python']}",
            *([f"- nvidia-smi: {info['nvidia_smi']}"] if "nvidia_smi" in info else []), ""]
    sections = [(out / "sections" / f"{s}.md").read_text() for s in STAGES
                if (out / "sections" / f"{s}.md").exists()]
    write(out / "SUMMARY.md", "\n".join(head) + "\n" + "\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ttt_bench.campaign", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    p.add_argument("--dry", action="store_true", help="tiny, on the CPU, kernels in the Triton interpreter")
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--work", type=Path, help="run folders and caches (default: a folder under the temp dir)")
    p.add_argument("--force", action="store_true", help="run finished stages again")
    a = p.parse_args(argv)
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if not a.dry and not torch.cuda.is_available():
        print("ttt-bench campaign: no CUDA GPU here (torch.cuda.is_available() is False) and the GPU "
              "campaign needs one; dry-run it on the CPU: python -m ttt_bench.campaign --stage all --dry "
              "--out /tmp/gpu-dry", file=sys.stderr)
        return 2
    out = a.out.resolve()
    work = (a.work or Path(tempfile.gettempdir()) / f"ttt-bench-campaign-{os.getuid()}").resolve()
    # the kernel check's verdict in a cache of the campaign's own: no stale verdict from an earlier install
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg-cache")
    os.environ.setdefault("TTT_BENCH_CACHE", str(work / "cache"))
    torch.manual_seed(0)
    info = gpu_info()
    write(out / "machine.json", json.dumps(info, indent=2) + "\n")
    failed = []
    for name in STAGES if a.stage == "all" else [a.stage]:
        if finished(out, name) and not a.force:
            print(f"[campaign] {name}: finished before ({out / (name + '.done')}), skipped (--force: again)")
            continue
        (out / f"{name}.done").unlink(missing_ok=True)
        st = Stage(name, out, a.dry)
        try:
            {"check": stage_check, "bench": stage_bench, "figure3": stage_bench,
             "train": lambda s: stage_train(s, work)}[name](st)
        except Exception as e:  # noqa: BLE001  (a stage that fails leaves no marker; the next still runs)
            print(f"[campaign] {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        st.finish()
        write_summary(out, info, a.dry)
        print(f"[campaign] {name}: done; {out / 'SUMMARY.md'}", flush=True)
    write_summary(out, info, a.dry)
    if failed:
        print(f"[campaign] failed stages: {', '.join(failed)} (run them again with --stage)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
