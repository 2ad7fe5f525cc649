"""The names of what a run trains (`train.trainable`, `train.lora_targets`), checked without a
model.

Plain strings only, so the training config validates them without importing torch or the model;
meshlm.adapters applies them to a MeshLM (PEFT LoRA, the frozen set).
"""
from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError

SECTIONS = ("prelude", "core", "coda")
TRAINABLE = ("all", "lora", "loop_lora", "routers", "scheme", "embeddings", *SECTIONS)


def words(text: str) -> list[str]:
    """"a, b,,c" -> ["a", "b", "c"]."""
    return [w.strip() for w in text.split(",") if w.strip()]


def trainable_roles(trainable: str, spec: Any = None) -> list[str]:
    """The roles that train: `trainable` as given, or its default (meshlm.adapters' docstring) for
    `spec`, a meshlm.adapters.LoraSpec or None without LoRA."""
    if trainable.strip():
        roles = words(trainable)
        unknown = sorted(set(roles) - set(TRAINABLE))
        if unknown:
            raise ConfigError(f"trainable={trainable!r}: {unknown} unknown; use all or roles from "
                              f"{', '.join(TRAINABLE[1:])}")
        return roles
    if spec is None:
        return ["all"]
    return ["lora", "routers"] if spec.trains_routers else ["lora"]
