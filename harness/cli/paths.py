"""Output paths checked before any compute: a run that cannot write its results should fail in a second, with a
message naming the flag and the path, not after minutes of work with a traceback."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from harness.errors import UsageError


def writable_dir(path: Path, flag: str, given: Path | None = None) -> Path:
    """Create directory `path` (and its parents) and prove a file can be written in it. Messages name the flag
    and the path as given (`given`, when `path` is the directory of a file the flag names)."""
    shown = f"{flag} {given or path}"
    if path.exists() and not path.is_dir():
        raise UsageError(f"{shown}: {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dsv4-drift-write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{shown}: cannot write in {path} ({e.strerror or e})") from None
    return path


def writable_file(path: Path, flag: str) -> Path:
    """Make sure file `path` can be written: its directory exists (created) and is writable, and it is no directory."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, not a file")
    writable_dir(path.parent, flag, given=path)
    return path


@contextmanager
def new_output_dir(path: Path, flag: str) -> Iterator[Path]:
    """`writable_dir` for the directory a command is about to fill (a run directory): when the command fails
    before writing anything into it (a bad scenario, patch option or device), the directory it made goes again."""
    existed = path.exists()
    writable_dir(path, flag)
    try:
        yield path
    except BaseException:
        if not existed:
            with suppress(OSError):  # only an empty directory is removed
                path.rmdir()
        raise
