"""Crash-safe file writes (write a temporary file in the same folder, then rename over the target), and
CSV reads checked at the boundary (one line naming the file and line)."""

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from .errors import UserError


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


def not_numbers(values: pd.Series) -> pd.Series:
    """Which cells hold text that is not a number ("n/a", "0.9x"); an empty cell (missing) and nan (a skipped
    step's loss) pass."""
    nan = values.astype(str).str.strip().str.lower().str.lstrip("+-") == "nan"
    return values.notna() & pd.to_numeric(values, errors="coerce").isna() & ~nan


def read_table(path: str | Path, required: tuple = (), numeric: tuple = (), unique: str | None = None,
               fix: str = "restore it, or delete it and run the command that wrote it again") -> pd.DataFrame:
    """A CSV that ttt-bench wrote, checked as it is read: it parses, has the `required` columns, the `numeric`
    columns present hold numbers (nan allowed: a skipped step's loss) and come back as numbers, and no value
    of `unique` repeats. Anything else is a one-line UserError naming the file, its line and `fix`. Only an
    empty cell is missing (what pandas writes for NaN): text such as "n/a" or "NA" stays text, so that a
    measured column holding it is an error rather than a silently dropped value."""
    path = Path(path)
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} is not a readable CSV ({reason}); {fix}") from None
    if missing := [c for c in required if c not in df]:
        raise UserError(f"{path} has no column {', '.join(missing)} (was its header edited?); {fix}")
    for col in (c for c in numeric if c in df and not pd.api.types.is_numeric_dtype(df[c])):
        if (bad := not_numbers(df[col])).any():
            i = bad.idxmax()  # file lines: the header is line 1
            raise UserError(f"{path}, line {int(i) + 2}: {col} is {df.at[i, col]!r}, not a number; {fix}")
        df[col] = pd.to_numeric(df[col], errors="coerce")
    if unique is not None and unique in df and (twice := df[unique][df[unique].duplicated()]).size:
        value = twice.iloc[0]
        lines = [int(i) + 2 for i in df.index[df[unique] == value]]
        shown = f"{value:g}" if isinstance(value, float) else value
        raise UserError(f"{path} has {unique} {shown} twice (lines {lines[0]} and {lines[1]}); {fix}")
    return df
