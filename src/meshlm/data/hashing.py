"""File digests shared by checkpoints (integrity), conversion (integrity) and fetch (pinned
wheels)."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks (checkpoints can be many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
