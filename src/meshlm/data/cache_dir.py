"""Where meshlm keeps downloaded wheels and prepared datasets: ~/.cache/meshlm, or $MESHLM_CACHE."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """`override` if given, else $MESHLM_CACHE, else ~/.cache/meshlm (not created here)."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("MESHLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshlm"
