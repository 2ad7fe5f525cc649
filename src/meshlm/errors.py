"""Errors that mean "the user asked for something impossible" or "the world got in the way": the CLI
prints them as one line (no traceback unless --debug / MESHLM_DEBUG=1) and exits with the error's
`exit_code`: 2 for usage (a bad argument or config value), 1 for a runtime failure (missing data,
corrupt checkpoint, full disk), 130 / 143 after Ctrl-C / SIGTERM. `Problems` collects every problem
with a command's inputs before any compute and raises them as one error."""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar


class MeshlmError(Exception):
    """Base class: the message names the problem and the fix. `reported`: the code that raised it
    has printed the line already (it could not count on living until the CLI prints it)."""

    exit_code = 1
    reported = False


class ConfigError(MeshlmError, ValueError):
    """An invalid model or training configuration, or command-line argument (a usage error)."""

    exit_code = 2


class DataError(MeshlmError, ValueError):
    """A missing, empty or malformed corpus, tokenizer or prepared dataset."""


class CheckpointError(MeshlmError):
    """A missing, truncated or corrupt checkpoint."""


class StorageError(MeshlmError):
    """The filesystem refused a write or read: full disk, read-only folder, missing permission."""


class Interrupted(MeshlmError):
    """Stopped by SIGINT (exit 130) or SIGTERM (exit 143) after saving what could be saved."""

    def __init__(self, message: str, signal_number: int = 2):
        super().__init__(message)
        self.exit_code = 128 + signal_number


# bytes an output folder needs free before a command computes what it will write there
MIN_FREE = 1 << 20


def nearest_existing(path: str | Path) -> Path:
    """`path`, or its nearest parent that exists: the folder whose filesystem a write to `path`
    lands on."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> float:
    """Free bytes on the filesystem holding `path` (infinite when it cannot be asked)."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return float("inf")


def total_bytes(path: str | Path) -> float:
    """Size of the filesystem holding `path` (infinite when it cannot be asked; 0 for /proc, /sys,
    which hold no files one can create)."""
    try:
        return shutil.disk_usage(nearest_existing(path)).total
    except OSError:
        return float("inf")


def free_space(path: str | Path) -> str:
    """Free space of the filesystem holding `path` (or its nearest existing parent), e.g. "1.2 GB
    free"."""
    free = free_bytes(path)
    if free == float("inf"):
        return "free space unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if free < 1000 or unit == "TB":
            return f"{free:.0f} {unit} free" if unit == "B" else f"{free:.1f} {unit} free"
        free /= 1000
    return ""


def describe_os_error(err: OSError, path: str | Path | None = None, doing: str = "") -> str:
    """One line for a filesystem failure: what failed, on which path, and what would fix it."""
    path = path or err.filename
    # a failed write on an open file names none: no free space of an unrelated filesystem
    if path is None:
        what, space = (doing or "a file write",
                       "free space unknown: run with --debug to see the file")
    else:
        what, space = f"{doing} {path}" if doing else str(path), free_space(path)
    reason = err.strerror or type(err).__name__
    if err.errno == errno.EIO:
        return f"{what}: {reason}; {space}: check the disk and the free space"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{what}: no space left on device ({space}); free some space or choose another "
                "folder")
    if err.errno in (errno.EACCES, errno.EPERM):
        return (f"{what}: permission denied; choose a folder you can write to, or fix its "
                "permissions")
    if err.errno == errno.EROFS:
        return f"{what}: read-only file system; choose a writable folder"
    if err.errno == errno.ENOENT:
        return f"{what}: no such file or folder; check the path"
    if err.errno in (errno.ENOTDIR, errno.EISDIR):
        return f"{what}: {reason.lower()}; check the path"
    return f"{what}: {reason}"


def storage_error(err: OSError, path: str | Path | None = None, doing: str = "") -> StorageError:
    return StorageError(describe_os_error(err, path, doing))


_Result = TypeVar("_Result")


class Problems:
    """Collect every problem with a command's inputs before any compute, then raise them as one
    error.

        p = Problems()
        p.need(args.limit is None or args.limit >= 1, "--limit must be >= 1")
        device = p.check(resolve_device, args.device)     # None when it failed; the message is kept
        p.raise_if_any()                                  # one MeshlmError listing all of them
    """

    def __init__(self) -> None:
        self.errors: list[MeshlmError] = []

    def need(self, ok: bool, message: str) -> bool:
        if not ok:
            self.errors.append(ConfigError(message))
        return ok

    def check(self, fn: Callable[..., _Result], *args: Any, **kwargs: Any) -> _Result | None:
        """fn(*args, **kwargs), or None with its MeshlmError recorded."""
        try:
            return fn(*args, **kwargs)
        except MeshlmError as err:
            self.errors.append(err)
            return None

    def writable(self, path: str | os.PathLike, setting: str) -> bool:
        """Records a problem unless `path` (or, if it does not exist yet, its nearest existing
        parent) can be written: a virtual filesystem (/proc), a read-only filesystem, a missing
        permission or a full disk (under MIN_FREE left) is found before any work, not after it."""
        existing = nearest_existing(path)
        # the folder, or one it would be made in, is a file: not a permission problem
        if existing.is_file():
            return self.need(False, f"{setting} {path}: {existing} is a file, not a folder; choose "
                                    "a folder path")
        # a filesystem of no size (/proc, /sys): not full, but no place for files at all
        if not self.need(total_bytes(existing) != 0,
                         f"{setting} {path}: {existing} is not a place files can be created (a "
                         "virtual filesystem such as /proc or /sys); choose a folder on a disk"):
            return False
        if not self.need(os.access(existing, os.W_OK | os.X_OK),
                         f"{setting} {path}: cannot write to {existing} (read-only or no "
                         "permission); choose a folder you can write to"):
            return False
        return self.need(free_bytes(existing) >= MIN_FREE, f"{setting} {path}: no space left on "
                                                           f"device ({free_space(existing)}); free "
                                                           "some space or choose another folder")

    def raise_if_any(self) -> None:
        """One error: a usage error (exit 2) if any problem is one, else the first problem's
        kind."""
        if not self.errors:
            return
        if len(self.errors) == 1:
            raise self.errors[0]
        kind = (ConfigError if any(isinstance(e, ConfigError) for e in self.errors)
                else type(self.errors[0]))
        raise kind(f"{len(self.errors)} problems: "
                   + "; ".join(f"({i}) {e}" for i, e in enumerate(self.errors, 1)))
