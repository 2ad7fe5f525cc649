"""The integrity of a meshlm checkpoint folder: what it holds, by name, and reading it back checked.

config.json carries `FORMAT`; manifest.json (`MANIFEST_FORMAT`) lists every other file with its size
and SHA-256, plus a digest of that list, so an edit of the list itself shows. meshlm.checkpoint
writes and seals checkpoints over these pieces; this module reads them back: `resolve` (a run dir ->
its `latest`, else its newest step-NNNNNN), `read_meta`, `verify` and `load_checkpoint`.
`read_json` is also the reader of every model folder's JSON files (meshlm.folders.formats).

Loading checks every file's size and SHA-256 against manifest.json, so truncation, corruption or an
edit (of config.json too) is reported with the file's path, and meshlm.checkpoint.find_resumable
falls back to the previous good checkpoint. A checkpoint without a manifest, or whose manifest
leaves out a file it needs or was edited, is refused. Loading never executes code: weights via
safetensors, the rest via torch.load(weights_only=True).
"""
from __future__ import annotations

import hashlib
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshlm.data.hashing import sha256_file
from meshlm.errors import CheckpointError

WEIGHTS, STATE, CONFIG, TOKENIZER = "model.safetensors", "state.pt", "config.json", "tokenizer.json"
MANIFEST = "manifest.json"
FORMAT = "meshlm-checkpoint/1"
MANIFEST_FORMAT = "meshlm-manifest/1"
STEP_DIR = re.compile(r"^step-(\d+)$")


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


@dataclass
class Checkpoint:
    """A checkpoint read back (load_checkpoint): its config.json, weights and state."""

    path: Path
    meta: dict[str, Any]  # config.json
    weights: dict[str, torch.Tensor] | None = None
    state: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return int(self.meta["step"])


# -- reading a checkpoint back ---------------------------------------------------------------------
def read_pointer(path: Path) -> str | None:
    """The checkpoint a run's `latest` or `best` pointer names; None without one."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint dirs, newest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := STEP_DIR.match(p.name))
             and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def holds_checkpoints(run_dir: str | Path) -> bool:
    """Whether `run_dir` is a run folder with a checkpoint to open: a `latest` pointer or a step-*
    dir."""
    return (Path(run_dir) / "latest").is_file() or bool(list_checkpoints(run_dir))


def resolve(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir (-> its `latest`, else its newest checkpoint)."""
    path = Path(path)
    if (path / CONFIG).is_file() or STEP_DIR.match(path.name):
        return path
    pointer = read_pointer(path / "latest")
    if pointer and (path / pointer).is_dir():
        return path / pointer
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} holds no checkpoint (no config.json, `latest` or step-* "
                              "dirs); pass a run dir or a step-NNNNNN dir")
    return found[0]


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json (of a run dir: of its newest checkpoint), checked to be one."""
    return read_meta_and_digest(path)[0]


def read_meta_and_digest(path: str | Path) -> tuple[dict[str, Any], str]:
    """read_meta, and the SHA-256 of the bytes it parsed (read_json_and_digest)."""
    file = resolve(path) / CONFIG
    meta, sha256 = read_json_and_digest(file)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a meshlm checkpoint config (format {FORMAT!r} "
                              f"expected)")
    return meta, sha256


def verify(path: str | Path, unread: tuple[str, ...] = (),
           config: tuple[dict[str, Any], str] | None = None) -> dict[str, Any]:
    """Check every file's size and SHA-256 against manifest.json, and that the manifest covers every
    file the checkpoint needs (config.json, the weights, state.pt and tokenizer.json when present or
    named); returns the metadata, parsed from the very bytes that were hashed. Files in `unread`
    (state.pt for a reader that never loads it) are checked by size only: hashing gigabytes of
    optimizer state proves nothing about the weights. `config`: (metadata, SHA-256) of config.json
    as a caller read and built from it, checked instead of a second read (no rewrite between)."""
    path = resolve(path)
    files = read_manifest(path)
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise missing(file)
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} is truncated or corrupt: {size} bytes, expected "
                                  f"{expected['bytes']}; use an earlier checkpoint")
        if name in unread or name == CONFIG:  # config.json: hashed with the bytes parsed below
            continue
        try:
            actual = sha256_file(file)
        except FileNotFoundError:
            raise missing(file) from None
        if actual != expected["sha256"]:
            raise CheckpointError(f"{file} was edited or is corrupt: its SHA-256 does not match "
                                  f"{MANIFEST}; use an earlier checkpoint")
    meta, config_hash = config or read_meta_and_digest(path)
    if CONFIG in files and config_hash != files[CONFIG]["sha256"]:
        if config and read_meta_and_digest(path)[1] == files[CONFIG]["sha256"]:  # sealed since
            raise CheckpointError(f"{path / CONFIG} changed while it was being opened (another "
                                  "process rewrote the checkpoint); open it again")
        raise CheckpointError(f"{path / CONFIG} was edited or is corrupt: its SHA-256 does not "
                              f"match {MANIFEST}; use an earlier checkpoint")
    needed = {CONFIG, WEIGHTS} | {n for n in (STATE, TOKENIZER) if (path / n).exists()}
    needed |= {meta["tokenizer"]} if isinstance(meta.get("tokenizer"), str) else set()
    uncovered = sorted(needed - set(files))
    if uncovered:
        raise CheckpointError(f"{path / MANIFEST} does not cover {', '.join(uncovered)}: the "
                              "checkpoint was edited; use an earlier checkpoint")
    return meta


def load_checkpoint(path: str | Path, with_state: bool = True, check: bool = True,
                    config: tuple[dict[str, Any], str] | None = None) -> Checkpoint:
    """Read (and verify) one checkpoint; every failure is a CheckpointError naming the file.
    `config`: the config.json read already (see verify), not read again."""
    path = resolve(path)
    meta = (verify(path, () if with_state else (STATE,), config) if check
            else config[0] if config else read_meta(path))
    try:
        weights = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as err:
        if not path.is_dir():
            raise missing(path / WEIGHTS) from None
        raise CheckpointError(f"{path / WEIGHTS} "
                              f"cannot be read ({err}); use an earlier checkpoint") from None
    state = None
    if with_state:
        try:
            state = torch.load(path / STATE, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle/zip errors have no common base class
            raise unreadable_pickle(path / STATE, err, "use an earlier checkpoint") from None
    return Checkpoint(path, meta, weights, state)


def unreadable_pickle(file: Path, err: Exception, fix: str) -> CheckpointError:
    """The one-line error for a torch.load(weights_only=True) that failed. torch's own text advises
    weights_only=False, which would run whatever code the file holds: it is never shown."""
    text = str(err)
    if "allowed global" in text or "Unsupported global" in text:  # a class or function it names
        return CheckpointError(f"{file} holds pickled Python objects beyond plain tensors, which "
                               "meshlm never unpickles (that could run code from the file); "
                               f"{fix}, or save it as safetensors (transformers: "
                               "save_pretrained(safe_serialization=True))")
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        # not a pickle at all (random bytes: "Unsupported operand 185", "invalid load key")
        found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        reason = found.group(1)[:100] if found else f"{type(err).__name__}: {text[:80]}"
        return CheckpointError(f"{file} is not a PyTorch file meshlm can read ({reason}): "
                               f"truncated, corrupt or another format; {fix}")
    return CheckpointError(f"{file} is truncated or corrupt ({type(err).__name__}: "
                           f"{text[:100]}); {fix}")
