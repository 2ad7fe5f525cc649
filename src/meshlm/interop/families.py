"""Mapping between meshlm and the Hugging Face model families its backbones reproduce: names and
configs.

Each backbone in meshlm.backbones is its own family: it holds the names, the config translation and
the checks; this module applies them to state dicts and configs.

    family  transformers class  layers             embeddings / final norm / output layer
    neox    GPTNeoXForCausalLM  gpt_neox.layers.i  gpt_neox.embed_in / gpt_neox.final_layer_norm /
                                                   embed_out (lm_head in transformers 5 modules)
    llama   LlamaForCausalLM    model.layers.i     model.embed_tokens / model.norm / lm_head
    olmoe   OlmoeForCausalLM    model.layers.i     model.embed_tokens / model.norm / lm_head

meshlm's unique layers, in order (prelude.0 …, cores.0.0 …, cores.1.0 …, coda.0 …), are the family's
layers 0, 1, …; inside a layer the parameter names are the family's own, so conversion renames layer
indices only. Two exceptions, both exact:
- OLMoE experts: files (the Hub's, and transformers' `save_pretrained`) hold one matrix per expert,
  `mlp.experts.{e}.{gate,up,down}_proj.weight`; transformers 5 modules and meshlm hold them stacked,
  `mlp.experts.gate_up_proj` (E, 2·I, d) and `mlp.experts.down_proj` (E, d, I). Both are read; files
  are written per expert.
- Tied embeddings: meshlm keeps no `embed_out` (the output layer is `embed_in.weight`); `lm_head` is
  written only when the exported config is untied (see convert.write_family on √d scaling).
"""
from __future__ import annotations

import re
from typing import Any

import torch

from meshlm.backbones import BACKBONES, Backbone
from meshlm.config import Layout, ModelConfig
from meshlm.errors import ConfigError

BY_MODEL_TYPE = {b.model_type: b for b in BACKBONES.values()}
IGNORED = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")  # buffers in old files
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# -- state dicts -----------------------------------------------------------------------------------
def unique_layer_names(layout: Layout) -> list[str]:
    """meshlm module path of every unique layer, in the families' order."""
    names = [f"prelude.{i}" for i in range(layout.prelude)]
    for c, n in enumerate(layout.cores):
        names += [f"cores.{c}.{i}" for i in range(n)]
    return names + [f"coda.{i}" for i in range(layout.coda)]


def to_meshlm(state: dict[str, torch.Tensor], layout: Layout,
              family: Backbone) -> dict[str, torch.Tensor]:
    """A family's state dict (module or file names) -> meshlm state dict (layer weights only, no
    scheme)."""
    layers, top = unique_layer_names(layout), dict(family.top_level)
    out = {}
    for key, value in stack_experts(state).items():
        if key in top:
            out[top[key]] = value
        elif key.startswith(family.layer_prefix):
            index, rest = key[len(family.layer_prefix):].split(".", 1)
            if int(index) >= len(layers):
                raise ValueError(f"{family.title} layer {index} has no place in a "
                                 f"{len(layers)}-layer meshlm layout")
            out[f"{layers[int(index)]}.{rest}"] = value
        elif not key.endswith(IGNORED):
            raise ValueError(f"{key!r} is not a {family.title} parameter")
    return out


def from_meshlm(state: dict[str, torch.Tensor], layout: Layout,
                family: Backbone) -> dict[str, torch.Tensor]:
    """meshlm state dict -> the family's state dict (transformers 5 module names, stacked
    experts)."""
    prefixes = {name + ".": f"{family.layer_prefix}{i}."
                for i, name in enumerate(unique_layer_names(layout))}
    inverse = {}
    for theirs, ours in family.top_level:
        inverse.setdefault(ours, theirs)
    out = {}
    for key, value in state.items():
        if key in inverse:
            out[inverse[key]] = value
            continue
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"meshlm parameter {key!r} has no {family.title} counterpart (only "
                             "vanilla converts)")
        out[prefixes[prefix] + key[len(prefix):]] = value
    return out


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert OLMoE matrices -> stacked `gate_up_proj` (E, 2I, d) / `down_proj` (E, d, I);
    others as is."""
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, value in state.items():
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
        else:
            out[key] = value
    for prefix, by_index in experts.items():
        ids = sorted(by_index)
        if ids != list(range(len(ids))) or any(len(by_index[i]) != 3 for i in ids):
            raise ValueError(f"{prefix}: experts {ids} are incomplete (each needs gate_proj, "
                             "up_proj, down_proj)")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_index[i]["gate_proj"],
                                                                by_index[i]["up_proj"]])
                                                     for i in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_index[i]["down_proj"] for i in ids])
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of stack_experts: the per-expert names OLMoE's files use."""
    out = {}
    for key, value in state.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(t.chunk(2) for t in value.unbind(0)):
                out[f"{key[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{key[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif key.endswith(".mlp.experts.down_proj"):
            for e, down in enumerate(value.unbind(0)):
                out[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = down
        else:
            out[key] = value
    return out


# -- configs ---------------------------------------------------------------------------------------
def _rope(raw: dict[str, Any]) -> tuple[str, float]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    return kind, float(rope.get("rope_theta",
                                raw.get("rope_theta", raw.get("rotary_emb_base", 10000.0))))


def model_config(raw: dict[str, Any], family: Backbone, where: object) -> ModelConfig:
    """The vanilla meshlm config of a family's config.json; one ConfigError listing everything
    unsupported."""
    rope_type, theta = _rope(raw)
    act = raw.get("hidden_act", family.hidden_act)
    problems = ([f"hidden_act={act!r} (meshlm uses {family.hidden_act!r})"]
                if act != family.hidden_act else [])
    problems += [f"rope_type={rope_type!r} (only 'default')"] if rope_type != "default" else []
    problems += family.hf_problems(raw)
    if problems:
        raise ConfigError(f"{where}: this {family.title} variant is not supported by meshlm: "
                          + "; ".join(problems))
    return ModelConfig(spec=str(raw["num_hidden_layers"]), d_model=raw.get("hidden_size"),
                       n_heads=raw.get("num_attention_heads"), vocab_size=raw["vocab_size"],
                       context_length=raw.get("max_position_embeddings", 2048), rotary_base=theta,
                       scheme="vanilla",
                       scale_embeddings=False, backbone=family.name, **family.config_from_hf(raw))


def export_problems(cfg: ModelConfig, family: Backbone) -> list[str]:
    """Why a meshlm config has no exact counterpart in the family (empty: it converts)."""
    out = []
    if cfg.scheme not in ("vanilla", "base") or cfg.layout.shares_weights:
        out.append(f"only a vanilla model converts to {family.title}; scheme {cfg.scheme!r} with "
                   f"spec {cfg.spec!r} has no {family.title} equivalent (export it with --to hf "
                   "instead)")
    return out + family.export_problems(cfg)


def hf_config_kwargs(cfg: ModelConfig, family: Backbone, tied: bool = False) -> dict[str, Any]:
    """Keyword arguments for the family's transformers config describing the same network as a
    vanilla cfg."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.layout.unique_depth,
                num_attention_heads=cfg.n_heads, intermediate_size=cfg.mlp_width,
                hidden_act=family.hidden_act,
                max_position_embeddings=cfg.context_length, tie_word_embeddings=tied,
                attention_dropout=0.0,
                **family.hf_config_kwargs(cfg))


def hf_config(cfg: ModelConfig, family: Backbone, tied: bool = False, **extra: Any):
    """The transformers config object (GPTNeoXConfig, LlamaConfig or OlmoeConfig)."""
    import transformers

    config_class = getattr(transformers, family.architecture.replace("ForCausalLM", "Config"))
    return config_class(**hf_config_kwargs(cfg, family, tied), **extra)
