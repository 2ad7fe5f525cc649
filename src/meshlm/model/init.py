"""Every initialisation of a meshlm model, in one place.

| parameter                                         | init                                         |
|---------------------------------------------------|----------------------------------------------|
| input and output embeddings, every other Linear   | normal(0, init_std = 0.02), biases 0         |
| (incl. the MoE expert router and experts' gate/up)|                                              |
| output projections (attention.dense,              | normal(0, init_std / √(2·N)), N = unrolled   |
| dense_4h_to_h, self_attn.o_proj, mlp.down_proj,   | depth (if scale_output_init; else init_std)  |
| experts.down_proj)                                |                                              |
| LayerNorm, RMSNorm (incl. QK-norm)                | weight 1 (bias 0)                            |
| MeSH routers                                      | normal(0, router_init_std = 0.02), bias 0:   |
|                                                   | near-uniform routing at the start            |
| static-mix α                                      | alpha_init (default 1, 1, 0)                 |
| dynamic-mix Linear(d, 3)                          | weight normal(0, router_init_std), bias =    |
|                                                   | alpha_init: starts as the static mix         |
| per-loop LoRA deltas (A_t, B_t)                   | A Kaiming-uniform (a = √5, as PEFT), B = 0:  |
|                                                   | the model starts as its base model; drawn    |
|                                                   | last, so the base weights are the same draws |

N counts *unrolled* layers (P + ΣC·K + D): a looped core adds to the residual stream K times, so its
output projections are scaled as if it were K distinct layers. The same table holds for every
backbone.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from meshlm.config import ModelConfig
from meshlm.model.layers import Layer, RMSNorm
from meshlm.model.loop_lora import LowRank, init_low_rank
from meshlm.model.memory import Router
from meshlm.model.moe import Experts
from meshlm.model.schemes import DynamicAlpha, StaticAlpha


def output_projections(model: nn.Module) -> set[str]:
    """Full names of the Linears each layer names as writing into the residual stream."""
    return {f"{where}.{name}" for where, layer in model.named_modules() if isinstance(layer, Layer)
            for name, _ in layer.named_modules()
            if name and name.endswith(type(layer).output_projections)}


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    out_std = (cfg.init_std / math.sqrt(2 * cfg.layout.unrolled_depth) if cfg.scale_output_init
               else cfg.init_std)
    alpha_init = torch.tensor(model.scheme.options.get("alpha_init", [1.0, 1.0, 0.0]))
    scaled = output_projections(model)
    for name, module in model.named_modules():  # generic pass: layers, embeddings, norms
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = out_std if name in scaled else cfg.init_std
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, std=cfg.init_std)
            nn.init.normal_(module.down_proj, std=out_std)
    for module in model.scheme.modules():  # scheme pass: overrides the generic init of its Linears
        if isinstance(module, Router):
            nn.init.normal_(module.weight, std=cfg.router_init_std)
            nn.init.zeros_(module.bias)
        elif isinstance(module, StaticAlpha):
            module.alpha.copy_(alpha_init)
        elif isinstance(module, DynamicAlpha):
            nn.init.normal_(module.proj.weight, std=cfg.router_init_std)
            module.proj.bias.copy_(alpha_init)
    # per-loop LoRA pass: last, so the other draws do not depend on it
    for module in model.modules():
        if isinstance(module, LowRank):
            init_low_rank(module)
