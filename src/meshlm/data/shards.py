"""On-disk format of prepared data: raw token shards plus manifest.json.

A prepared folder holds, per split, files `<split>-00000.bin`, `<split>-00001.bin`, ... of
native-endian uint16 (when every id fits, i.e. vocab <= 65,536) or uint32 token ids, each at most
`shard_tokens` long; together they form one token stream in which id EOS ends every document. No
header: np.memmap opens them directly. manifest.json, written last (atomically), records the dtype,
the tokenizer, the shards with their token counts, SHA-256 and largest id, and where the data came
from; a folder without it is not (or not completely) prepared.

Opening a split checks each shard's size, and its SHA-256 once per process (a shard changed in
place, even to ids that stay in the vocabulary, would otherwise train silently): ~2 GB/s, about 10
ms for the embedded corpus. Training checks the largest id against the model's vocabulary before
step 0 (`max_id`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshlm import atomic
from meshlm.atomic import fsync_path
from meshlm.errors import DataError, storage_error

MANIFEST = "manifest.json"
FORMAT = "meshlm-tokens-v1"
SHARD_GLOB = "*-[0-9][0-9][0-9][0-9][0-9].bin"  # train-00000.bin, val-mask-00000.bin, ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids 0 .. vocab_size - 1."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ShardWriter:
    """Appends token ids of one split to shard files as they come: memory use is one write's
    worth."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        if shard_tokens < 1:
            raise DataError(f"shard size {shard_tokens} tokens is below 1; use e.g. 100000000")
        self.out_dir, self.split, self.dtype, self.shard_tokens = (Path(out_dir), split, dtype,
                                                                   shard_tokens)
        self.shards: list[dict] = []  # {"file", "tokens"} of every shard opened so far
        self.documents = 0
        self._file = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def write(self, ids: list[int] | np.ndarray) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        while arr.size:
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            chunk = arr[:room]
            self._file.write(chunk.tobytes())
            self._hash.update(chunk.tobytes())
            self.shards[-1]["tokens"] += chunk.size
            self.shards[-1]["max_id"] = max(self.shards[-1]["max_id"], int(chunk.max()))
            arr = arr[room:]

    def _open_next(self) -> None:
        self._finish()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file, self._hash = open(self.out_dir / name, "wb"), hashlib.sha256()
        self.shards.append({"file": name, "tokens": 0, "max_id": 0})

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def close(self) -> dict:
        """Finish the last shard; returns this split's manifest entry."""
        self._finish()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    atomic.write_text(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{data_dir} holds no prepared data ({MANIFEST} missing); run `meshlm "
                        "prepare` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is "
                        f"unreadable or corrupt ({err}); run `meshlm prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is "
                        f"not in format {FORMAT}; prepare the data again with this meshlm")
    return manifest


def open_shards(data_dir: str | os.PathLike, manifest: dict, split: str) -> list[np.memmap]:
    """Read-only memory maps of one split's shards, after checking each file has its recorded
    size."""
    return open_files(data_dir, manifest["splits"][split]["shards"], np.dtype(manifest["dtype"]))


def open_loss_mask(data_dir: str | os.PathLike, manifest: dict,
                   split: str) -> list[np.memmap] | None:
    """Task data (meshlm.data.tasks): the split's uint8 answer-mask shards, aligned with its tokens;
    else None."""
    masks = manifest.get("loss_mask")
    return None if masks is None else open_files(data_dir, masks[split], np.dtype(np.uint8))


def open_labels(data_dir: str | os.PathLike, manifest: dict,
                split: str) -> list[np.memmap] | None:
    """Labelled task data (meshlm.data.tasks): the split's label shards, in the tokens' dtype and
    aligned with them (the target of position i at i; the dtype's largest value where there is
    none); else None."""
    labels = manifest.get("labels")
    return None if labels is None else open_files(data_dir, labels[split],
                                                  np.dtype(manifest["dtype"]))


def open_files(data_dir: str | os.PathLike, shards: list[dict], dtype: np.dtype) -> list[np.memmap]:
    maps = []
    for shard in shards:
        path = Path(data_dir) / shard["file"]
        expected = shard["tokens"] * dtype.itemsize
        stat = path.stat() if path.is_file() else None
        if stat is None or stat.st_size != expected:
            raise DataError(f"shard {path} is missing or not {expected} bytes long; run `meshlm "
                            "prepare` again")
        if (shard.get("sha256")
            and _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns) != shard["sha256"]):
            raise DataError(f"shard {path} does not match its checksum in {MANIFEST} (changed or "
                            "corrupt since it was prepared); run `meshlm prepare` again")
        maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
    return maps


@functools.lru_cache(maxsize=1024)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's SHA-256, once per process for a given (path, size, mtime): ranks and splits open it
    again."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def max_id(manifest: dict, split: str, maps: list[np.memmap]) -> int:
    """The largest token id of a split: from the manifest, or read off its open shards `maps` for
    data prepared before meshlm recorded it."""
    shards = manifest["splits"][split]["shards"]
    if all("max_id" in s for s in shards):
        return max((s["max_id"] for s in shards if s["tokens"]), default=0)
    return max((int(m.max()) for m in maps if len(m)), default=0)


@contextlib.contextmanager
def staged(out_dir: Path) -> Iterator[Path]:
    """A staging folder inside `out_dir` (same filesystem) to write a prepared set into; when the
    block ends it is installed (install_prepared). A failure (a full disk, Ctrl-C) removes it and
    leaves what `out_dir` held, prepared data included, as it was; a filesystem error names
    `out_dir` and its free space."""
    staging = out_dir / f".prepare-{os.getpid()}"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        yield staging
        install_prepared(staging, out_dir)
    except OSError as err:
        # first, so the message shows the space there really is
        shutil.rmtree(staging, ignore_errors=True)
        raise storage_error(err, out_dir, "writing prepared data to") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def install_prepared(staging: Path, out_dir: Path) -> None:
    """Move a complete prepared set from `staging` into `out_dir`, replacing the prepared data
    there: the old manifest goes first and the new one comes last, so the folder never looks
    prepared with a mix of old and new shards. Only renames: an instant, not the tokenising."""
    new = sorted(path.name for path in staging.iterdir() if path.name != MANIFEST)
    for name in (*new, MANIFEST):
        fsync_path(staging / name)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for name in new:
        os.replace(staging / name, out_dir / name)
    for old in out_dir.glob(SHARD_GLOB):
        if old.name not in new:
            old.unlink()
    os.replace(staging / MANIFEST, out_dir / MANIFEST)
    fsync_path(out_dir)
