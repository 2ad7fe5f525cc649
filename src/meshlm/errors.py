"""Errors that mean "the user asked for something impossible" or "the world got in the way": the CLI prints
them as one line (no traceback unless --debug / MESHLM_DEBUG=1) and exits with the error's `exit_code`:
2 for usage (a bad argument or config value), 1 for a runtime failure (missing data, corrupt checkpoint,
full disk), 130 / 143 after Ctrl-C / SIGTERM."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path


class MeshlmError(Exception):
    """Base class: the message names the problem and the fix."""

    exit_code = 1


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


def free_space(path: str | Path) -> str:
    """Free space of the filesystem holding `path` (or its nearest existing parent), e.g. "1.2 GB free"."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if free < 1000 or unit == "TB":
            return f"{free:.0f} {unit} free" if unit == "B" else f"{free:.1f} {unit} free"
        free /= 1000
    return ""


def describe_os_error(err: OSError, path: str | Path | None = None, doing: str = "") -> str:
    """One line for a filesystem failure: what failed, on which path, and what would fix it."""
    path = path or err.filename or "?"
    what = f"{doing} {path}" if doing else str(path)
    reason = err.strerror or type(err).__name__
    if err.errno == errno.EIO:
        return f"{what}: {reason}; {free_space(path)}: check the disk and the free space"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{what}: no space left on device ({free_space(path)}); free some space or choose another folder"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{what}: permission denied; choose a folder you can write to, or fix its permissions"
    if err.errno == errno.EROFS:
        return f"{what}: read-only file system; choose a writable folder"
    if err.errno == errno.ENOENT:
        return f"{what}: no such file or folder; check the path"
    if err.errno in (errno.ENOTDIR, errno.EISDIR):
        return f"{what}: {reason.lower()}; check the path"
    return f"{what}: {reason}"


def storage_error(err: OSError, path: str | Path | None = None, doing: str = "") -> StorageError:
    return StorageError(describe_os_error(err, path, doing))
