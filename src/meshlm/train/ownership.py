"""One owner per run folder: `meshlm train` holds a lock on <run>/.owner for the run's whole life.

Two trainings started with the same run name used to both run to the end in one folder, each
deleting the other's metrics and checkpoints while reporting success. Now the second one refuses at
once, with one line naming the owner (host, PID, start time, command).

The lock is an exclusive `flock` on <run>/.owner, which holds the owner's record as JSON. The kernel
drops the lock when its process ends, however it ends (kill -9 and power loss included), so a dead
owner never blocks a `--resume`: its record is still in the file, and the next owner takes over with
a warning naming it. A clean exit empties the record. The file itself is never deleted: unlinking a
lock file lets a waiting process lock the old inode while a new one locks a new file, two owners at
once. Under
torchrun rank 0 holds the lock.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from meshlm.errors import ConfigError

OWNER_FILE = ".owner"

try:
    import fcntl
# not POSIX: no advisory locks; the folder then has no guard (documented in training.md)
except ImportError:
    fcntl = None


class RunFolderBusy(ConfigError):
    """Another process is training in this run folder (a usage error: exit 2, like the preflight
    check)."""


def describe(record: dict) -> str:
    return (f"PID {record.get('pid')} on {record.get('host')} (started {record.get('started')}: "
            f"{record.get('command', '?')})")


def busy(run_dir: Path, record: dict) -> str:
    return (f"run folder {run_dir} is in use by {describe(record)}; wait for it to finish or stop "
            "it, or train under another name (train.name=...)")


class RunOwner:
    """Context manager: hold the run folder's lock (creating the folder), or raise RunFolderBusy."""

    def __init__(self, run_dir: str | Path, warn: Callable[[str], None] = print):
        self.path = Path(run_dir) / OWNER_FILE
        self.warn = warn
        self._fd: int | None = None

    def __enter__(self) -> RunOwner:
        if fcntl is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(fd)
            os.close(fd)
            raise RunFolderBusy(busy(self.path.parent, record)) from None
        previous = _read(fd)
        # locked by nobody, yet a record: its owner died without cleaning up
        if previous.get("pid"):
            self.warn(f"warning: taking over run folder {self.path.parent} from "
                      f"{describe(previous)}, which is no longer running")
        _write(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                    "started": datetime.datetime.now().isoformat(timespec="seconds"),
                    "command": " ".join(["meshlm", *sys.argv[1:]])[:300]})
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            _write(self._fd, {})  # released cleanly: no record for the next owner to warn about
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        record = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _write(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(record) + "\n").encode() if record else b"")
    os.fsync(fd)


def owner_problem(run_dir: str | Path) -> str | None:
    """Read-only check for preflight: the line RunOwner would raise if the folder is in use now,
    else None."""
    path = Path(run_dir) / OWNER_FILE
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        # fails while an owner holds its exclusive lock
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return busy(path.parent, _read(fd))
    finally:
        os.close(fd)
