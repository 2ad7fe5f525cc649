"""GPT-NeoX (Pythia) <-> meshlm names and configs: the `neox` entry of meshlm.families, under its old names.

meshlm's unique layers, in order (prelude.0 … , cores.0.0 … , cores.1.0 … , coda.0 …), are GPT-NeoX's
`gpt_neox.layers.0 …`; inside a layer the parameter names are identical. The output layer is `lm_head`
in transformers 5 modules and `embed_out` in Pythia's checkpoint files; both are accepted.
"""
from __future__ import annotations

from typing import Any

import torch

from meshlm.config import Layout, ModelConfig
from meshlm.families import FAMILIES, from_meshlm, hf_config_kwargs, to_meshlm, unique_layer_names

NEOX = FAMILIES["neox"]
__all__ = ["meshlm_to_neox", "neox_config_kwargs", "neox_to_meshlm", "unique_layer_names"]


def neox_to_meshlm(state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """GPT-NeoX state dict -> meshlm state dict (layer weights only; no scheme parameters)."""
    return to_meshlm(state, layout, NEOX)


def meshlm_to_neox(state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """meshlm state dict -> GPT-NeoX state dict (transformers 5 module names)."""
    return from_meshlm(state, layout, NEOX)


def neox_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for transformers' GPTNeoXConfig describing the same network as a vanilla cfg."""
    return hf_config_kwargs(cfg, NEOX)
