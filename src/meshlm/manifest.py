"""What a meshlm checkpoint folder holds, by name, and the checked reading of its JSON files.

config.json carries `FORMAT`; manifest.json (`MANIFEST_FORMAT`) lists every other file with its size
and SHA-256, plus a digest of that list, so an edit of the list itself shows. meshlm.checkpoint
writes and verifies checkpoints over these pieces; `read_json` is also the reader of every model
folder's JSON files (meshlm.interop.folders).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from meshlm.errors import CheckpointError

WEIGHTS, STATE, CONFIG, TOKENIZER = "model.safetensors", "state.pt", "config.json", "tokenizer.json"
MANIFEST = "manifest.json"
FORMAT = "meshlm-checkpoint/1"
MANIFEST_FORMAT = "meshlm-manifest/1"


def digest(files: dict[str, Any]) -> str:
    """SHA-256 of the file list itself: a manifest edited by hand no longer matches it."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def read_json(file: Path, fix: str = "use an earlier checkpoint") -> dict[str, Any]:
    """The one reader of meshlm's JSON object files (a checkpoint's config.json and manifest.json,
    any model folder's config.json or weight index): a CheckpointError naming the file and `fix`
    if it is missing, unreadable or not an object."""
    return read_json_and_digest(file, fix)[0]


def read_json_and_digest(file: Path, fix: str = "use an earlier checkpoint"
                         ) -> tuple[dict[str, Any], str]:
    """read_json, and the SHA-256 of the very bytes it parsed: what a reader compares with a
    manifest to know that the config it built from is the one verified (not a later rewrite)."""
    try:
        raw = file.read_bytes()
        data = json.loads(raw.decode())
    except FileNotFoundError:
        raise missing(file) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is unreadable or not JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object; {fix}")
    return data, hashlib.sha256(raw).hexdigest()


def missing(file: Path) -> CheckpointError:
    """A checkpoint file that is not there. With its whole folder gone, the checkpoint was pruned
    while being read (a training still running keeps only its newest ones), not left incomplete."""
    if not file.parent.is_dir():
        return CheckpointError(f"checkpoint {file.parent} was removed while being read (a training "
                               "still running prunes its older checkpoints); open the run folder "
                               "again to read its newest one")
    return CheckpointError(f"{file} is missing: the checkpoint is incomplete; use an earlier one")


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The checked file list of a checkpoint dir; CheckpointError if it is missing, unreadable or
    edited."""
    file = path / MANIFEST
    if not path.is_dir():
        raise missing(file)
    if not file.is_file():
        legacy = (path / CONFIG).is_file() and "files" in read_json_or_empty(path / CONFIG)
        why = ("it was written by meshlm before checksums covered config.json; if you trust it, "
               "seal it with `python "
               f"-m meshlm.checkpoint reseal {path}`") if legacy else "the checkpoint is incomplete"
        raise CheckpointError(f"{file} is missing: {why}; or use an earlier checkpoint")
    manifest = read_json(file)
    try:
        files = manifest["files"]
        ok = manifest.get("format") == MANIFEST_FORMAT and manifest.get("sha256") == digest(files)
    except (KeyError, TypeError) as err:  # a JSON object without the manifest's fields
        raise CheckpointError(f"{file} is corrupt (it lacks a manifest's fields: {err}); use an "
                              f"earlier checkpoint") from None
    if not ok:
        raise CheckpointError(f"{file} was edited or is corrupt (its digest does not match its "
                              "file list); use an earlier checkpoint")
    return files


def read_json_or_empty(path: Path) -> dict:
    """read_json, or {} where that would be a CheckpointError (missing, unreadable, not an
    object): for readers that only ask whether a file says something."""
    try:
        return read_json(path)
    except CheckpointError:
        return {}

