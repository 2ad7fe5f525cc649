"""Conversion between Hugging Face model folders (GPT-NeoX/Pythia, Llama, OLMoE), meshlm checkpoints
and meshlm HF folders.

    neox | llama | olmoe -> meshlm   a vanilla meshlm checkpoint with the same logits (no embedding
                                     scaling)
    meshlm -> neox | llama | olmoe   only a vanilla model (no shared layers, no scheme parameters)
                      of the family's backbone; a model trained with scaled embeddings has √d
                      folded into the input table, which is exact (a tied model is then written
                      untied: the output layer keeps the unscaled table)
    meshlm -> hf      a MeshForCausalLM folder (any scheme, any backbone) for transformers / lm-eval
                      (meshlm.hf)
    hf     -> meshlm  back to a meshlm checkpoint
    meshlm -> meshlm  only from a LoRA run's checkpoint: its adapters merged into the base weights

The source is opened by meshlm.loading.open_model, which recognises every format from
config.json; the adapters below it (meshlm.folders.formats) read family weights from
model.safetensors, a sharded model.safetensors.index.json or pytorch_model.bin (loaded with
weights_only=True), and meshlm.interop.families has the name mappings. Written GPT-NeoX files use
Pythia's `embed_out.weight`, and config.json carries both transformers-5 `rope_parameters` and
Pythia's legacy keys; written OLMoE files hold one matrix per expert.

A meshlm checkpoint written here is one folder written by meshlm.checkpoint.write_checkpoint (step
0, no optimizer state): `open_model` reads it, and `train.init_from` continues training from it. The
source's tokenizer (by the tokenizer rule of meshlm.folders.locate) is carried as tokenizer.json.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshlm import atomic, checkpoint, outputs
from meshlm.backbones import BACKBONES, Backbone
from meshlm.config import ModelConfig
from meshlm.data.tokenizer import TEMPLATE_FILE
from meshlm.errors import ConfigError
from meshlm.folders.formats import read_json
from meshlm.interop import FORMATS
from meshlm.interop.families import export_problems, from_meshlm, hf_config, split_experts
from meshlm.loading import open_model


def write_family(cfg: ModelConfig, state: dict[str, torch.Tensor], folder: str | Path,
                 family: Backbone, tokenizer=None, chat_template: str | None = None) -> Path:
    """Write a vanilla meshlm model as a GPT-NeoX, Llama or OLMoE folder (config.json +
    model.safetensors, the tokenizer, and `chat_template` as chat_template.jinja), replacing
    `folder` (the caller claims it first: meshlm.outputs)."""
    problems = export_problems(cfg, family)
    if problems or any(k.startswith("scheme.") for k in state):
        raise ConfigError("; ".join(problems) or f"only a vanilla model converts to {family.title}")
    state = dict(state)
    # with √d folded in, the two tables differ (and some families are read untied only)
    tied = cfg.tie_embeddings and not cfg.scale_embeddings and family.exports_tied
    if cfg.tie_embeddings and not tied:
        # safetensors refuses shared tensors
        state["embed_out.weight"] = state["embed_in.weight"].clone()
    # e = embed_in(x)·√d == (embed_in·√d)(x): fold the scale into the table
    if cfg.scale_embeddings:
        state["embed_in.weight"] = state["embed_in.weight"] * math.sqrt(cfg.d_model)
    weights = split_experts(from_meshlm(state, cfg.layout, family))
    # e.g. Pythia's embed_out.weight
    weights = {family.file_names.get(k, k): v for k, v in weights.items()}
    folder = Path(folder)
    with atomic.new_folder(folder, "exporting to") as tmp:  # no half folder to block a rerun
        hf_config(cfg, family, tied, architectures=[family.architecture], bos_token_id=0,
                  eos_token_id=0,
                  pad_token_id=1).save_pretrained(tmp)
        if family.legacy_config(cfg):  # e.g. Pythia's rotary keys, for older transformers
            raw = read_json(tmp / "config.json")
            raw.update(family.legacy_config(cfg))
            (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        if tokenizer is not None:
            from meshlm.hf import hf_tokenizer

            hf_tokenizer(tokenizer).save_pretrained(tmp)
        if chat_template:
            (tmp / TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    return folder


def quantized_target_error(src, quantized: dict, to: str) -> ConfigError:
    """int8/int4 layers (meshlm.quant) travel between a meshlm checkpoint and the meshlm-HF export
    (whose remote code carries them) only: no family format has them."""
    origin = (quantized.get("source") or {}).get("path")
    return ConfigError(f"{src} holds int{quantized['bits']} weights written by meshlm quantize, "
                       f"which {to!r} cannot hold; convert it --to hf (or meshlm), or convert the "
                       "full-precision checkpoint it came from"
                       + (f" ({origin})" if origin else ""))


# -- one entry point for the CLI -------------------------------------------------------------------
def convert(src: str | Path, out: str | Path, to: str | None = None, tokenizer: str | None = None,
            force_tokenizer: bool = False, overwrite: bool = False) -> Path:
    """Convert between formats; `to` defaults to meshlm for family/hf sources and, for meshlm
    sources, to the family of the model's backbone. The source is opened by
    meshlm.loading.open_model (its tokenizer rule; a `tokenizer` that encodes unlike the source's
    own is refused unless `force_tokenizer`). `out` must be new or empty, or an earlier convert
    output with `overwrite` (meshlm.outputs.claim, before any work); it is marked as one after."""
    outputs.claim(out, "convert", overwrite, [src], label="output")
    written = _convert(src, out, to, tokenizer, force_tokenizer)
    outputs.mark(written, "convert")
    return written


def _convert(src: str | Path, out: str | Path, to: str | None, tokenizer: str | None,
             force_tokenizer: bool) -> Path:
    source = open_model(src, tokenizer=tokenizer, force_tokenizer=force_tokenizer)
    if tokenizer:
        source.tokenizer  # noqa: B018 (checked before anything is written)
    kind, cfg = source.format, source.model.config
    quantized = source.meta.get("quantization")
    to = to or ("meshlm" if kind != "meshlm" else "hf" if quantized else cfg.backbone)
    if quantized and to not in ("hf", "meshlm"):
        raise quantized_target_error(src, quantized, to)
    # meshlm -> meshlm merges a LoRA run's adapters
    if to not in FORMATS or (to == kind and not source.merged):
        raise ConfigError(f"cannot convert {kind} to {to!r}; choose --to from "
                          f"{', '.join(f for f in FORMATS if f != kind)}")
    template = source.folder.chat_template  # a fine-tuned run's, or None
    if to == "meshlm":
        saved = checkpoint.save_model(source.model, out,
                                      {"source": {"format": kind, "path": str(src)},
                                       **({"quantization": quantized} if quantized else {})},
                                      source.tokenizer_file)
        if template:
            atomic.write_text(saved / TEMPLATE_FILE, template)
        return saved
    # a folder naming none is written without one
    tok = source.tokenizer if source.tokenizer_source else None
    if to == "hf":
        from meshlm.hf import save_hf  # transformers' model classes: only for this target

        return save_hf(source.model, Path(out), tok,
                       source.meta if kind == "meshlm" else None, template)
    return write_family(cfg, source.model.state_dict(), out, BACKBONES[to], tok, template)
