"""Collect every problem with a command's inputs before any compute, then raise them as one error.

    p = Problems()
    p.need(args.limit is None or args.limit >= 1, "--limit must be >= 1")
    device = p.check(resolve_device, args.device)     # None when it failed; the message is kept
    p.raise_if_any()                                  # one MeshlmError listing all of them
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from meshlm.errors import ConfigError, MeshlmError

T = TypeVar("T")


class Problems:
    def __init__(self) -> None:
        self.errors: list[MeshlmError] = []

    def need(self, ok: bool, message: str) -> bool:
        if not ok:
            self.errors.append(ConfigError(message))
        return ok

    def check(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """fn(*args, **kwargs), or None with its MeshlmError recorded."""
        try:
            return fn(*args, **kwargs)
        except MeshlmError as err:
            self.errors.append(err)
            return None

    def writable(self, path: str | os.PathLike, setting: str) -> bool:
        """Records a problem unless `path` (or, if it does not exist yet, its nearest existing parent) can be
        written: a read-only filesystem or a missing permission is found before any work, not after it."""
        existing = Path(path).expanduser().absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        return self.need(os.access(existing, os.W_OK | os.X_OK),
                         f"{setting} {path}: cannot write to {existing} (read-only or no permission); choose a "
                         f"folder you can write to")

    def raise_if_any(self) -> None:
        """One error: a usage error (exit 2) if any problem is one, else the first problem's kind."""
        if not self.errors:
            return
        if len(self.errors) == 1:
            raise self.errors[0]
        kind = ConfigError if any(isinstance(e, ConfigError) for e in self.errors) else type(self.errors[0])
        raise kind(f"{len(self.errors)} problems: " + "; ".join(f"({i}) {e}" for i, e in enumerate(self.errors, 1)))
