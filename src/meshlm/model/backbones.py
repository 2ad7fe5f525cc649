"""The layer kinds ("backbones") and the stacks the loop runs. Nothing here knows about looping.

    backbone   layer class                      norm        feed-forward
    neox       meshlm.model.layers.NeoXLayer    LayerNorm   GELU MLP (parallel residual)
    llama      meshlm.model.llama.LlamaLayer    RMSNorm     SwiGLU
    olmoe      meshlm.model.moe.OlmoeLayer      RMSNorm     top-k routed SwiGLU experts

Adding a backbone is a layer class (a `Layer` subclass) registered here, its fields in meshlm.config and
its checkpoint mapping in meshlm.interop.families; the loop (meshlm.model.lm) and the schemes do not change.
"""
from __future__ import annotations

import torch
from torch import nn

from meshlm.config import ModelConfig
from meshlm.model.kv_cache import LayerCache
from meshlm.model.layers import Layer, NeoXLayer, Rope
from meshlm.model.llama import LlamaLayer
from meshlm.model.moe import OlmoeLayer

LAYERS: dict[str, type[Layer]] = {"neox": NeoXLayer, "llama": LlamaLayer, "olmoe": OlmoeLayer}


def final_norm(cfg: ModelConfig) -> nn.Module:
    """The norm before the output layer: the backbone's own kind (LayerNorm or RMSNorm)."""
    return LAYERS[cfg.backbone].norm(cfg)


class Stack(nn.ModuleList):
    """An ordinary stack of layers (prelude, one core, or coda): f(h) returns a full state, not a delta."""

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__(LAYERS[cfg.backbone](cfg) for _ in range(n_layers))

    def forward(self, h: torch.Tensor, rope: Rope, mask: torch.Tensor | None, cache: LayerCache | None = None,
                first_slot: int = 0, router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Layer i of this stack uses cache slot first_slot + i (one slot per unrolled layer)."""
        for i, layer in enumerate(self):
            h = layer(h, rope, mask, cache, first_slot + i, router_logits)
        return h
