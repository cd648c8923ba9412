"""A sweep folder belongs to one sweep, and its runs are never deleted by a sweep.

- One process at a time: `claimed(out, sweep)` holds an OS lock on the folder while a sweep plans, trains and
  tabulates it; a second `ablate` or `make reproduce` on the same folder is refused in one line. The lock
  also keeps `plan.json` and each run's `run.json` from being rewritten under a running sweep.
- One sweep per folder: a folder whose plan.json names another sweep, or that holds something other than a
  sweep (a results step folder, a run), is refused.
- A planned run whose folder holds a run made with other settings (its `run.json` overrides, or the content
  of the data it read: `data_fingerprint`) is a `Conflict`: the sweep refuses before training anything, naming
  the runs and the differing keys, unless asked to `replace` them; replaced runs are moved aside to
  `<out>/replaced/<time>/`, never deleted. A run that holds no work (it failed or never started, and left no
  checkpoint, and no process trains it) is moved aside without asking; its files stay readable there.
"""

import contextlib
import glob
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import UserError
from ...training.run_folder import exclusive, in_use
from .plan import Run, identity
from .registry import read_metrics

LOCK = ".sweep.lock"
# what a folder that is not a sweep's holds: a results step folder (registry.csv, step.json), a run folder
FOREIGN = ("registry.csv", "step.json", "REPORT.md", "identity.json", "metrics.json", "checkpoints",
           "*/identity.json")


@contextlib.contextmanager
def claimed(out: Path, sweep: str):
    """Hold the sweep folder `out` for `sweep` for the block: refuse a folder another process holds, or one
    that belongs to another sweep or is no sweep folder."""
    out = Path(out)
    check_owner(out, sweep)
    with exclusive(out / LOCK, lambda holder: UserError(
            f"sweep folder {out} is in use by {holder}; wait for it to finish, or train this sweep into "
            "another folder (ablate --out DIR)")):
        yield


def check_owner(out: Path, sweep: str) -> None:
    """Refuse a folder that holds another sweep's runs, or something other than a sweep."""
    out = Path(out)
    if not out.is_dir():
        return
    plan = out / "plan.json"
    if plan.is_file():
        try:
            other = json.loads(plan.read_text()).get("sweep")
        except (OSError, ValueError, AttributeError):
            raise UserError(f"{plan} is damaged; restore it from a backup, or train into another folder "
                            "(ablate --out DIR)") from None
        if other != sweep:
            raise UserError(f"{out} is the sweep folder of '{other}', not of '{sweep}'; give this sweep "
                            "its own folder (ablate --out DIR)")
        return
    if foreign := sorted(str(p.relative_to(out)) for pattern in FOREIGN for p in out.glob(pattern)):
        raise UserError(f"{out} is not a sweep folder (it holds {', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''} and no plan.json); train into a new or empty "
                        "folder (ablate --out DIR)")


OPERATIONAL_DATA = ("cache_dir",)  # where a run writes, not what it reads


def _files(value: str) -> list[str]:
    """The files a data setting names: a file, a folder's files, or a glob's matches."""
    if any(c in value for c in "*?["):
        return sorted(f for f in glob.glob(value, recursive=True) if os.path.isfile(f))
    if os.path.isdir(value):
        return sorted(str(p) for p in Path(value).rglob("*") if p.is_file())
    return [value] if os.path.isfile(value) else []


def data_fingerprint(cfg) -> str | None:
    """What a run reads, by content and not by path: the files each data setting names (a corpus' shards, an
    image folder), by name, size and sampled bytes (data/corpora.py's file_fingerprint, as the token cache
    keys them). The same run names on another corpus, or the same path holding other data, never pass for
    the same runs; a copy of the data on another machine does. None: the data names no files (synthetic)."""
    from omegaconf import OmegaConf

    from ...data.corpora import _sha, file_fingerprint

    def walk(node, key=""):
        if isinstance(node, dict):
            return [x for k, v in node.items() if k not in OPERATIONAL_DATA for x in walk(v, f"{key}{k}.")]
        if isinstance(node, list):
            return [x for i, v in enumerate(node) for x in walk(v, f"{key}{i}.")]
        files = _files(node) if isinstance(node, str) else []
        return [(key, [(Path(f).name, file_fingerprint(f)) for f in files])] if files else []

    named = walk(OmegaConf.to_container(cfg.data, resolve=True))
    return _sha("data-content-v1", named) if named else None


@dataclass
class Conflict:
    """A planned run whose folder holds a run made with other settings."""

    run: str
    changes: list[str]  # "trainer.max_steps: 245 -> 2", "the data's content"
    keeps: bool  # the folder holds work: a finished run, a checkpoint, or a run another process trains


def _as_dict(overrides: list[str]) -> dict[str, str]:
    return {k.lstrip("+~"): v for k, _, v in (o.partition("=") for o in identity(overrides))}


def changes(recorded: dict, run: Run, fingerprint: str | None) -> list[str]:
    """What differs between the run a folder's run.json records and the planned `run` (paths aside)."""
    old, new = _as_dict(recorded.get("overrides", [])), _as_dict(run.overrides)
    out = [f"{k}: {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in sorted(old.keys() | new.keys())
           if old.get(k) != new.get(k)]
    if recorded.get("data_fingerprint") and fingerprint and recorded["data_fingerprint"] != fingerprint:
        out.append("the data's content (another corpus under the same settings)")
    return out


def conflicts(out: Path, runs: dict[str, Run], fingerprints: dict[str, str | None]) -> list[Conflict]:
    """The planned runs whose folders in `out` hold a run made with other settings."""
    found = []
    for name, run in runs.items():
        run_dir = Path(out) / name
        try:
            recorded = json.loads((run_dir / "run.json").read_text())
        except (OSError, ValueError):
            continue  # no run there yet (or a restored one: it has no run.json)
        if diff := changes(recorded, run, fingerprints.get(name)):
            finished = (read_metrics(run_dir) or {}).get("status") == "finished"
            keeps = finished or any(run_dir.glob("checkpoints/*")) or in_use(run_dir)
            found.append(Conflict(name, diff, keeps))
    return found


def refusal(out: Path, found: list[Conflict]) -> str:
    names = ", ".join(c.run for c in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    keys = sorted({ch for c in found for ch in c.changes})
    return (f"{len(found)} run folder{'s' if len(found) > 1 else ''} in {out} hold{'s' * (len(found) == 1)} "
            f"runs made with other settings ({names}: {'; '.join(keys[:4])}"
            f"{'; ...' if len(keys) > 4 else ''})"
            "; nothing was trained or deleted. Train this plan into another folder (ablate --out DIR), or "
            "pass --replace (make reproduce REPLACE=1) to move those runs aside to "
            f"{Path(out) / 'replaced'}/<time>/ and train them again")


def settle(out: Path, runs: dict[str, Run], fingerprints: dict[str, str | None], replace: bool) -> list[str]:
    """Make room for the plan in `out` without losing a run: refuse (UserError) while a conflicting folder
    holds work and `replace` is off; else move the conflicting folders aside. Returns the names moved."""
    found = conflicts(out, runs, fingerprints)
    if not replace and (keep := [c for c in found if c.keeps]):
        raise UserError(refusal(out, keep))
    if not found:
        return []
    aside = Path(out) / "replaced" / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for c in found:
        (Path(out) / c.run).rename(aside / c.run)
    return [c.run for c in found]
