"""What the run folders under a folder hold, for `ttt-bench runs` and `ttt-bench plot curves`: each run's
model, size, data, context, status (finished / stopped at step N / failed / running), steps, tokens,
validation number and speed, and its loss curves. Read only: nothing here writes to a run folder."""

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from ..errors import UserError
from ..io import read_table
from .run_folder import in_use

# A run folder's own file that is damaged: what to do about it.
RUN_FILE_FIX = "restore it, or train the run again into a new folder"


@dataclass
class RunRecord:
    run: str  # the folder, relative to the folder listed
    model: str
    size: str
    data: str
    context: int | None  # tokens a sequence (language models) or tokens an image (MTTT)
    status: str  # finished | stopped at step N of M | failed: <error> | running
    steps: int | None
    tokens: int | None  # tokens (language models) or images seen
    val: float | None  # the task's validation number, named by val_metric (VAL_METRICS)
    val_metric: str
    tokens_per_s: float | None

    @property
    def label(self) -> str:
        """model-size-data-T<context>, as run folders are named."""
        return f"{self.model}-{self.size}-{self.data}-T{self.context}"


# Each task's validation number, as its papers report it: (the key of metrics.json, its name in the listing).
# A language model's perplexity (per token of its tokenizer: per byte for the byte-level one); associative
# recall (MQAR) scores a language model on its answers alone, and its perplexity over them says little;
# an image classifier's accuracy.
VAL_METRICS = {"lm": ("val_ppl", "val_ppl"), "recall": ("val_accuracy", "val_acc"),
               "image": ("val_accuracy", "val_acc")}
# The columns that count things: integers, blank where unknown (pandas would make a column with a blank float)
INTEGER_COLUMNS = ("context", "steps", "tokens")


def run_task(metrics: dict, config: dict) -> str:
    """lm, recall or image: from metrics.json (a finished run's) or the run's config (any run's)."""
    task, data = config.get("task"), config.get("data")
    task, data = (task if isinstance(task, dict) else {}), (data if isinstance(data, dict) else {})
    if metrics.get("task") == "image" or task.get("name") == "image":
        return "image"
    # a language model validated on masked answers gets an accuracy (evaluate.evaluate): MQAR's recall
    if "val_accuracy" in metrics or "MQARDataModule" in str(data.get("_target_", "")):
        return "recall"
    return "lm"


def _integer(value) -> int | None:
    """A count read from a run file, as an int (JSON may hold 253952.0); None unless a whole number."""
    whole = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return int(value) if whole and value == int(value) else None


def find_runs(root: Path) -> list[Path]:
    """Every run folder at or under `root`, sorted: a folder `ttt-bench train` claimed (identity.json), or
    one a sweep recorded as failed (metrics.json with a status). Eval outputs are not runs."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a folder; pass a run folder or a folder of runs (e.g. runs/)")
    found = {p.parent for p in root.rglob("identity.json")}
    found |= {p.parent for p in root.rglob("metrics.json") if "status" in _json(p)}
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(root).parts))


def _json(path: Path, checked: bool = False) -> dict:
    """A run file's object, {} if absent. Unchecked (a file another process may be writing): {} also where it
    does not parse. Checked (a run no process holds): a one-line UserError there."""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        if not checked:
            return {}
        raise UserError(f"{path} is not readable JSON ({str(e).splitlines()[0]}); {RUN_FILE_FIX}") from None
    if checked and not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not an object; {RUN_FILE_FIX}")
    return obj if isinstance(obj, dict) else {}


def _saved_step(run_dir: Path) -> int | None:
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step-*.ckpt")
             if (m := re.fullmatch(r"step-(\d+)\.ckpt", p.name))]
    return max(steps, default=None)


def _last_logged_step(run_dir: Path, checked: bool = False) -> int | None:
    """The last step in losses.csv (None if it has none). Unchecked: as far as it can be read while another
    process appends to it. Checked: read as the plots read it, a one-line UserError if damaged."""
    path = run_dir / "losses.csv"
    if checked:
        if not path.is_file():
            return None
        losses = read_table(path, required=("step", "loss"), numeric=("step", "loss"), fix=RUN_FILE_FIX)
        return int(losses["step"].iloc[-1]) if len(losses) else None
    try:
        rows = path.read_text().strip().splitlines()[1:]
        return int(rows[-1].split(",")[0]) if rows else None
    except (OSError, ValueError):
        return None


def fraction_trained(run_dir: Path) -> float:
    """How far a run in progress has trained: its last logged step over its max_steps (0 when unknown)."""
    run_dir = Path(run_dir)
    total = _json(run_dir / "identity.json").get("config", {}).get("trainer", {}).get("max_steps")
    step = _last_logged_step(run_dir)
    return min(step / total, 1.0) if step and isinstance(total, int) and total > 0 else 0.0


def read_run(run_dir: Path, root: Path | None = None) -> RunRecord:
    """A run's record. A damaged file of a run not in use shows as its status, "unreadable: <what and where>",
    never as a wrong number: a listing of many runs goes on past one damaged run."""
    run_dir = Path(run_dir)
    name = str(run_dir.relative_to(root)) if root and run_dir != Path(root) else run_dir.name
    try:
        return _read_run(run_dir, name)
    except UserError as e:
        return RunRecord(run=name, model="?", size="?", data="?", context=None, status=f"unreadable: {e}",
                         steps=None, tokens=None, val=None, val_metric="", tokens_per_s=None)


def _read_run(run_dir: Path, name: str) -> RunRecord:
    metrics = _json(run_dir / "metrics.json", checked=True)
    config = _json(run_dir / "identity.json", checked=True).get("config", {})
    task = run_task(metrics, config)
    image = task == "image"
    max_steps = config.get("trainer", {}).get("max_steps")
    status = metrics.get("status", "finished" if "val_loss" in metrics or "val_accuracy" in metrics else None)
    steps = metrics.get("steps")
    if status == "failed":
        status = f"failed: {metrics.get('error', '')}".strip()
    elif status is None:
        if in_use(run_dir):
            status = "running"
        else:
            logged = _last_logged_step(run_dir, checked=True)
            status = f"stopped at step {logged if logged is not None else 0} of {max_steps}"
            saved = _saved_step(run_dir)
            status += f" (resumes from step {saved})" if saved else " (no checkpoint: starts again)"
            steps = logged
    val_key, val_metric = VAL_METRICS[task]
    context = (metrics.get("num_tokens") if image else
               metrics.get("seq_len", config.get("data", {}).get("seq_len")))
    model = metrics.get("model") or config.get("model", {}).get("name", "?")
    size = metrics.get("size") or config.get("size", {}).get("name", "?")
    data = metrics.get("data") or config.get("data", {}).get("name", "?")
    unit = "images" if image else "tokens"  # metrics.json's keys: images_seen, steady_images_per_s, ...
    number = lambda v: None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
    return RunRecord(
        run=name, model=model, size=size, data=data, context=_integer(context), status=status,
        steps=_integer(steps), tokens=_integer(metrics.get(f"{unit}_seen")), val=number(metrics.get(val_key)),
        val_metric=val_metric,
        tokens_per_s=number(metrics.get(f"steady_{unit}_per_s") or metrics.get(f"{unit}_per_s")))


def list_runs(root: Path) -> pd.DataFrame:
    """One row per run folder under `root` (RunRecord's fields; the counts integers, <NA> where unknown)."""
    root = Path(root)
    records = [asdict(read_run(p, root)) for p in find_runs(root)]
    table = pd.DataFrame(records, columns=list(RunRecord.__dataclass_fields__))
    return table.astype({column: "Int64" for column in INTEGER_COLUMNS})


def token_index_losses(run_dir: Path) -> pd.DataFrame:
    """A run's validation loss by token index (token_index, loss), from its token_index.csv, checked."""
    return read_table(Path(run_dir) / "token_index.csv", required=("token_index", "loss"),
                      numeric=("token_index", "loss"), unique="token_index", fix=RUN_FILE_FIX)


def loss_curves(run_dir: Path) -> pd.DataFrame:
    """A run's losses: rows (split, step, tokens, loss), training from losses.csv, validation from
    metrics.csv; tokens = step x the run's tokens (or images) a step."""
    run_dir = Path(run_dir)
    if not (run_dir / "losses.csv").is_file():
        raise UserError(f"{run_dir} has no losses.csv; pass the folder of a run `ttt-bench train` wrote")
    train = read_table(run_dir / "losses.csv", required=("step", "loss"), numeric=("step", "loss"),
                       unique="step", fix=RUN_FILE_FIX).assign(split="train")
    frames = [train[["split", "step", "loss"]]]
    if (run_dir / "metrics.csv").is_file():
        logged = read_table(run_dir / "metrics.csv", required=("step",), numeric=("step", "val/loss"),
                            fix=RUN_FILE_FIX)
        if "val/loss" in logged:
            val = logged.dropna(subset=["val/loss"])
            # Lightning logs the validation after step k with step k - 1
            frames.append(pd.DataFrame({"split": "validation", "step": val["step"].astype(int) + 1,
                                        "loss": val["val/loss"]}))
    curves = pd.concat(frames, ignore_index=True)
    metrics, config = _json(run_dir / "metrics.json"), _json(run_dir / "identity.json").get("config", {})
    recipe = config.get("recipe", {})
    seen = metrics.get("steps") and metrics.get("tokens_seen")
    per_step = (metrics["tokens_seen"] / metrics["steps"] if seen else
                recipe.get("tokens_per_batch") or recipe.get("batch_size"))
    curves["tokens"] = curves["step"] * per_step if per_step else float("nan")
    return curves
