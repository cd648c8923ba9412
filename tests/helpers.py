"""Plain functions the test modules share (fixtures and constants are in conftest.py): a test module never
imports another's."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import zstandard
from ttt_bench.cli.main import main

from tests.conftest import REPO, SWEEP_RUN

# -- the command line ----------------------------------------------------------------------------------------


def tiny_model(name: str, *overrides: str) -> torch.nn.Module:
    """The language model `name` at size xs, vocabulary 97, float64, in eval mode, seeded."""
    from hydra.utils import instantiate

    from ttt_bench.config import compose

    cfg = compose("train", [f"model={name}", "size=xs", "data.seq_len=64", *overrides])
    torch.manual_seed(0)
    return instantiate(cfg.model, vocab_size=97).double().eval()


def run_cli(*args: str) -> None:
    """`ttt-bench args`, in-process; it must succeed."""
    try:
        main(list(args))
    except SystemExit as e:
        assert e.code in (0, None), f"ttt-bench {' '.join(args)} exited with {e.code}"


def cli_error(capsys, tmp_path, *argv: str) -> str:
    """Run `ttt-bench argv` with outputs under tmp_path; return its one-line error."""
    with pytest.raises(SystemExit) as e:
        main([*argv, f"paths.runs={tmp_path / 'runs'}"] if argv[0] in ("train", "eval") else list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ttt-bench: error: "), err
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "output folder left behind"
    return err


def find_run(root: str, *parts: str) -> Path:
    """The one run folder under root whose metrics.json path holds every one of parts."""
    runs = [p.parent for p in Path(root).rglob("metrics.json") if all(s in str(p) for s in parts)]
    assert len(runs) == 1, runs
    return runs[0]


def commands_in(markdown: str) -> list[str]:
    """The `ttt-bench ...` lines of the bash blocks of a piece of markdown."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s+#", line)[0].strip()
            line = re.sub(r"^([A-Z_]+=\S+\s+)+", "", line)  # environment settings before the command
            if line.startswith("ttt-bench "):
                commands.append(" ".join(line.split()))
    return commands


# -- data and sweeps ---------------------------------------------------------------------------------------


def write_shard(path, records):
    """A Pile-format shard (zstd-compressed JSON lines; a bytes record is written as is); returns its path."""
    lines = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)
    path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    return str(path)


SWEEP_MODELS = ("transformer", "linear_attention", "ttt_linear", "ttt_mlp", "mamba")


def require_models():
    """Skip where a model config the sweeps plan is not there."""
    missing = [m for m in SWEEP_MODELS if not (REPO / "conf" / "model" / f"{m}.yaml").is_file()]
    if missing:
        pytest.skip(f"model configs not there yet: {', '.join(missing)}")


def two_runs(*extra: str) -> dict:
    """A sweep's plan of two tiny Transformer runs, a (seed 0) and b (seed 1), with `extra` overrides: the
    finished sweep folder of tests/test_sweep_folder.py (tests/faults.py trains it in a process it kills)."""
    from ttt_bench.experiments.engine.plan import configuration

    return {n: configuration(n, [*SWEEP_RUN, "model=transformer", f"seed={i}", *extra], "Transformer")
            for i, n in enumerate(("a", "b"))}


# -- made-up registries and measurements for the figures (tests/test_figures.py, test_readme.py) ------------

SIZES = ("xs", "s", "m")
SEEDS = (0, 1, 2)
CORPUS = {"pile": "pile-mini", "books": "books-mini"}


def _run(rng, role, method, label, size, T, seed, flops, ppl, **extra) -> dict:
    config = f"{role}-{method}-{size}-T{T}" + extra.pop("suffix", "")
    return {
        "run": f"{config}-s{seed}",
        "config": config,
        "seed": seed,
        "sweep": "scaling",
        "profile": "cpu",
        "label": label,
        "method": method,
        "role": role,
        "corpus": CORPUS[role],
        "size": size,
        "seq_len": T,
        "status": "finished",
        "total_train_flops": flops,
        "val_ppl": ppl * float(np.exp(rng.normal(0, 0.04))),
        "matched": None,
        "reference": None,
        **extra,
    }


def scaling_registry(sweep_dir=None, seed: int = 0) -> pd.DataFrame:
    """Transformer and TTT-Linear (M) at 3 sizes x 3 seeds per panel, TF finetune on Books, Mamba at one
    size only (a single point), matched-FLOPs runs at the largest size of Books 512, a failed run; with
    `sweep_dir`, every run's token_index.csv."""
    rng = np.random.default_rng(seed)
    grid = (  # (method, label, FLOPs factor, perplexity at xs, drop per size); TF finetune on Books 512 only
        ("transformer", "Transformer", 1.1, 30.0, 1.6),
        ("ttt_linear_m", "TTT-Linear (M)", 0.8, 27.0, 1.65),
        ("tf_finetune", "TF finetune", 1.2, 28.0, 1.6),
    )
    rows = []
    for role, contexts in (("pile", (256,)), ("books", (128, 512))):
        for T in contexts:
            for i, size in enumerate(SIZES):
                for method, label, f, ppl, drop in grid:
                    if method != "tf_finetune" or (role, T) == ("books", 512):
                        for s in SEEDS:
                            rows.append(
                                _run(rng, role, method, label, size, T, s, 4e11 * 6**i * f, ppl / drop**i)
                            )
            for s in SEEDS:
                rows.append(_run(rng, role, "mamba", "Mamba", "m", T, s, 4e11 * 36 * 0.9, 11.0))
    ref = "books-mamba-m-T512"
    matched = (  # (method, label, T, flops, ppl, matched): the last is the pretraining of a matched finetune
        ("transformer", "Transformer", 512, 1.3e13, 12.5, "depth"),
        ("ttt_linear_m", "TTT-Linear (M)", 512, 1.3e13, 9.5, "width"),
        ("transformer", "Transformer", 128, 1.0e13, 40.0, None),
    )
    for method, label, T, flops, ppl, by in matched:
        for s in SEEDS:
            extra = {"matched": by, "reference": ref} if by else {}
            rows.append(_run(rng, "books", method, label, "m", T, s, flops, ppl, suffix="-matched", **extra))
    rows.append(
        {**rows[0], "run": "pile-x-failed", "config": "pile-x-failed", "status": "failed", "val_ppl": None}
    )
    reg = pd.DataFrame(rows)
    if sweep_dir is not None:
        t = np.arange(1, 513)
        for r in reg.itertuples():
            if r.status != "finished":
                continue
            floor = math.log(r.val_ppl) - 0.3
            loss = floor + 2.6 * t**-0.45 + rng.normal(0, 0.15, len(t))
            d = sweep_dir / r.run
            d.mkdir(parents=True, exist_ok=True)
            pd.DataFrame({"token_index": t, "loss": loss}).to_csv(d / "token_index.csv", index=False)
    return reg


def minibatch_registry(seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    bs = ["1", "2", "4", "8", "16", "32", "64", "T"]
    paper = {"1": 10.97, "16": 11.09, "T": 12.60}
    rows = [
        {
            "run": f"b{b}-s{s}",
            "config": f"b{b}",
            "seed": s,
            "sweep": "minibatch",
            "profile": "cpu",
            "label": f"b={b}",
            "mini_batch": b,
            "paper_ppl": paper.get(b),
            "status": "finished",
            "val_ppl": (15.8 + 0.1 * i) * float(np.exp(rng.normal(0, 0.01))),
            "seq_len": 128,
            "role": "pile",
            "corpus": "pile-mini",
            "model": "ttt_linear",
            "size": "xs",
            "total_train_flops": 7e11,
        }
        for i, b in enumerate(bs)
        for s in SEEDS
    ]
    timing = pd.DataFrame(
        {
            "mini_batch": [1, 2, 4, 8, 16, 32, 64, 1024],
            "total_ms": [57.2, 33.4, 18.2, 11.5, 8.0, 6.4, 6.0, 38.1],
            "w_ms": [40.3, 22.9, 12.2, 7.3, 4.7, 3.6, 2.9, 12.2],
            "seq_len": 1024,
        }
    )
    return pd.DataFrame(rows), timing


def inner_losses() -> pd.DataFrame:
    t = np.arange(1, 129)
    return pd.concat(
        pd.DataFrame(
            {"layer": layer, "position": t, "w0": 40 - 0.05 * t, "prev": 10 - 0.02 * t, "now": 8 - 0.02 * t}
        )
        for layer in range(4)
    )


def latency_bench() -> pd.DataFrame:
    rows = [
        {
            "model": m,
            "context": c,
            "phase": ph,
            "batch": 1,
            "device": "cpu",
            "dtype": "float32",
            "threads": 2,
            "latency_ms_per_token": k * (c / 1024 if m == "transformer" and ph == "decode" else 1.0),
        }
        for ph, scale in (("prefill", 0.1), ("decode", 4.0))
        for m, k0 in (("transformer", 1.0), ("mamba", 2.0), ("ttt_linear", 1.1), ("ttt_mlp", 1.6))
        for c in (1024, 2048, 4096, 8192)
        for k in (scale * k0,)
    ]
    return pd.DataFrame(rows)
