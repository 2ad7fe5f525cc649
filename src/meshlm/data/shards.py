"""On-disk format of prepared data: raw token shards plus manifest.json.

A prepared folder holds, per split, files `<split>-00000.bin`, `<split>-00001.bin`, ... of native-endian
uint16 (when every id fits, i.e. vocab <= 65,536) or uint32 token ids, each at most `shard_tokens` long;
together they form one token stream in which id EOS ends every document. No header: np.memmap opens them
directly. manifest.json, written last (atomically), records the dtype, the tokenizer, the shards with
their token counts and where the data came from; a folder without it is not (or not completely) prepared.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from meshlm.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "meshlm-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids 0 .. vocab_size - 1."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ShardWriter:
    """Appends token ids of one split to shard files as they come: memory use is one write's worth."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        if shard_tokens < 1:
            raise DataError(f"shard size {shard_tokens} tokens is below 1; use e.g. 100000000")
        self.out_dir, self.split, self.dtype, self.shard_tokens = Path(out_dir), split, dtype, shard_tokens
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
            self._file.write(arr[:room].tobytes())
            self.shards[-1]["tokens"] += min(room, arr.size)
            arr = arr[room:]

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.out_dir / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> dict:
        """Finish the last shard; returns this split's manifest entry."""
        if self._file is not None:
            self._file.close()
            self._file = None
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    tmp = Path(out_dir) / f".{MANIFEST}.tmp"
    try:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, Path(out_dir) / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{data_dir} holds no prepared data ({MANIFEST} missing); run `meshlm prepare` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is unreadable or corrupt ({err}); run `meshlm prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not in format {FORMAT}; prepare the data again with this meshlm")
    return manifest


def open_shards(data_dir: str | os.PathLike, manifest: dict, split: str) -> list[np.memmap]:
    """Read-only memory maps of one split's shards, after checking each file has its recorded size."""
    return open_files(data_dir, manifest["splits"][split]["shards"], np.dtype(manifest["dtype"]))


def open_loss_mask(data_dir: str | os.PathLike, manifest: dict, split: str) -> list[np.memmap] | None:
    """Task data (meshlm.data.tasks): the split's uint8 answer-mask shards, aligned with its tokens; else None."""
    masks = manifest.get("loss_mask")
    return None if masks is None else open_files(data_dir, masks[split], np.dtype(np.uint8))


def open_files(data_dir: str | os.PathLike, shards: list[dict], dtype: np.dtype) -> list[np.memmap]:
    maps = []
    for shard in shards:
        path = Path(data_dir) / shard["file"]
        expected = shard["tokens"] * dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise DataError(f"shard {path} is missing or not {expected} bytes long; run `meshlm prepare` again")
        maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
    return maps


def clear_prepared(out_dir: Path) -> None:
    """Remove the manifest (first, so a half-cleared folder never looks prepared) and the shard files."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for path in out_dir.glob("*-[0-9][0-9][0-9][0-9][0-9].bin"):
        path.unlink()
