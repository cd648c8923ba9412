"""Crash-safe file writes: write a temporary file in the same folder, then rename over the target."""

import contextlib
import json
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb"):
    """A file object to write `path` through: the target appears, complete and synced, only when the block
    ends without an error; a crash at any point leaves the previous file (if any) untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0o600 would hide results from the rest of the team
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
