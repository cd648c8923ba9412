"""The GPU campaign (`make gpu-campaign`, issue 33): four stages, each resumable, into one
folder (`--out`, default results/gpu/) with a markdown summary; each stage's files go to its own folder there
(FOLDERS: check/, speed/ for the bench stage, train/, figure3/; the queue's queue/).

  check  `ttt-bench doctor`; the CUDA test subset (pytest -k "triton or kernel or cuda" over test_kernels,
         test_kernel_check, test_ttt_layer, in a subprocess); the Triton TTT-Linear kernels (dual form in
         ieee and tf32 matmuls, and the decode kernel) against the PyTorch implementations run in float64, at
         head sizes 16, 32, 64, 128: outputs and gradients of every input, each as its largest error over
         the largest reference entry, within kernel_check.TOLERANCE (ieee, decode) or TF32_TOLERANCE (tf32)
         -> check/: check.csv, doctor.txt, pytest.txt
  bench  speed/: `ttt-bench bench forms` (TTT-Linear fwd+bwd: primal, dual, dual-fused, Triton at the 125m
         width) -> bench_forms.csv; `ttt-bench bench models` at 125m in bf16, prefill and decode latency per
         token at 1k-16k for transformer (SDPA), ttt_linear, ttt_mlp, mamba -> bench_models_125m.csv; the same
         at 1.3b, prefill only at 1k, 4k, 16k (Figure 3) -> bench_prefill_1.3b.csv
  train  `ttt-bench train trainer=gpu` (bf16-mixed) of each model at 125m on the synthetic corpus (no files
         needed), 20 steps of 16k tokens, one process per model: first/last losses, whether the loss fell, no
         non-finite loss and no skipped step, tokens/s and peak memory (torch.cuda.max_memory_allocated)
         -> train/: train.csv, logs/train_<model>.log (run folders, with their checkpoints, stay in --work,
         not in --out)
  figure3 Figure 3 / 15 at the paper's settings: `ttt-bench bench models` at 1.3b, prefill at batch 16 from 1k
         to 16k and at 32k, then 16k and 32k at batch 8; decode steps at 125m, batch 512, 1k and 2k
         -> figure3/: bench_prefill_1.3b_b16.csv, bench_prefill_1.3b_b16_32k.csv,
         bench_prefill_1.3b_b8_32k.csv, bench_decode_125m_b512.csv

Measured on one H200 (results/gpu/RUN.md): check 38 s, bench 161 s, train 144 s, figure3 121 s; each
stage fits a lease of 15 minutes of device time, start and install included.

A stage whose outputs exist with its marker (`<out>/<folder>/<stage>.done`) is skipped unless --force; every
file is written atomically (io.write_atomic), so a stage cut off keeps the stages before it. SUMMARY.md is
rebuilt from the finished stages' sections (<out>/sections/<stage>.md): the machine (GPU model, driver, torch,
CUDA, Triton; <out>/machine.json), each command with its wall time, and the key numbers. SUMMARY.md,
machine.json and sections/ stay at the top of --out, beside the gpu profile's step folders.

--dry runs every stage on the CPU in tiny form (size xs, short contexts, a few steps, the Triton interpreter
for the kernels, --device cpu), writing the same files: what `make test` runs (tests/test_campaign.py).
Without a GPU and without --dry the command says so in one line and exits 2.

The queue (issue 47, point 4; docs/gpu_campaign.md): `--stage queue --item NAME|next` trains one item of
QUEUE, the `PROFILE=gpu` steps that only a GPU decides, in one call of a short lease: `python -m
ttt_bench.reproduce --profile gpu --steps STEP` for at most --train-s seconds (380), then SIGTERM to its
process group (every run checkpoints at its next optimizer step and stops; SIGKILL to what is left --grace-s
later), then, unless it finished, the same with --no-train (100 s at most), so the step folder
`<out>/<step>/` holds every run finished so far, measured where their checkpoints are; a row in
`<out>/queue/queue.csv` (the call's log, `<item>.log`, beside it, or in the --pack folder). With --pack DIR
($OUT on a lease) it writes there `<item>-results.tgz` (the step folder and the reports), `<item>-runs.tgz`
(the run folders without checkpoints) and `<item>-ckpt-<k>.tgz` (the last checkpoint of each unfinished run,
most advanced first, within the item's budget), which `--unpack DIR` here puts in place: the step folder into
results/gpu, the checkpoints into .gpuruns/, which the next call carries and restores with --resume
.gpuruns. The committed registry restores the finished runs, so the same command trains only what is missing.
`--item list` prints the queue and the state of each item; `--prepare NAME` copies the corpora an item reads
into .gpudata/.
"""

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STAGES = ("check", "bench", "train", "figure3")
MODELS = ("transformer", "ttt_linear", "ttt_mlp", "mamba")
HEAD_SIZES = (16, 32, 64, 128)
PYTEST_K = "triton or kernel or cuda or fla or gpu or backend or step or decod"
PYTEST_FILES = ("tests/test_ops_ttt.py", "tests/test_kernels.py", "tests/test_kernel_check.py",
                "tests/test_ttt_layer.py", "tests/test_kernel_prefill.py", "tests/test_kernel_ttt_mlp.py",
                "tests/test_kernel_ttt_mlp_decode.py", "tests/test_kernel_ttt_mlp_layer.py",
                "tests/test_fla_parity.py", "tests/test_ops_selective_scan.py", "tests/test_layers.py",
                "tests/test_mamba.py", "tests/test_decode_graphs.py")
REPO = Path(__file__).resolve().parent.parent
# Where each stage writes under --out (issue 51): a folder per thing measured (the bench stage: speed). The
# top of --out keeps what spans the stages (SUMMARY.md, machine.json, sections/) and the gpu profile's step
# folders, REPORT.md and claims.csv, which reproduce writes and reads (<out>/<step>/).
FOLDERS = {"check": "check", "bench": "speed", "train": "train", "figure3": "figure3", "queue": "queue"}

# The `ttt-bench bench` arguments of each bench stage's parts: (real, dry).
F3 = ["--models", "transformer,ttt_linear"]
F3_1B = ["--size", "1.3b", "--dtype", "bfloat16", "--phases", "prefill"]
BENCH = {
    "bench": {
        "forms": (["--d-model", "768", "--n-heads", "12", "--seq-len", "2048", "--tokens", "16384",
                   "--repeats", "5"],
                  ["--quick", "--no-fused", "--repeats", "1", "--warmup", "0", "--device", "cpu"]),
        # the inner loop alone at 1.3b's head shape (32 heads of 64), fla beside it where installed
        "forms_1.3b": (["--d-model", "2048", "--n-heads", "32", "--seq-len", "2048", "--tokens", "16384",
                        "--scopes", "core", "--repeats", "5"],
                       ["--quick", "--no-fused", "--scopes", "core", "--repeats", "1", "--warmup", "0",
                        "--device", "cpu"]),
        # where one block's forward and backward spend their time at 1.3b (issue 48's profile)
        "profile_1.3b": (["--models", "ttt_linear,transformer", "--size", "1.3b", "--seq-len", "2048",
                          "--batch", "4", "--dtype", "bfloat16", "--top", "20"],
                         ["--models", "ttt_linear", "--size", "xs", "--seq-len", "32", "--top", "5",
                          "--warmup", "0", "--device", "cpu"]),
        "models_125m": (["--size", "125m", "--dtype", "bfloat16", "--phases", "prefill,decode", "--contexts",
                         "1024-16384", "--batch", "4", "--decode-batch", "16", "--repeats", "2",
                         "--decode-graphs", "both"],
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
    # Mamba scan's prefill of 512 x 1k tokens does not fit either. The verdict reads batch 16 only: 3 repeats
    # (engine/timing.py: a timing verdict needs the median of 3).
    "figure3": {
        part: ([*F3, *real], [*F3, "--preset", "quick", "--warmup", "0", "--device", "cpu", *dry])
        for part, real, dry in [
            ("prefill_1.3b_b16", [*F3_1B, "--contexts", "1024-16384", "--batch", "16", "--repeats", "3"],
             ["--phases", "prefill", "--contexts", "64,128", "--batch", "2", "--repeats", "1"]),
            ("prefill_1.3b_b16_32k", [*F3_1B, "--contexts", "32768", "--batch", "16", "--repeats", "1"],
             ["--phases", "prefill", "--contexts", "256", "--batch", "2", "--repeats", "1"]),
            ("prefill_1.3b_b8_32k", [*F3_1B, "--contexts", "16384,32768", "--batch", "8", "--repeats", "1"],
             ["--phases", "prefill", "--contexts", "128,256", "--batch", "1", "--repeats", "1"]),
            ("decode_125m_b512", ["--size", "125m", "--dtype", "bfloat16", "--phases", "decode", "--contexts",
                                  "1024,2048", "--decode-batch", "512", "--decode-tokens", "8",
                                  "--decode-graphs", "both"],
             ["--phases", "decode", "--contexts", "64", "--decode-batch", "8", "--decode-tokens", "2"]),
        ]
    },
}
BENCH_OUT = {part: f"bench_{part}.csv" for parts in BENCH.values() for part in parts}
# Each stage's files, in its folder (stage_dir).
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


def stage_dir(out: Path, stage: str) -> Path:
    """The folder of a stage's files and its `<stage>.done` marker under --out (FOLDERS)."""
    return out / FOLDERS[stage]


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
        self.dir = stage_dir(out, name)  # the stage's files; sections/ and SUMMARY.md stay in out
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
        write(self.dir / f"{self.name}.done", json.dumps({"finished": time.strftime("%Y-%m-%d %H:%M:%S"),
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
            name, precision, tol = case.name, case.precision, case.tolerance
            # "dual" is dual/ieee
            kernel_name = name if "/" in name or name.endswith("decode") else f"dual/{precision}"
            row = dict(kernel=kernel_name, precision=precision, head_size=f, device=str(device),
                       interpreter=os.environ.get("TRITON_INTERPRET") == "1", tolerance=tol)
            dual = kernel_check._inputs(device, f=f)  # the dual form's domain decides for both kernels
            if why := ttt_linear.why_not(dual[0], dual[6], dual[7], dual[4].shape[0]):
                rows.append({**row, "status": "unsupported", "note": f"PyTorch path: {why}"})
                continue
            try:
                with torch.autocast(torch.device(device).type, enabled=False), torch.enable_grad():
                    errs = kernel_check.kernel_errors(case.kernel, double(case.reference), case.inputs,
                                                      case.seed, case.backward)
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
    write(st.dir / "doctor.txt", "\n".join(doc) + "\n")
    files = PYTEST_FILES if not st.dry else ("tests/test_kernel_check.py",)  # dry: one file, the same -k
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", PYTEST_K]
    done = st.run(argv, shown=shlex.join(["pytest", "-q", *files, "-k", PYTEST_K]))
    write(st.dir / "pytest.txt", done.output)
    tail = [ln for ln in done.output.strip().splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    line = tail[-1].strip("= ") if tail else f"no summary line (exit {done.returncode})"
    st.numbers.append(f"CUDA test subset: {line}")
    device = torch.device("cpu" if st.dry else "cuda")
    rows = st.timed(f"Triton kernels vs float64 PyTorch at head sizes {HEAD_SIZES} on {device}",
                    lambda: kernel_rows(device, st.dry))
    df = pd.DataFrame(rows)
    write(st.dir / "check.csv", df.to_csv(index=False))
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


def suite_of(part: str) -> str:
    """The `ttt-bench bench` suite of a bench stage's part: forms_*, profile_*, else models."""
    return part.split("_")[0] if part.split("_")[0] in ("forms", "profile") else "models"


def stage_bench(st: Stage) -> None:
    from ttt_bench.bench.models import summary as models_summary
    from ttt_bench.bench.profile import summary as profile_summary

    for part, (real, dry) in BENCH[st.name].items():
        suite = suite_of(part)
        argv = dry if st.dry else real
        out = st.dir / BENCH_OUT[part]
        df = st.timed(shlex.join(["ttt-bench", "bench", suite, *argv, "--out", str(out)]),
                      lambda suite=suite, argv=argv, out=out: run_suite(suite, argv, out))
        if suite == "forms":
            for _, r in df.iterrows():
                st.numbers.append(f"{part} {r['scope']} {r['impl']}: {r['ms_fwd_bwd']:.2f} ms fwd+bwd, "
                                  f"{r['speedup_vs_dual']:.2f}x the dual form's speed")
        elif suite == "profile":
            st.numbers += [f"{part}: {line}" for line in profile_summary(df)]
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
        logs = st.dir / "logs"
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
        write(st.dir / "train.csv", pd.DataFrame(rows).to_csv(index=False))  # a stage cut off keeps its rows


# -- queue (issue 47, point 4) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One item of the GPU queue: a `PROFILE=gpu` step trained in calls of at most TRAIN_S seconds."""

    name: str  # the item's name (--item), its files' prefix
    step: str  # the reproduce step it trains (conf/sweep/<step>.yaml's gpu profile)
    letter: str  # issue 47's point 4: (a) Table 1, (b) MTTT, (c) long context, (d) recall, (e) long range
    corpora: tuple[str, ...]  # folders of --data-dir it reads: what a lease carries in .gpudata/
    jobs: int  # runs at once on the one GPU (reproduce --jobs: Hydra's joblib workers, a process each)
    calls: int  # calls of TRAIN_S estimated to finish the step (docs/gpu_campaign.md shows the arithmetic)
    ckpt_mib: int  # unfinished runs' checkpoints brought back and carried next time: what a call's 64 MiB
    #                leaves beside the tracked files (~11 MiB), the wheels (~7 MiB) and the corpora
    decides: str  # the claims it moves, for --item list
    waits: str = ""  # what it waits on before it can run (skipped by --item next)


# Highest value per device-minute first (docs/gpu_campaign.md, "The queue").
QUEUE = (
    Item("scaling", "scaling", "c1", ("books-mini",), 3, 1, 15,
         "long context: TTT-Linear (M) vs Mamba, Mamba's plateau (Mamba's 3 runs; the rest restored)"),
    Item("table1", "table1", "a", ("pile-mini",), 4, 4, 30, "Table 1's 9 claims at 2,048 bytes, 3 seeds"),
    Item("mttt_patches", "mttt_patches", "b1", ("fashion-mnist",), 8, 4, 12,
         "MTTT Table 1, Figures 1/3 (5 claims; 2 under-trained on the CPU)"),
    Item("mttt_pixels", "mttt_pixels", "b2", ("fashion-mnist",), 8, 4, 12,
         "MTTT Table 3 on all 784 pixels (3 claims, not tested on the CPU)"),
    Item("mttt_ablation", "mttt_ablation", "b3", ("fashion-mnist",), 8, 3, 12,
         "MTTT Table 2: Decoder LN, trained W_0 (2 claims)"),
    Item("recall", "recall", "d", (), 8, 3, 30,
         "recall at 256 tokens, 16 pairs: 3 claims and its calibration"),
    Item("longrange", "longrange", "e", (), 4, 3, 30,
         "long range, the Transformer as positive control: 2 claims"),
    Item("scaling_ttt_mlp", "scaling", "c2", ("books-mini",), 3, 1, 15,
         "long context: TTT-MLP (M) vs Mamba (its 3 runs at 34,816 bytes)",
         waits="TTT-MLP's training speed on the GPU (its Triton forward and backward exist, issue 49; "
               "scripts/gpu_speed_lease.sh's train part measures it); then scaling.yaml's gpu "
               "books_methods and matched_methods gain ttt_mlp_m"),
)
TRAIN_S, GRACE_S, TABULATE_S = 380, 30, 100  # + install ~30 s + pack ~10 s: inside a 600-s device call
FILE_MIB = 15  # each file a call brings back: under a lease's 16 MiB a file
DRY_TRAIN_S, DRY_GRACE_S = 3, 5


def queue_item(name: str, out: Path) -> Item:
    """The item called `name`, or for "next" the first that waits on nothing and has not finished in out."""
    if name == "next":
        for item in QUEUE:
            if not item.waits and not step_state(out, item.step)[0]:
                return item
        raise SystemExit("ttt-bench campaign: every queue item that can run has finished (--item list)")
    found = [item for item in QUEUE if item.name == name]
    if not found:
        names = ", ".join(i.name for i in QUEUE)
        raise SystemExit(f"ttt-bench campaign: no queue item {name!r}; one of {names}, next, list")
    return found[0]


def step_state(out: Path, step: str) -> tuple[bool, str]:
    """Whether the step folder out/<step> holds every run of its gpu profile finished (its registry: every
    row finished, and step.json's part, if any, the last), and a line saying how far it is."""
    import pandas as pd

    reg, meta = out / step / "registry.csv", out / step / "step.json"
    if not reg.is_file():
        return False, "not run"
    df = pd.read_csv(reg)
    part = json.loads(meta.read_text()).get("part") if meta.is_file() else None
    last_part = part is None or len(set(str(part).split(" of "))) == 1
    finished = int((df["status"] == "finished").sum())
    failed = int((df["status"] == "failed").sum())
    line = f"{finished} of {len(df)} runs finished" + (f", {failed} failed" if failed else "")
    line += f" (part {part})" if part and part != "1 of 1" else ""
    return bool(last_part and finished == len(df)), line


def print_queue(out: Path) -> None:
    nxt = next((i.name for i in QUEUE if not i.waits and not step_state(out, i.step)[0]), None)
    print(f"{'item':<20} {'step':<14} {'jobs':>4} {'calls':>5}  state")
    for item in QUEUE:
        done, line = step_state(out, item.step)
        if item.waits:
            state = f"waits: {item.waits}"
        else:
            state = "done" if done else ("NEXT: " if item.name == nxt else "") + line
        print(f"{item.letter + ' ' + item.name:<20} {item.step:<14} {item.jobs:>4} {item.calls:>5}  {state}")
        print(f"{'':<20} decides: {item.decides}")


def reproduce_argv(item: Item, out: Path, data_dir: str, runs: Path, train: bool = True) -> list[str]:
    """The item's command: `python -m ttt_bench.reproduce --profile gpu --steps STEP` into <out>'s parent
    (reproduce writes <root>/gpu/<step>/), with --no-train to tabulate what finished."""
    argv = [sys.executable, "-m", "ttt_bench.reproduce", "--profile", "gpu", "--steps", item.step,
            "--data-dir", data_dir, "--out", str(out.parent), "--runs", str(runs), "--jobs", str(item.jobs)]
    return argv if train else [*argv, "--no-train"]


# A stand-in for reproduce in --dry: one run finishes, one is still training when the cap's SIGTERM comes
# and checkpoints (as StopOnSignal does); --no-train writes the step folder from them.
DRY_REPRODUCE = r"""
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
get = lambda k: args[args.index(k) + 1]
step, runs, root = get("--steps"), Path(get("--runs")), Path(get("--out"))
folder = runs / step
def run(name, finished):
    d = folder / name / "checkpoints"
    d.mkdir(parents=True, exist_ok=True)
    (d / "last.ckpt").write_bytes(os.urandom(4096))
    (d.parent / "metrics.json").write_text(json.dumps({"status": "finished" if finished else "running"}))
    (d.parent / "losses.csv").write_text("step,loss\n0,5.0\n")
if "--no-train" in args:
    rows = [(p.parent.name, json.loads(p.read_text())["status"])
            for p in sorted(folder.glob("*/metrics.json"))]
    out = root / "gpu" / step
    out.mkdir(parents=True, exist_ok=True)
    (out / "registry.csv").write_text("run,status\n" + "".join(
        f"{r},{'finished' if s == 'finished' else 'pending'}\n" for r, s in rows))
    (out / "step.json").write_text(json.dumps({"part": "1 of 1", "tabulated_only": True}))
    (root / "gpu" / "REPORT.md").write_text("# dry\n")
    sys.exit(0)
resumed = (folder / "b-s0" / "checkpoints" / "last.ckpt").is_file()
print(f"dry reproduce {step}: b-s0 {'resumed from its checkpoint' if resumed else 'new'}", flush=True)
run("a-s0", True)
def stop(signum, frame):
    run("b-s0", False)
    print("dry reproduce: SIGTERM, b-s0 checkpointed", flush=True)
    sys.exit(130)
signal.signal(signal.SIGTERM, stop)
time.sleep(600)
"""


def run_capped(argv: list[str], log, cap: float, grace: float) -> tuple[int | None, bool, float]:
    """argv in its own process group, its output appended to `log`; at `cap` seconds SIGTERM to the group
    (a training run checkpoints at its next optimizer step and stops), SIGKILL `grace` seconds later.
    Returns (exit status or None if killed, whether the cap was reached, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    capped = False
    try:
        proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        capped = True
        print(f"[campaign] queue: {cap:.0f} s reached: SIGTERM to the runs, SIGKILL to what is left "
              f"{grace:.0f} s later", flush=True)
        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace  # the workers outlive reproduce's own process: wait for them all
        while _group_alive(proc) and time.monotonic() < deadline:
            time.sleep(0.2)
    _signal_group(proc, signal.SIGKILL)  # what is left, and workers a finished reproduce left behind
    proc.wait()
    return proc.returncode, capped, time.perf_counter() - start


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the call's process group is still there (its leader reaped once it exits)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _finished(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "metrics.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def _progress(run_dir: Path) -> int:
    """The optimizer step of a run's newest checkpoint (step-N.ckpt), 0 when none says."""
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step-*.ckpt")
             if (m := re.match(r"step-(\d+)\.ckpt$", p.name))]
    return max(steps, default=0)


def _tar(path: Path, members: list[tuple[Path, str]]) -> int:
    """A gzipped tar of (file, name in the archive); its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for file, arcname in members:
            tar.add(file, arcname=arcname, recursive=False)
    return path.stat().st_size


def pack(item: Item, out: Path, runs: Path, dest: Path, log, ckpt_mib: float | None = None) -> list[str]:
    """What a lease brings back ($OUT): the step folder and the reports (<item>-results.tgz, names relative
    to the results root's parent), the run folders without checkpoints (<item>-runs.tgz), and the last
    checkpoint of each unfinished run, most advanced first, within `ckpt_mib` (the item's by default), in
    files of at most FILE_MIB (<item>-ckpt-<k>.tgz, names relative to the runs root). Returns lines for the
    log."""
    budget = (item.ckpt_mib if ckpt_mib is None else ckpt_mib) * 2**20
    lines, base = [], out.parent.parent
    results = [p for p in sorted((out / item.step).rglob("*")) if p.is_file()]
    reports = (out / "REPORT.md", out / "claims.csv", stage_dir(out, "queue") / "queue.csv",
               out.parent / "REPORT.md")
    results += [p for p in reports if p.is_file()]
    size = _tar(dest / f"{item.name}-results.tgz", [(p, str(p.relative_to(base))) for p in results])
    lines.append(f"{item.name}-results.tgz: {len(results)} files, {size / 2**20:.2f} MiB")
    folder = runs / item.step
    run_dirs = sorted({p.parent for p in folder.rglob("metrics.json")} |
                      {p.parent.parent for p in folder.rglob("checkpoints/last.ckpt")})
    records = [p for d in run_dirs for p in sorted(d.rglob("*"))
               if p.is_file() and p.suffix not in (".ckpt", ".pt") and "checkpoints" not in p.parts]
    size = _tar(dest / f"{item.name}-runs.tgz", [(p, str(p.relative_to(runs))) for p in records])
    if size > FILE_MIB * 2**20:
        (dest / f"{item.name}-runs.tgz").unlink()
        lines.append(f"{item.name}-runs.tgz left out: {size / 2**20:.1f} MiB > {FILE_MIB} MiB")
    else:
        lines.append(f"{item.name}-runs.tgz: {len(run_dirs)} run folders, {size / 2**20:.2f} MiB")
    unfinished = sorted((d for d in run_dirs
                         if not _finished(d) and (d / "checkpoints" / "last.ckpt").is_file()),
                        key=lambda d: (-_progress(d), str(d)))
    files: list[list[tuple[Path, str]]] = []  # each file's members, at most FILE_MIB of checkpoints each
    room, total, left = [], 0, []
    for d in unfinished:
        ckpt = d / "checkpoints" / "last.ckpt"
        nbytes = ckpt.stat().st_size
        fits = [k for k, r in enumerate(room) if r >= nbytes]
        if total + nbytes > budget or nbytes > FILE_MIB * 2**20:
            left.append(d.name)
            continue
        if not fits:
            files.append([])
            room.append(FILE_MIB * 2**20)
            fits = [len(files) - 1]
        k = fits[0]
        room[k] -= nbytes
        total += nbytes
        files[k] += [(p, str(p.relative_to(runs))) for p in sorted(d.rglob("*"))
                     if p.is_file() and (p.suffix not in (".ckpt", ".pt") or p == ckpt)]
    for k, members in enumerate(files):
        size = _tar(dest / f"{item.name}-ckpt-{k}.tgz", members)
        n = sum(m[1].endswith("last.ckpt") for m in members)
        lines.append(f"{item.name}-ckpt-{k}.tgz: last checkpoints of {n} unfinished runs, "
                     f"{size / 2**20:.2f} MiB (carried in .gpuruns next time)")
    if left:
        lines.append(f"checkpoints over the item's {budget / 2**20:g} MiB left behind (those runs start "
                     "again): " + ", ".join(left))
    for line in lines:
        print(f"[campaign] queue: {line}", file=log, flush=True)
    return lines


def _extract(archive: Path, into: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        if any(n.startswith("/") or ".." in Path(n).parts for n in names):
            raise SystemExit(f"ttt-bench campaign: {archive} holds a path outside its folder")
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # Python without tarfile filters
            tar.extractall(into)
    return names


def unpack(src: Path, into: Path = REPO) -> None:
    """Put what a queue call brought back in place: <item>-results.tgz into the repository (results/gpu/...),
    <item>-runs.tgz into runs/gpu-queue/ (ignored), <item>-ckpt-<k>.tgz into .gpuruns/ for the next call
    (the item's older ones are removed: a call that brought none back left nothing to resume)."""
    for item in QUEUE:
        results = src / f"{item.name}-results.tgz"
        if not results.is_file():
            continue
        names = _extract(results, into)
        print(f"[campaign] unpack: {len(names)} files of {results.name} into {into}")
        if (runs := src / f"{item.name}-runs.tgz").is_file():
            _extract(runs, into / "runs" / "gpu-queue")
            print(f"[campaign] unpack: {runs.name} into {into / 'runs' / 'gpu-queue'}")
        kept = into / ".gpuruns"
        for old in kept.glob(f"{item.name}-ckpt-*.tgz"):
            old.unlink()
        for ckpt in sorted(src.glob(f"{item.name}-ckpt-*.tgz")):
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ckpt, kept / ckpt.name)
            print(f"[campaign] unpack: {ckpt.name} into {kept} (carry .gpuruns in the next call)")


def prepare(item: Item, data_dir: Path, into: Path = REPO) -> None:
    """Copy the corpora the item reads from data_dir into .gpudata/ (and nothing else there), and say what a
    lease call carries."""
    gpudata = into / ".gpudata"
    for old in gpudata.iterdir() if gpudata.is_dir() else []:
        if old.name not in item.corpora:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    gpudata.mkdir(exist_ok=True)
    for corpus in item.corpora:
        if not (data_dir / corpus).is_dir():
            raise SystemExit(f"ttt-bench campaign: {data_dir / corpus} is not a folder; --data-dir names the "
                             "folder with pile-mini/, books-mini/ and fashion-mnist/")
        if not (gpudata / corpus).is_dir():
            shutil.copytree(data_dir / corpus, gpudata / corpus)
            for p in (gpudata / corpus).rglob("*"):
                p.chmod(0o755 if p.is_dir() else 0o644)
    mib = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20 if p.is_dir() else 0.0
    carried = {name: mib(into / name) for name in (".whl", ".gpudata", ".gpuruns")}
    holds = ", ".join(item.corpora) or "nothing (generated data)"
    print(f"[campaign] prepare {item.name}: .gpudata holds {holds}; "
          + ", ".join(f"{k} {v:.1f} MiB" for k, v in carried.items())
          + "; with the tracked files a call carries at most 64 MiB")
    print(f"run: bash scripts/gpu_queue.sh {item.name}   (carry .whl, .gpudata, .gpuruns; timeout_s 600)")


def run_queue_item(item: Item, out: Path, data_dir: str, runs: Path, dry: bool, train_s: float,
                   grace_s: float, resume: Path | None, dest: Path | None, ckpt_mib: float | None) -> int:
    """One call of the queue: restore carried checkpoints, train the item's step for at most train_s, tabulate
    what finished, record the call in <out>/queue/queue.csv, pack for the way back. Exit 0 unless reproduce
    failed (a run's own failure is in the step's registry; the cap is no failure)."""
    import pandas as pd

    if out.name != "gpu":
        raise SystemExit("ttt-bench campaign: the queue writes <results>/gpu/<step>/ (reproduce --out "
                         f"<results>): --out must be a folder named gpu, not {out}")
    runs.mkdir(parents=True, exist_ok=True)
    logs = dest or stage_dir(out, "queue")
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{item.name}.log"
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(log_path, "a") as log:
        for carried in sorted(resume.glob(f"{item.name}-ckpt-*.tgz")) if resume is not None else []:
            names = _extract(carried, runs)
            print(f"[campaign] queue: {len(names)} files of unfinished runs restored from {carried}",
                  file=log, flush=True)
        real = reproduce_argv(item, out, data_dir, runs)
        tab = reproduce_argv(item, out, data_dir, runs, train=False)
        stand_in = [sys.executable, "-c", DRY_REPRODUCE]
        shown = shlex.join(["python", *real[1:]])
        print(f"[campaign] queue {item.letter} {item.name}: {shown} (at most {train_s:.0f} s)", flush=True)
        print(f"[campaign] queue: {shown}" + (" (dry: a stand-in runs)" if dry else ""), file=log, flush=True)
        code, capped, wall = run_capped([*stand_in, *real[3:]] if dry else real, log, train_s, grace_s)
        tab_code, tab_wall = None, 0.0
        if code != 0:
            tab_code, _, tab_wall = run_capped([*stand_in, *tab[3:]] if dry else tab, log, TABULATE_S, 10)
        done, state = step_state(out, item.step)
        row = {"item": item.name, "step": item.step, "started": started, "dry": dry,
               "machine": gpu_info()["gpu"], "train_cap_s": train_s, "train_s": round(wall, 1),
               "exit": code, "capped": capped, "tabulate_s": round(tab_wall, 1), "tabulate_exit": tab_code,
               "state": state, "done": done}
        queue_csv = stage_dir(out, "queue") / "queue.csv"
        old = pd.read_csv(queue_csv) if queue_csv.is_file() else pd.DataFrame()
        write(queue_csv, pd.concat([old, pd.DataFrame([row])], ignore_index=True).to_csv(index=False))
        summary = (f"[campaign] queue {item.name}: trained {wall:.0f} s"
                   f"{' (cap reached)' if capped else ''}, exit {code}; {state}{'; done' if done else ''}")
        print(summary, flush=True)
        print(summary, file=log, flush=True)
        if dest is not None:
            for line in pack(item, out, runs, dest, log, ckpt_mib):
                print(f"[campaign] queue: {line}", flush=True)
    return 1 if (code != 0 and not capped) or tab_code not in (0, None) else 0


# -- driver ------------------------------------------------------------------------------------------------


def finished(out: Path, stage: str) -> bool:
    folder = stage_dir(out, stage)
    return (folder / f"{stage}.done").exists() and all((folder / f).exists() and (folder / f).stat().st_size
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
    p.add_argument("--stage", choices=[*STAGES, "all", "queue"], default="all")
    p.add_argument("--dry", action="store_true", help="tiny, on the CPU, kernels in the Triton interpreter "
                   "(queue: a stand-in for reproduce, with the real caps and packing)")
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--work", type=Path, help="run folders and caches (default: a folder under the temp dir)")
    p.add_argument("--force", action="store_true", help="run finished stages again")
    q = p.add_argument_group("queue (docs/gpu_campaign.md)")
    q.add_argument("--item", default="next", help="the queue item: a name in QUEUE, next (the first that can "
                   "run and has not finished in --out) or list (print the queue)")
    q.add_argument("--data-dir", default=".gpudata", help="the corpora (default .gpudata, carried)")
    q.add_argument("--runs", type=Path, help="run folders (default: <work>/runs)")
    q.add_argument("--train-s", type=float, help=f"training cap, s (default {TRAIN_S}, dry {DRY_TRAIN_S})")
    q.add_argument("--grace-s", type=float, help=f"SIGTERM to SIGKILL (default {GRACE_S}; dry {DRY_GRACE_S})")
    q.add_argument("--resume", type=Path, help="a folder with the last call's <item>-ckpt-*.tgz (.gpuruns)")
    q.add_argument("--pack", type=Path, help="write <item>-results/-runs/-ckpt-*.tgz here ($OUT on a lease)")
    q.add_argument("--ckpt-mib", type=float, help="checkpoints packed at most, MiB (default: the item's)")
    q.add_argument("--unpack", type=Path, help="put a call's files in place here, then stop")
    q.add_argument("--prepare", metavar="ITEM", help="copy the item's corpora from --data-dir into .gpudata")
    a = p.parse_args(argv)
    out = a.out.resolve()
    if a.unpack:
        unpack(a.unpack.resolve())
        print_queue(out)
        return 0
    if a.prepare:
        prepare(queue_item(a.prepare, out), Path(a.data_dir).resolve())
        return 0
    if a.stage == "queue" and a.item == "list":
        print_queue(out)
        return 0
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if not a.dry and not torch.cuda.is_available():
        print("ttt-bench campaign: no CUDA GPU here (torch.cuda.is_available() is False) and the GPU "
              "campaign needs one; dry-run it on the CPU: python -m ttt_bench.campaign --stage all --dry "
              "--out /tmp/gpu-dry", file=sys.stderr)
        return 2
    work = (a.work or Path(tempfile.gettempdir()) / f"ttt-bench-campaign-{os.getuid()}").resolve()
    if a.stage == "queue":
        item = queue_item(a.item, out)
        train_s = a.train_s if a.train_s is not None else (DRY_TRAIN_S if a.dry else TRAIN_S)
        grace_s = a.grace_s if a.grace_s is not None else (DRY_GRACE_S if a.dry else GRACE_S)
        runs, resume, dest = (a.runs or work / "runs").resolve(), a.resume and a.resume.resolve(), a.pack
        return run_queue_item(item, out, a.data_dir, runs, a.dry, train_s, grace_s, resume,
                              dest and dest.resolve(), a.ckpt_mib)
    # the kernel check's verdict in a cache of the campaign's own: no stale verdict from an earlier install
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg-cache")
    os.environ.setdefault("TTT_BENCH_CACHE", str(work / "cache"))
    torch.manual_seed(0)
    info = gpu_info()
    write(out / "machine.json", json.dumps(info, indent=2) + "\n")
    failed = []
    for name in STAGES if a.stage == "all" else [a.stage]:
        if finished(out, name) and not a.force:
            print(f"[campaign] {name}: finished before ({stage_dir(out, name) / (name + '.done')}), skipped "
                  "(--force: again)")
            continue
        (stage_dir(out, name) / f"{name}.done").unlink(missing_ok=True)
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


if __name__ == "__main__":
    sys.exit(main())
