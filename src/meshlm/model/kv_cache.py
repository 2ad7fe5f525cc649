"""The looped KV cache: one key/value entry per *unrolled* layer, not per module.

A looped model reuses each core layer K times, but every pass attends over different hidden states, so each
pass needs its own keys and values. The cache therefore has one slot per unrolled layer, in execution order:

    "2+3R2+1":  slot 0 1 │ 2 3 4 │ 5 6 7 │ 8
                prelude  │ core, pass 0 │ core, pass 1 │ coda        (modules: prelude.0-1, cores.0.0-2, coda.0)

`slot_offsets` gives the first slot of every stage; `MeshLM.forward` hands each stage its offset. The MeSH
buffer, the anchors and every scheme state are per token, so decoding needs no cache for them (spec §4).

Any object with `update(key, value, layer_idx) -> (keys, values)` and `get_seq_length() -> int` works as a
cache: this `KVCache`, or a `transformers` `DynamicCache` (the public `Cache` API, which `generate()` passes
in). Keys are stored after rotary, so positions are baked in. Shapes: key/value (B, H, T, hd).
"""
from __future__ import annotations

from typing import Protocol

import torch

from meshlm.config import Layout


class LayerCache(Protocol):
    """What the attention layers need from a cache (satisfied by transformers' `Cache` too)."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def get_seq_length(self) -> int:
        ...


class KVCache:
    """A growing per-slot key/value store. Slots are created on first use, so a `loops` override works."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []  # per slot: (B, H, T_past, hd)
        self.values: list[torch.Tensor | None] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's (B, H, T, hd) key/value to slot `layer_idx`; return the slot's full history."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is not None:
            key = torch.cat([self.keys[layer_idx], key], dim=-2)
            value = torch.cat([self.values[layer_idx], value], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens already cached (every slot holds the same number after a full forward)."""
        if layer_idx >= len(self.keys) or self.keys[layer_idx] is None:
            return 0
        return self.keys[layer_idx].shape[-2]

    def __len__(self) -> int:
        return len(self.keys)

    def crop(self, length: int, slots: range | None = None) -> None:
        """Forget every token after the first `length` in `slots` (default: all), as transformers'
        `DynamicCache.crop`; speculative decoding rolls rejected draft tokens back with it."""
        for i in range(len(self.keys)) if slots is None else slots:
            if i < len(self.keys) and self.keys[i] is not None:
                self.keys[i], self.values[i] = self.keys[i][..., :length, :], self.values[i][..., :length, :]

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in `index` (e.g. drop finished sequences)."""
        self.keys = [None if k is None else k[index] for k in self.keys]
        self.values = [None if v is None else v[index] for v in self.values]


def slot_offsets(layout: Layout, schedule: tuple[int, ...]) -> tuple[int, list[int], int, int]:
    """First cache slot of the prelude, of each loop step, of the coda, and the total slot count."""
    step_offsets, next_slot = [], layout.prelude
    for core_index in schedule:
        step_offsets.append(next_slot)
        next_slot += layout.cores[core_index]
    return 0, step_offsets, next_slot, next_slot + layout.coda
