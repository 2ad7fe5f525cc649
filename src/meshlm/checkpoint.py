"""Checkpoints that describe themselves, written atomically (read back verified by
meshlm.folders.integrity).

    <run>/
      step-000600/
        model.safetensors   full (unsharded) weights, fp32, names as MeshLM.state_dict()
        state.pt            optimizer (keyed by parameter name), scheduler, RNG, step, best val
                            loss; plain tensors and containers only: loaded with
                            torch.load(weights_only=True)
        tokenizer.json      the tokenizer, unless it is the shipped "default"
                            (meshlm.folders.locate: a folder's own tokenizer file wins over the
                            one its training config names)
        config.json         {"model": ModelConfig, "train": TrainConfig, "step", "val_loss"}
        manifest.json       {"format", "files": {name: {"bytes", "sha256"}}, "sha256"}: every file
                            above, config.json included, plus a digest of that list; written last,
                            it seals them
      latest                "step-000600": the newest complete checkpoint (replaced atomically)
      best                  the checkpoint with the lowest validation loss
      metrics.jsonl

The file names, the formats, the checked reading of config.json and manifest.json and the verified
reading of a checkpoint (resolve, verify, load_checkpoint) live in meshlm.folders.integrity.

`write_checkpoint` is the one writer: training (`save_checkpoint`, which adds the pointers and
pruning), `meshlm convert` and `meshlm retrofit` (a single step-0 folder without state.pt) all go
through it.

Atomicity: a checkpoint is written into `.tmp-step-…`, every file fsynced, then the directory is
renamed into place (rename is atomic on POSIX) and the parent fsynced; pointers are written to a
temp file and `os.replace`d. A crash leaves either the old state or the new one, never a half
checkpoint under a real name; `find_resumable` falls back to the previous checkpoint that verifies.
A failed write (full disk, no permission) removes its temporary folder and names the path and the
free space; the checkpoints written before stay as they were.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from meshlm import atomic
from meshlm.atomic import as_os_error, fsync_path
from meshlm.data.hashing import sha256_file
from meshlm.errors import CheckpointError, storage_error
from meshlm.folders.integrity import (
    CONFIG,
    FORMAT,
    MANIFEST,
    MANIFEST_FORMAT,
    STATE,
    TOKENIZER,
    WEIGHTS,
    Checkpoint,
    digest,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    read_pointer,
    resolve,
    verify,
)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# -- writing ---------------------------------------------------------------------------------------
def write_checkpoint(folder: str | Path, weights: dict[str, torch.Tensor], meta: dict[str, Any],
                     state: dict[str, Any] | None = None, tokenizer: Path | None = None) -> Path:
    """Write one checkpoint folder atomically: the one writer of meshlm checkpoints (training,
    conversion, retrofit). `meta` must hold "model" and "step"; `state` (optimizer, RNG, …) is only
    for resumable runs; `tokenizer`: a tokenizer.json to carry, so the checkpoint stands alone. An
    existing `folder` is replaced."""
    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt"})
        # safetensors writes 0600; the others follow the umask
        os.chmod(tmp / WEIGHTS, 0o666 & ~UMASK)
        names = [WEIGHTS]
        if state is not None:
            _save_state(state, tmp / STATE)
            names.append(STATE)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
            names.append(TOKENIZER)
            meta = {**meta, "tokenizer": TOKENIZER}
        seal(tmp, meta, names)
        atomic.replace_folder(tmp, folder)
    except (OSError, SafetensorError) as err:
        # first, so the message shows the space there really is
        shutil.rmtree(tmp, ignore_errors=True)
        raise storage_error(as_os_error(err), folder, "writing checkpoint") from None
    finally:
        # gone after the rename; after a failure, the partial write
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _read_umask() -> int:
    # the only way to read it: set and restore, once at import (before any thread writes)
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()


def save_model(model, folder: str | Path, meta: dict[str, Any] | None = None,
               tokenizer: Path | None = None) -> Path:
    """A MeshLM as a step-0 checkpoint folder without optimizer state (what convert and retrofit
    write); meshlm.loading.open_model reads it back and `train.init_from` continues training from
    it."""
    return write_checkpoint(folder, model.state_dict(),
                            {"model": model.config.to_dict(), "step": 0, **(meta or {})},
                            tokenizer=tokenizer)


def save_checkpoint(run_dir: str | Path, step: int, weights: dict[str, torch.Tensor],
                    state: dict[str, Any],
                    meta: dict[str, Any], keep_last: int = 3, is_best: bool = False,
                    tokenizer: Path | None = None) -> Path:
    """Write <run>/step-NNNNNN atomically, update `latest` (and `best`), prune old checkpoints.
    `tokenizer`: a tokenizer.json to carry along (one that is not built in), so the checkpoint
    stands alone."""
    run_dir = Path(run_dir)
    bad = [name
           for name, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"refusing to save step {step}: non-finite values in {bad[0]} "
                              f"(and {len(bad) - 1} more); the run diverged, lower train.lr")
    final = write_checkpoint(run_dir / step_dir_name(step), weights, {**meta, "step": step}, state,
                             tokenizer)
    _write_pointer(run_dir / "latest", final.name)
    if is_best:
        _write_pointer(run_dir / "best", final.name)
    prune(run_dir, keep_last)
    return final


def _save_state(state: dict[str, Any], path: Path) -> None:
    """torch.save, with a failed write (its RuntimeError: "file write failed", "unexpected pos", …)
    turned into the OSError it is: ENOSPC when the disk is (nearly) full."""
    try:
        torch.save(state, path)
    except RuntimeError as err:
        full = shutil.disk_usage(path.parent).free < (1 << 20)
        raise OSError(errno.ENOSPC if full else errno.EIO, "No space left on device" if full else
                      f"the write failed ({str(err).splitlines()[0][:80]})", str(path)) from None


def seal(folder: Path, meta: dict[str, Any], names: list[str]) -> None:
    """Finish a checkpoint folder: config.json (`meta`), then manifest.json over `names` and
    config.json, then fsync everything (the end of write_checkpoint)."""
    _write_json(folder / CONFIG, {**meta, "format": FORMAT})
    files = {name: _describe(folder / name) for name in (*names, CONFIG)}
    _write_json(folder / MANIFEST,
                {"format": MANIFEST_FORMAT, "files": files, "sha256": digest(files)})
    for name in (*names, CONFIG, MANIFEST):
        fsync_path(folder / name)
    fsync_path(folder)


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, never the `best` one; drop stale temp
    dirs."""
    best = read_pointer(run_dir / "best")
    for old in list_checkpoints(run_dir)[keep_last:]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)
    for stale in run_dir.glob(".t*-step-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def _describe(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_pointer(path: Path, target: str) -> None:
    atomic.write_text(path, target + "\n", "updating")


# -- sealing old checkpoints, resuming -------------------------------------------------------------
def reseal(path: str | Path, force: bool = False) -> Path:
    """Write manifest.json for a checkpoint from before manifests, after checking the files its
    config.json lists. Only for checkpoints you trust: config.json itself was never checksummed. A
    checkpoint that already has a manifest is left alone when it verifies, and refused when it does
    not (its files were edited after sealing) unless `force`: resealing would otherwise sign any
    edit."""
    path = resolve(path)
    if (path / MANIFEST).is_file() and not force:
        try:
            verify(path)
        except CheckpointError as err:
            raise CheckpointError(f"{path} is already sealed and no longer matches its {MANIFEST} "
                                  f"({err}); reseal only seals checkpoints from before manifests: "
                                  "pass --force to re-sign an edit you made and trust") from None
        return path / MANIFEST
    meta = read_meta(path)
    for name, expected in meta.get("files", {}).items():
        if sha256_file(path / name) != expected["sha256"]:
            raise CheckpointError(f"{path / name} does not match config.json; use an earlier "
                                  "checkpoint")
    names = [n for n in (WEIGHTS, STATE, TOKENIZER) if (path / n).is_file()]
    files = {name: _describe(path / name) for name in (*names, CONFIG)}
    tmp = path / f".{MANIFEST}.{os.getpid()}"
    _write_json(tmp, {"format": MANIFEST_FORMAT, "files": files, "sha256": digest(files)})
    os.replace(tmp, path / MANIFEST)
    return path / MANIFEST


def find_resumable(run_dir: str | Path, warn: Callable[[str], None] = print) -> Checkpoint | None:
    """The newest checkpoint that verifies and loads; a bad one is reported and skipped (not
    deleted)."""
    for path in list_checkpoints(run_dir):
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            warn(f"warning: skipping checkpoint {path.name}: {err}")
    return None


if __name__ == "__main__":  # python -m meshlm.checkpoint reseal PATH [--force]
    import sys

    args = [a for a in sys.argv[1:] if a != "--force"]
    if len(args) != 2 or args[0] != "reseal":
        sys.exit("usage: python -m meshlm.checkpoint reseal CHECKPOINT_DIR [--force]")
    try:
        print(f"sealed: {reseal(args[1], force='--force' in sys.argv[1:])}")
    except CheckpointError as err:
        sys.exit(f"error: {err}")
