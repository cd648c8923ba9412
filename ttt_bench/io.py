"""Crash-safe file writes: write a temporary file in the same folder, then rename over the target."""

import contextlib
import errno
import json
import os
import shutil
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


def chained_os_error(e: BaseException | None) -> OSError | None:
    """The OSError in an exception's chain (its causes and contexts), if any: what a library's own
    exception (datasets' DatasetGenerationError) wraps."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def write_failed(e: BaseException, path: str | Path) -> OSError:
    """The OSError behind a library's failed write of `path` (torch.save says RuntimeError "file write
    failed"): the chained OSError when there is one, else ENOSPC when the target's disk has under 16 MiB
    free (asked while the partial file still takes its space), else EIO."""
    if found := chained_os_error(e):
        return found
    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    full = shutil.disk_usage(folder).free < 16 * 2**20
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return OSError(errno.ENOSPC if full else errno.EIO,
                   os.strerror(errno.ENOSPC) if full else f"write failed ({reason[:200]})", str(path))
