"""Every subcommand with generated values for its options and config keys (issue 34, point 7): whatever the
value, the command ends with exit 0 or a one-line error (exit 2), never a traceback; it leaves no
half-written file (`.*.tmp`) and changes nothing that existed before it (a finished run, its checkpoint).

Values are drawn by hypothesis from a mix of numbers (negative, zero, huge, nan, inf), text (spaces, commas,
quotes, non-ASCII, empty) and the option's valid examples. Budget-like values that are valid stay small
(a valid `trainer.max_steps` is at most 3), so a draw that trains finishes in seconds. About 90 s."""

import contextlib
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz needs hypothesis (the dev extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ttt_bench.cli.main import main  # noqa: E402

from tests.conftest import TINY  # noqa: E402

# A tiny language-model run: 2 steps of 4 sequences of 32 bytes on a small synthetic corpus.
RUN = [*TINY, "size=xs", "data=synthetic", "data.corpus.train_docs=4", "data.corpus.validation_docs=2",
       "data.corpus.mean_doc_bytes=1500", "data.seq_len=32", "recipe.tokens_per_batch=128",
       "data.val_tokens=128", "trainer.max_steps=2"]

# Values for anything: numbers at and past every edge, and text a shell can pass.
ANY = st.one_of(
    st.integers(-10**12, 10**12),
    st.sampled_from([0, -1, 1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", " ", "nan", "inf", "-inf", "null", "none", "true", "1e400", "0x10", "1,2", "[1,2]",
                     "it's", 'a"b', "ü", "a b", "../..", "/", "{}", "${oc.env:HOME}", "%s", "\\"]),
    st.text(min_size=0, max_size=12),
)
# For keys that size a run: garbage, or a valid value that keeps it small (a valid 10**9 there is a request
# for a huge run, not a bad input; `train` refuses a model larger than the machine, tested elsewhere).
def is_garbage(value) -> bool:
    """Not a positive number above 3 (as Hydra would read it): no huge valid budget."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return True
    return not (3 < number < float("inf")) or number != int(number)


GARBAGE = ANY.filter(is_garbage)
SMALL = st.one_of(st.integers(-3, 3), GARBAGE)

# Config keys of `train` and what to draw for each.
TRAIN_KEYS = {
    "trainer.max_steps": SMALL, "seed": ANY, "size.lr": ANY, "data.seq_len": SMALL, "budget_scale": SMALL,
    "data.micro_batch_size": SMALL, "checkpoint_every_n_steps": ANY, "eval_every_n_steps": ANY,
    "nonfinite": ANY, "trainer.precision": ANY, "data.val_tokens": SMALL, "model": ANY,
    "recipe.warmup_fraction": ANY, "recipe.grad_clip": ANY, "size.n_layers": SMALL, "size.n_heads": SMALL,
}
FIGURES = ["scaling", "context", "token-index", "latency", "recall", "minibatch", "inner-loss", "curves",
           "nosuch"]


def text(value) -> str:
    return value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A finished run (checkpoint, metrics) that no fuzzed command may change, and a folder for outputs."""
    root = tmp_path_factory.mktemp("fuzz")
    main(["train", *RUN, f"paths.runs={root / 'existing'}", f"paths.cache={root / 'cache'}"])
    (ckpt,) = (root / "existing").rglob("last.ckpt")
    return {"root": root, "ckpt": ckpt, "run": ckpt.parent.parent}


def snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
            and p.suffix != ".lock" and ".hydra" not in p.parts and p.name != "main.log"}


def check(world, capsys, argv: list[str]) -> None:
    """Run `ttt-bench argv`: exit 0, or exit 2 with one line; nothing pre-existing changed; no temp files."""
    before = snapshot(world["run"])
    code = 0
    with contextlib.suppress(KeyboardInterrupt):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (0, None, 2), f"exit {code} for {argv}: {err[-3:]}"
    if code == 2:
        assert len(err) == 1 and err[0].startswith("ttt-bench: error: "), (argv, err[-5:])
    after = snapshot(world["run"])  # new files (an eval next to the run) are fine; changed ones are not
    assert {p: after.get(p) for p in before} == before, f"{argv} changed the existing run"
    assert not list(world["root"].rglob(".*.tmp")), f"{argv} left a half-written file"


FUZZ = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(TRAIN_KEYS)), st.just(None), min_size=1, max_size=2)
       .flatmap(lambda keys: st.fixed_dictionaries({k: TRAIN_KEYS[k] for k in keys})))
def test_train_with_generated_config_values(world, capsys, values):
    runs = world["root"] / "train-runs"
    check(world, capsys, ["train", *RUN, *[f"{k}={text(v)}" for k, v in values.items()],
                          f"paths.runs={runs}", f"paths.cache={world['root'] / 'cache'}"])


@FUZZ
@given(st.sampled_from(["prompt", "max_new_tokens", "temperature", "top_k", "seed", "device", "ckpt"]), ANY)
def test_generate_with_generated_options(world, capsys, option, value):
    ckpt = text(value) if option == "ckpt" else str(world["ckpt"])
    args = [] if option == "ckpt" else [f"--{option.replace('_', '-')}", text(value)]
    if option == "max_new_tokens" and not is_garbage(value):
        args = ["--max-new-tokens", "8"]
    check(world, capsys, ["generate", ckpt, "--prompt", "ab", "--max-new-tokens", "4", *args])


@FUZZ
@given(st.sampled_from(["ckpt_path", "seq_len", "max_tokens", "batch_size", "data"]), ANY)
def test_eval_with_generated_values(world, capsys, key, value):
    if key in ("seq_len", "max_tokens", "batch_size") and not is_garbage(value):
        value = 64
    ckpt = text(value) if key == "ckpt_path" else str(world["ckpt"])
    extra = [] if key == "ckpt_path" else [f"{key}={text(value)}"]
    root = world["root"]
    check(world, capsys, ["eval", f"ckpt_path={ckpt}", "max_tokens=128", *extra,
                          f"paths.runs={root / 'eval'}", f"paths.cache={root / 'cache'}"])


@FUZZ
@given(st.sampled_from(FIGURES), st.one_of(ANY, st.sampled_from(["RUN", "EXISTING"])))
def test_plot_with_generated_inputs(world, capsys, figure, value):
    source = {"RUN": str(world["run"]), "EXISTING": str(world["root"] / "existing")}.get(value, text(value))
    check(world, capsys, ["plot", figure, source, "--out", str(world["root"] / "figures")])


@FUZZ
@given(ANY, st.booleans())
def test_runs_with_generated_folders(world, capsys, value, csv):
    folder = str(world["root"] / "existing") if value == 0 else text(value)
    check(world, capsys, ["runs", folder, *(["--csv"] if csv else [])])


@FUZZ
@given(st.sampled_from(["table1", "minibatch", "recall", "mttt_patches", "nosuch"]),
       st.sampled_from(["--profile", "--scale", "--data-dir", "override"]), ANY)
def test_ablate_plan_with_generated_options(world, capsys, sweep, option, value):
    args = [f"trainer.max_steps={text(value)}"] if option == "override" else [option, text(value)]
    check(world, capsys, ["ablate", sweep, "--plan", "--profile", "smoke", *args])


@FUZZ
@given(st.sampled_from(["--contexts", "--batch", "--repeats", "--phases", "--models", "--dtype", "--threads",
                        "--size", "--decode-tokens"]), ANY)
def test_bench_models_with_generated_options(world, capsys, option, value):
    if not is_garbage(value) and option not in ("--size", "--models", "--phases", "--dtype"):
        value = 4  # a valid large value would time a large model
    out = world["root"] / "bench.csv"
    check(world, capsys, ["bench", "models", "--preset", "quick", "--models", "transformer", "--phases",
                          "prefill", "--contexts", "16", "--repeats", "1", "--warmup", "0", "--threads", "1",
                          "--d-model", "16", "--n-layers", "1", "--n-heads", "1", "--train-context", "16",
                          option, text(value), "--out", str(out)])

