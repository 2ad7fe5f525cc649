"""Example data: one example per training window, with a loss mask; shared by reasoning-task data
(meshlm.data.tasks) and fine-tuning data (meshlm.data.sft).

Every example is one block of `block` tokens, its ids then padding, so window i (seq_len = block) is
example i alone: no example attends to another (causal attention, padding after the example), and
positions start at 0 in each. `<split>-mask-NNNNN.bin` (uint8, aligned with the tokens) is 1 where a
token's loss counts; training and validation take the loss on those targets only
(meshlm.data.prepare.PreparedData.inputs_targets).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from meshlm.data.shards import MANIFEST, ShardWriter

Example = tuple[list[int], list[int]]  # token ids, and 1/0 per token: whether its loss counts


def write_split(out: Path, split: str, examples: Iterable[Example], block: int, pad_id: int,
                dtype: np.dtype) -> tuple[dict, list[dict]]:
    """Write one split's examples, each padded to `block`; returns (the split's manifest entry, its
    mask shards)."""
    tokens = ShardWriter(out, split, dtype, 1 << 40)
    mask = ShardWriter(out, f"{split}-mask", np.dtype(np.uint8), 1 << 40)
    n = 0
    for ids, loss in examples:
        pad = block - len(ids)
        tokens.write(ids + [pad_id] * pad)
        mask.write(loss + [0] * pad)
        n += 1
    tokens.write([pad_id])  # the last window's final target (never in the loss)
    mask.write([0])
    tokens.documents = mask.documents = n
    return tokens.close(), mask.close()["shards"]


def example_block(manifest: dict) -> int | None:
    """The window length of example data (task or fine-tuning data), None for a text stream."""
    section = manifest.get("task") or manifest.get("examples")
    return section["block"] if section else None


def build_cached(target: Path, make: Callable[[Path], object]) -> Path:
    """`target` holding prepared data, made once by `make(folder)`. Several processes may ask at
    once: each writes a private folder and renames it into place."""
    if (target / MANIFEST).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)
    try:
        make(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / MANIFEST).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
