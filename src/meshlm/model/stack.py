"""The stacks the loop runs: prelude, each core and coda are plain stacks of one backbone's layers.

The layer class comes from the backbone registry (meshlm.backbones); each layer module attaches its
class there with `@layer_of`, and importing meshlm.model imports every registered backbone's module.
"""
from __future__ import annotations

import torch
from torch import nn

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.model.kv_cache import LayerCache
from meshlm.model.layers import Rope


class Stack(nn.ModuleList):
    """An ordinary stack of layers (prelude, one core, or coda): f(h) returns a full state, not a
    delta."""

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__(BACKBONES[cfg.backbone].layer(cfg) for _ in range(n_layers))

    def forward(self, h: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                cache: LayerCache | None = None,
                first_slot: int = 0,
                router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Layer i of this stack uses cache slot first_slot + i (one slot per unrolled layer)."""
        for i, layer in enumerate(self):
            h = layer(h, rope, mask, cache, first_slot + i, router_logits)
        return h
