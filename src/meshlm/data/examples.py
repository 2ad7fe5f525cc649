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

Example = tuple[list[int], list[int]]  # token ids, and per token: 1/0 whether its loss counts (a
# mask), or its target id, negative where it has none (labels)


def no_label(dtype: np.dtype) -> int:
    """The label stream's value for "no target here": the dtype's largest value (never a token id:
    ids must fit the model's vocabulary, and vocabularies stay below it)."""
    return int(np.iinfo(dtype).max)


def max_label(labels: list[np.ndarray] | None, dtype: np.dtype) -> int:
    """The largest label id in label shards (-1 without labels or with none set)."""
    empty = no_label(dtype)
    return max((int(m[m != empty].max()) for m in labels or [] if (m != empty).any()), default=-1)


def label_ids(labels: list[np.ndarray] | None, dtype: np.dtype) -> np.ndarray:
    """The distinct label ids in label shards, ascending (empty without labels)."""
    empty = no_label(dtype)
    found = [np.unique(m[m != empty]) for m in labels or []]
    return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)


def example_targets(data, indices: list[int], seq_len: int, targets: np.ndarray,
                    ignore_index: int, unlabelled: str = "ignore") -> np.ndarray:
    """The targets of windows `indices` of `data` (a meshlm.data.prepare.PreparedData) from their
    next tokens `targets`: those under the answer mask (the others `ignore_index`), or with labels
    the label stream itself (window i's positions i·seq_len …), and where a position has no label
    `ignore_index`, or with unlabelled="next" its next token (none for the window's last position,
    whose next token starts another example, or where the next token is padding); plain text
    keeps every next token."""
    if data.labels is not None:
        labels = np.stack([data.tokens(i * seq_len, (i + 1) * seq_len, data.labels)
                           for i in indices])
        rest = ignore_index
        if unlabelled == "next":
            pad = data.manifest["tokenizer"].get("pad_id")
            rest = np.full_like(targets, ignore_index)
            rest[:, :-1] = np.where(targets[:, :-1] == pad, ignore_index, targets[:, :-1])
        return np.where(labels == no_label(np.dtype(data.manifest["dtype"])), rest, labels)
    if data.masks is not None:
        masks = np.stack([data.tokens(i * seq_len + 1, (i + 1) * seq_len + 1, data.masks)
                          for i in indices])
        return np.where(masks > 0, targets, ignore_index)
    return targets


def write_split(out: Path, split: str, examples: Iterable[Example], block: int, pad_id: int,
                dtype: np.dtype, labels: bool = False) -> tuple[dict, list[dict]]:
    """Write one split's examples, each padded to `block`; returns (the split's manifest entry, its
    mask shards, or with `labels` its label shards: `<split>-labels-NNNNN.bin` in the tokens' dtype,
    the target of position i at position i, no_label(dtype) where there is none)."""
    tokens = ShardWriter(out, split, dtype, 1 << 40)
    if labels:
        side, empty = ShardWriter(out, f"{split}-labels", dtype, 1 << 40), no_label(dtype)
    else:
        side, empty = ShardWriter(out, f"{split}-mask", np.dtype(np.uint8), 1 << 40), 0
    n = 0
    for ids, extra in examples:
        pad = block - len(ids)
        tokens.write(ids + [pad_id] * pad)
        side.write([empty if labels and t < 0 else t for t in extra] + [empty] * pad)
        n += 1
    tokens.write([pad_id])  # the last window's final target (never in the loss)
    side.write([empty])
    tokens.documents = side.documents = n
    return tokens.close(), side.close()["shards"]


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
