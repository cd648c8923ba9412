"""A run folder belongs to one training run: an OS lock keeps a second process out of it, and identity.json
ties it to what determines the result (the resolved config, data locations included, and the fingerprint of
the data it read), so the same command with other data never resumes or overwrites it."""

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..io import write_json

# Settings that change where things are written or how a run is watched, not what it computes.
OPERATIONAL = ("ckpt_path", "paths", "logger", "checkpoint_every_n_steps", "eval_every_n_steps", "hydra",
               "data.cache_dir", "data.num_proc", "trainer.enable_progress_bar", "trainer.log_every_n_steps")


class RunFolderInUse(UserError):
    pass


@contextlib.contextmanager
def locked(run_dir: Path, enabled: bool = True):
    """Hold an exclusive lock on `run_dir` for the block; another process gets a one-line error."""
    if not enabled:
        yield
        return
    with exclusive(Path(run_dir) / ".lock", lambda holder: RunFolderInUse(
            f"run folder {run_dir} is in use by {holder}; wait for it to finish or give this run another "
            "folder (paths.runs=... or run_name=...)")):
        yield


GRACE_S = 1.0  # how long a lock is tried for: `in_use` holds one for microseconds, a holder for a whole run


@contextlib.contextmanager
def exclusive(lock: Path, refused):
    """Hold an OS lock on the file `lock` for the block, recording this process in it; while another
    process (or thread: flock is per open file) holds it past GRACE_S, raise `refused(holder)`. The OS
    releases it when the process ends, however it ends (a stale lock file locks nothing). The grace lets a
    probe pass: without it a sweep worker's ETA probing its sibling's run folder (`in_use`) made the sibling
    skip its run as "being trained by another process" (the default `make reproduce` at 605c787)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        deadline = time.monotonic() + GRACE_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.seek(0)
                    raise refused(f.read().strip() or "another process") from None
                time.sleep(0.02)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def in_use(run_dir: Path) -> bool:
    """Whether another process (or thread) holds `run_dir`'s lock now (is training it): a probe that takes
    the lock for an instant, without waiting and without recording itself as the holder."""
    try:
        with open(Path(run_dir) / ".lock") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:  # no lock file: never trained
        return False


def identity(cfg: DictConfig, data_fingerprint: str | None) -> dict:
    """What the run's result depends on: the resolved config without the operational keys, and the data."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for key in OPERATIONAL:
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node.get(p) or {}
        node.pop(leaf, None)
    return {"config": config, "data_fingerprint": data_fingerprint}


def claim(run_dir: Path, ident: dict) -> None:
    """Record the run's identity in the folder; in a folder that has one, refuse a different run (a folder
    from before identity.json is adopted: the model of its checkpoints is still checked on resume)."""
    path = run_dir / "identity.json"
    if path.is_file():
        recorded = json.loads(path.read_text())
        changed = _differences(recorded["config"], ident["config"])
        if recorded["data_fingerprint"] != ident["data_fingerprint"]:
            changed.append(f"the data's content changed: it had fingerprint {recorded['data_fingerprint']}, "
                           f"now {ident['data_fingerprint']}")
        if changed:
            raise UserError(f"run folder {run_dir} holds another run ({'; '.join(changed[:3])}); give this "
                            "run another folder (paths.runs=... or run_name=...) or delete that one")
    write_json(path, ident)


def why_new(run_dir: Path, ident: dict) -> str | None:
    """Why this command starts a new run rather than resuming one: for a folder without identity.json, the
    sibling run (same model, size, data and context: the parent folder) whose identity is closest, and what
    differs (e.g. trainer.max_steps, which the schedule depends on). None for a folder that has a run, a
    run of a sweep, or when there is no sibling."""
    if (run_dir / "identity.json").is_file() or (run_dir.parent / "plan.json").is_file():
        return None  # a resume, or a sweep's run (its siblings are the sweep's other runs, by design)
    nearest = None
    for other in sorted(run_dir.parent.glob("*/identity.json")):
        try:
            recorded = json.loads(other.read_text())
            changed = _differences(recorded["config"], ident["config"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged sibling says nothing about this run
        if recorded.get("data_fingerprint") != ident["data_fingerprint"]:
            changed.append("the data")
        if nearest is None or len(changed) < len(nearest[1]):
            nearest = (other.parent, changed)
    if nearest is None or not nearest[1]:
        return None
    folder, changed = nearest
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return (f"a new run, not a resume: the nearest earlier run of this model ({folder.name}) differs in "
            f"{'; '.join(changed[:3])}{more}; options that change the result start a new folder")


def _differences(recorded: dict, ident: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(recorded.keys() | ident.keys()):
        a, b = recorded.get(key), ident.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} was {a}, is {b}")
    return out
