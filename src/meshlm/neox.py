"""Mapping between meshlm and Hugging Face GPT-NeoX (Pythia) weights and configs.

meshlm's unique layers, in order (prelude.0 … , cores.0.0 … , cores.1.0 … , coda.0 …), are GPT-NeoX's
`gpt_neox.layers.0 …`; inside a layer the parameter names are identical. The output layer is `lm_head`
in transformers 5 modules and `embed_out` in Pythia's checkpoint files; both are accepted.
"""
from __future__ import annotations

from typing import Any

import torch

from meshlm.config import Layout, ModelConfig

_TOP_LEVEL = {  # GPT-NeoX name -> meshlm name
    "gpt_neox.embed_in.weight": "embed_in.weight",
    "gpt_neox.final_layer_norm.weight": "final_layer_norm.weight",
    "gpt_neox.final_layer_norm.bias": "final_layer_norm.bias",
    "lm_head.weight": "embed_out.weight",
    "embed_out.weight": "embed_out.weight",
}


def unique_layer_names(layout: Layout) -> list[str]:
    """meshlm module path of every unique layer, in GPT-NeoX order."""
    names = [f"prelude.{i}" for i in range(layout.prelude)]
    for c, n in enumerate(layout.cores):
        names += [f"cores.{c}.{i}" for i in range(n)]
    return names + [f"coda.{i}" for i in range(layout.coda)]


def neox_to_meshlm(state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """GPT-NeoX state dict -> meshlm state dict (layer weights only; no scheme parameters)."""
    layers = unique_layer_names(layout)
    out = {}
    for key, value in state.items():
        if key in _TOP_LEVEL:
            out[_TOP_LEVEL[key]] = value
        elif key.startswith("gpt_neox.layers."):
            index, rest = key[len("gpt_neox.layers."):].split(".", 1)
            if int(index) >= len(layers):
                raise ValueError(f"GPT-NeoX layer {index} has no place in a {len(layers)}-layer meshlm layout")
            out[f"{layers[int(index)]}.{rest}"] = value
        # rotary inv_freq buffers and attention masks are recomputed from the config
    return out


def meshlm_to_neox(state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """meshlm state dict -> GPT-NeoX state dict (transformers 5 module names)."""
    prefixes = {name + ".": f"gpt_neox.layers.{i}." for i, name in enumerate(unique_layer_names(layout))}
    inverse = {v: k for k, v in _TOP_LEVEL.items() if k != "embed_out.weight"}
    out = {}
    for key, value in state.items():
        if key in inverse:
            out[inverse[key]] = value
            continue
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"meshlm parameter {key!r} has no GPT-NeoX counterpart (only vanilla converts)")
        out[prefixes[prefix] + key[len(prefix):]] = value
    return out


def neox_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for transformers' GPTNeoXConfig describing the same network as a vanilla cfg."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.layout.unique_depth,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.mlp_ratio * cfg.d_model,
        hidden_act="gelu",
        rotary_pct=cfg.rotary_pct,
        rotary_emb_base=cfg.rotary_base,
        max_position_embeddings=cfg.context_length,
        layer_norm_eps=cfg.layer_norm_eps,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        attention_bias=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
