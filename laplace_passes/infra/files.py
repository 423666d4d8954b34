"""Output directories, written whole or not at all.

    check_output_dir(path, overwrite=False)              before the work: a bad destination is a ValueError
    check_writable_dir(path)                             the same for a directory that is added to (checkpoints)
    with staged_directory(path, overwrite) as staging:   write every file into `staging`;
        ...                                              on success it becomes `path`

NOTE [output directories]
`export_stablehlo` and `dump_report` (the CLI's `export --stablehlo DIR` and
`inspect --dump DIR`) write a directory of files that belong together: a
manifest and the files it lists, a report and its graphs. Three rules:

* The destination is checked before the work (minutes on a large model), so
  a file in the way, an unwritable parent or a place where no directory can
  be made (/proc, a read-only mount) fails at once, in one line. The last is
  found by making (and removing) an empty directory there: permission bits
  do not tell, and root passes every `os.access` check.
* A non-empty directory is refused unless `overwrite=True` (`--force`),
  which replaces it whole: no file of an earlier run survives that the new
  manifest does not list. A directory holding the current working directory
  is never replaced.
* The files are written into a fresh directory next to the destination,
  which is renamed into place only when every file is written: a failure
  half-way leaves the destination as it was, and the partial directory is
  removed (a process killed outright leaves it behind, hidden beside the
  destination as .DIR.partial-PID-...).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


class OutputDirError(ValueError):
    """The destination of an output directory cannot be used; raised before any work."""


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """`path` as a Path, when a directory can be written there (see NOTE [output directories])."""
    if not isinstance(path, (str, os.PathLike)):
        raise OutputDirError(f"an output directory must be a path, got {type(path).__name__}")
    path = Path(path)
    real = Path(os.path.realpath(path))
    if real.exists():
        if not real.is_dir():
            raise OutputDirError(f"cannot write the output directory {path}: a file of that name is in the way")
        if any(real.iterdir()):
            if not overwrite:
                raise OutputDirError(f"{path} is not empty: choose a new directory, or pass overwrite=True "
                                     "(--force) to replace it and everything in it")
            cwd = Path.cwd().resolve()
            if real in (cwd, *cwd.parents):
                raise OutputDirError(f"refusing to replace {path}: it holds the current working directory")
    _check_can_create(real.parent, f"create the output directory {path}")
    return path


def check_writable_dir(path: str | os.PathLike, what: str = "directory") -> Path:
    """`path` as a Path, when files can be added to it: an existing directory, or one that can be made.

    For a directory a run adds to (and may resume from), unlike `check_output_dir`'s, which a run
    replaces whole: its files are kept. `what` names it in the error ("checkpoint directory").
    """
    if not isinstance(path, (str, os.PathLike)):
        raise OutputDirError(f"a {what} must be a path, got {type(path).__name__}")
    path = Path(path)
    real = Path(os.path.realpath(path))
    if not real.exists():
        _check_can_create(real.parent, f"create the {what} {path}")
    elif not real.is_dir():
        raise OutputDirError(f"cannot use {path} as the {what}: a file of that name is in the way")
    else:
        _check_can_create(real, f"write into the {what} {path}")  # the run makes directories inside it
    return path


def _check_can_create(parent: Path, doing: str) -> None:
    """Refuse to `doing` ("create the output directory DIR") unless a directory can be made in `parent`
    (or in the nearest of its ancestors that exists)."""
    ancestor = _nearest_existing(parent)
    if not ancestor.is_dir():
        raise OutputDirError(f"cannot {doing}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputDirError(f"cannot {doing}: {ancestor} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=ancestor))
    except OSError as error:
        reason = error.strerror or str(error)
        raise OutputDirError(f"cannot {doing}: no directory can be made in {ancestor} "
                             f"({reason})") from None


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty directory next to `path`; when the block ends without error, it replaces `path`."""
    check_output_dir(path, overwrite)
    real = Path(os.path.realpath(path))
    real.parent.mkdir(parents=True, exist_ok=True)
    staging = _fresh_sibling(real, "partial")
    staging.mkdir()  # mode from the umask, like any directory the user makes
    try:
        yield staging
        _replace_directory(staging, real)
    finally:
        if staging.exists():  # the block failed: its partial files go
            shutil.rmtree(staging)


def _replace_directory(new: Path, target: Path) -> None:
    """Move `new` to `target`; a non-empty `target` is moved aside first and removed after."""
    if not target.exists() or not any(target.iterdir()):
        os.replace(new, target)  # rename(2) may replace an empty directory: one atomic step
        return
    old = _fresh_sibling(target, "old")
    os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        os.replace(old, target)
        raise
    shutil.rmtree(old)


def _fresh_sibling(path: Path, role: str) -> Path:
    """A name beside `path` that nothing uses: hidden, naming its role and the process."""
    return path.parent / f".{path.name}.{role}-{os.getpid()}-{secrets.token_hex(4)}"


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
