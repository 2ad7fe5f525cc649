"""Atomic outputs: a file or folder meshlm writes appears complete or not at all, and what it
replaces stays until then.

    atomic.write_text(path, text)                 # eval.json, probe.json, report.html
    atomic.write_bytes(path, data)                # figures
    atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp)))
        # any writer that takes a path
    with atomic.new_folder(out) as tmp:           # a converted folder: built in tmp, then renamed
                                                    to out
        ...

A file goes to a temp sibling `.<name>.<pid>.tmp` (same folder, so the rename cannot cross
filesystems), is fsynced, and `os.replace`d over the target; then the folder is fsynced so the
rename survives a crash. A failure (a full disk, Ctrl-C) removes the temp and leaves the old file
untouched. Filesystem errors become a StorageError naming the target and its own filesystem's free
space (meshlm.errors.describe_os_error). Checkpoints have their own writer (meshlm.checkpoint),
which also seals a manifest.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from safetensors import SafetensorError

from meshlm.errors import storage_error


def fsync_path(path: Path) -> None:
    """fsync a file or folder by path (a folder: so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path, suffix: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{suffix}")


def write_with(path: str | os.PathLike, write: Callable[[Path], object],
               doing: str = "writing") -> Path:
    """`write(tmp)` writes the content to the temp path it is given; then it replaces `path`
    atomically."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except (OSError, SafetensorError) as err:
        tmp.unlink(missing_ok=True)  # first, so the message shows the space there really is
        raise storage_error(as_os_error(err), path, doing) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_bytes(path: str | os.PathLike, data: bytes, doing: str = "writing") -> Path:
    return write_with(path, lambda tmp: tmp.write_bytes(data), doing)


def write_text(path: str | os.PathLike, text: str, doing: str = "writing") -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), doing)


@contextlib.contextmanager
def new_folder(final: str | os.PathLike, doing: str = "writing") -> Iterator[Path]:
    """Yields a temp sibling folder to fill; when the block ends, its files are fsynced and it
    replaces `final` (replace_folder). A failure inside the block removes the temp folder: no
    half-written folder is left to block a rerun, and what `final` held stays."""
    final = Path(final)
    tmp = temp_sibling(final, "partial")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync_path(file)
        replace_folder(tmp, final)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise storage_error(as_os_error(err), final, doing) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` to `final`, replacing a folder there (renamed aside first,
    removed after: at every moment one complete version is in place, or for an instant none), then
    fsync the parent."""
    fsync_path(tmp)
    if final.exists():
        trash = temp_sibling(final, "old")
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(final.parent)


def as_os_error(err: Exception) -> OSError:
    """The filesystem error behind a failed write: safetensors and torch.save report a full disk as
    their own errors ("... os error 28", "file write failed"), not as OSError."""
    if isinstance(err, OSError):
        return err
    # io::Error's Display or Debug form
    found = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(err))
    if found:
        code = int(found.group(1) or found.group(2))
        return OSError(code, os.strerror(code))
    return OSError(errno.EIO, f"the write failed ({str(err).splitlines()[0][:80]})")
