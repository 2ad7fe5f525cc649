"""Where meshlm keeps downloaded wheels, prepared datasets and what it builds for this machine
(kernels, compiled decode steps): ~/.cache/meshlm, or $MESHLM_CACHE."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """`override` if given, else $MESHLM_CACHE, else ~/.cache/meshlm (not created here)."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("MESHLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshlm"


def private(path: Path) -> bool:
    """Whether only this user could have written `path`: owned by them, not writable by group or
    others. A library built there is code a process runs, and $MESHLM_CACHE may be a folder others
    share; one that someone else could have replaced is not loaded (as ssh treats its keys)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def untrusted(target: Path) -> str | None:
    """Why the library at `target` is not loaded (it or its folder not `private`), in one line
    with the fix; None where it may be."""
    if private(target) and private(target.parent):
        return None
    return (f"{target} or its folder could have been written by another user (not yours, or "
            "writable by group or others); delete the folder to rebuild")
