"""Conversion between Hugging Face model folders (GPT-NeoX/Pythia, Llama, OLMoE), meshlm checkpoints and
meshlm HF folders.

    neox | llama | olmoe -> meshlm   a vanilla meshlm checkpoint with the same logits (no embedding scaling)
    meshlm -> neox | llama | olmoe   only a vanilla model (no shared layers, no scheme parameters) of the
                      family's backbone; a model trained with scaled embeddings has √d folded into the input
                      table, which is exact (a tied model is then written untied: the output layer keeps the
                      unscaled table)
    meshlm -> hf      a MeshForCausalLM folder (any scheme, any backbone) for transformers / lm-eval (meshlm.hf)
    hf     -> meshlm  back to a meshlm checkpoint

Formats are recognised from config.json: "format": "meshlm-checkpoint/1" (meshlm), "model_type": "meshlm"
(meshlm HF folder), "gpt_neox", "llama" or "olmoe" (meshlm.interop.families has the name mappings). Weights are read
from model.safetensors, a sharded model.safetensors.index.json or pytorch_model.bin (loaded with
weights_only=True). Written GPT-NeoX files use Pythia's `embed_out.weight`, and config.json carries both
transformers-5 `rope_parameters` and Pythia's legacy keys; written OLMoE files hold one matrix per expert.

A meshlm checkpoint written here is a directory with model.safetensors and config.json in the format of
meshlm.checkpoint (step 0, no optimizer state): `load_model` reads it, and it is the starting point for
continued training. A tokenizer that came with the source is copied in as tokenizer.json.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from meshlm import checkpoint
from meshlm.backbones import BACKBONES, Backbone
from meshlm.config import ModelConfig
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import CheckpointError, ConfigError
from meshlm.hashing import sha256_file
from meshlm.interop.families import (
    BY_MODEL_TYPE,
    export_problems,
    from_meshlm,
    hf_config,
    split_experts,
    to_meshlm,
)
from meshlm.interop.families import model_config as family_model_config
from meshlm.model import MeshLM

FORMATS = ("meshlm", "hf", *BACKBONES)  # a backbone name: a folder of its Hugging Face family


# -- recognising a folder ----------------------------------------------------------------------------------
def detect_format(path: str | Path) -> str:
    """"meshlm" (checkpoint or run dir), "hf" (a meshlm HF folder) or a family name (meshlm.interop.families)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a checkpoint folder")
    config = path / "config.json"
    if not config.is_file():
        if (path / "latest").is_file() or checkpoint.list_checkpoints(path):
            return "meshlm"
        raise CheckpointError(f"{path} has no config.json: it is not a {_KNOWN} checkpoint")
    raw = _read_json(config)
    if raw.get("format") == checkpoint.FORMAT:
        return "meshlm"
    if raw.get("model_type") == "meshlm":
        return "hf"
    if raw.get("model_type") not in BY_MODEL_TYPE:
        raise CheckpointError(f"{config} describes model_type {raw.get('model_type')!r}, not a {_KNOWN} "
                              f"checkpoint; pass a folder holding one of those")
    return BY_MODEL_TYPE[raw["model_type"]].name


_KNOWN = ", ".join(b.title for b in BACKBONES.values()) + ", meshlm or meshlm-HF"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable or not JSON ({err}); re-download or re-export it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object; re-download or re-export it")
    return data


# -- Hugging Face family folders (GPT-NeoX, Llama, OLMoE) ----------------------------------------------------
def read_family(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(vanilla ModelConfig, meshlm-named fp32 state dict) of a GPT-NeoX, Llama or OLMoE folder, checked."""
    folder = Path(folder)
    kind = detect_format(folder)
    if kind not in BACKBONES:
        raise CheckpointError(f"{folder} is a {kind} checkpoint, not a Hugging Face {_KNOWN.split(', meshlm')[0]} "
                              f"folder (config.json model_type must be one of {sorted(BY_MODEL_TYPE)})")
    family = BACKBONES[kind]
    cfg = family_model_config(_read_json(folder / "config.json"), family, folder / "config.json")
    try:
        state = {k: v.float() for k, v in to_meshlm(_read_weights(folder), cfg.layout, family).items()}
    except ValueError as err:
        raise CheckpointError(f"{folder}: the weights do not match config.json ({err})") from None
    if cfg.tie_embeddings:
        state.pop("embed_out.weight", None)  # some tied checkpoints store lm_head too: it is embed_in
    _check_complete(cfg, state, folder)
    return cfg, state


def _check_complete(cfg: ModelConfig, state: dict[str, torch.Tensor], folder: Path) -> None:
    with torch.device("meta"):
        expected = MeshLM(cfg).state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{folder}: the weights do not match config.json (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}, wrong shape {wrong[:3]}); the files are truncated or from another "
                              f"model")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (folder / "pytorch_model.bin").is_file():
        files = ["pytorch_model.bin"]
    else:
        raise CheckpointError(f"{folder} has no weights (model.safetensors, model.safetensors.index.json or "
                              f"pytorch_model.bin); download the complete checkpoint")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        file = folder / name
        try:
            if name.endswith(".bin"):
                state.update(torch.load(file, map_location="cpu", weights_only=True))
            else:
                state.update(load_file(str(file)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"{file} is missing, truncated or corrupt ({str(err)[:100]}); "
                                  f"download it again") from None
    return state


def write_family(cfg: ModelConfig, state: dict[str, torch.Tensor], folder: str | Path, family: Backbone,
                 tokenizer=None) -> Path:
    """Write a vanilla meshlm model as a GPT-NeoX, Llama or OLMoE folder (config.json + model.safetensors)."""
    problems = export_problems(cfg, family)
    if problems or any(k.startswith("scheme.") for k in state):
        raise ConfigError("; ".join(problems) or f"only a vanilla model converts to {family.title}")
    state = dict(state)
    # with √d folded in, the two tables differ (and some families are read untied only)
    tied = cfg.tie_embeddings and not cfg.scale_embeddings and family.exports_tied
    if cfg.tie_embeddings and not tied:
        state["embed_out.weight"] = state["embed_in.weight"].clone()  # safetensors refuses shared tensors
    if cfg.scale_embeddings:  # e = embed_in(x)·√d  ==  (embed_in·√d)(x): fold the scale into the table
        state["embed_in.weight"] = state["embed_in.weight"] * math.sqrt(cfg.d_model)
    weights = split_experts(from_meshlm(state, cfg.layout, family))
    weights = {family.file_names.get(k, k): v for k, v in weights.items()}  # e.g. Pythia's embed_out.weight
    folder = _fresh_dir(folder)
    hf_config(cfg, family, tied, architectures=[family.architecture], bos_token_id=0, eos_token_id=0,
              pad_token_id=1).save_pretrained(folder)
    if family.legacy_config(cfg):  # e.g. Pythia's rotary keys, for older transformers
        raw = _read_json(folder / "config.json")
        raw.update(family.legacy_config(cfg))
        (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        from meshlm.hf import hf_tokenizer

        hf_tokenizer(tokenizer).save_pretrained(folder)
    return folder


# -- meshlm checkpoints ------------------------------------------------------------------------------------
def write_checkpoint(folder: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor],
                     meta: dict[str, Any] | None = None, tokenizer_file: Path | None = None) -> Path:
    """A step-0 meshlm checkpoint dir (model.safetensors + config.json), written to a temp dir then renamed."""
    folder = Path(folder)
    _fresh_dir(folder, create=False)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / checkpoint.WEIGHTS),
              metadata={"format": "pt"})
    extra = dict(meta or {})
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        extra["tokenizer"] = "tokenizer.json"
    files = {checkpoint.WEIGHTS: {"bytes": (tmp / checkpoint.WEIGHTS).stat().st_size,
                                  "sha256": sha256_file(tmp / checkpoint.WEIGHTS)}}
    body = {"format": checkpoint.FORMAT, "model": cfg.to_dict(), "step": 0, "files": files, **extra}
    (tmp / checkpoint.CONFIG).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    if folder.exists():
        folder.rmdir()  # empty (checked by _fresh_dir)
    os.rename(tmp, folder)
    return folder


def _fresh_dir(folder: str | Path, create: bool = True) -> Path:
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"output {folder} already exists and is not empty; choose a new folder or remove it")
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- one entry point for the CLI ---------------------------------------------------------------------------
def convert(src: str | Path, out: str | Path, to: str | None = None, tokenizer: str | None = None) -> Path:
    """Convert between formats; `to` defaults to meshlm for family/hf sources and, for meshlm sources, to the
    family of the model's backbone."""
    src = Path(src)
    kind = detect_format(src)
    if kind == "meshlm":
        model = checkpoint.load_model(src)
        cfg, state, tok_file = model.config, model.state_dict(), checkpoint.tokenizer_of(src)
    elif kind == "hf":
        from meshlm.hf import load_hf

        model = load_hf(src).model
        cfg, state, tok_file = model.config, model.state_dict(), _tokenizer_file(src)
    else:
        (cfg, state), tok_file = read_family(src), _tokenizer_file(src)
    to = to or (cfg.backbone if kind == "meshlm" else "meshlm")
    if to not in FORMATS or to == kind:
        raise ConfigError(f"cannot convert {kind} to {to!r}; choose --to from "
                          f"{', '.join(f for f in FORMATS if f != kind)}")
    if to == "meshlm":
        local = Path(tok_file) if tok_file and Path(tok_file).is_file() else None
        return write_checkpoint(out, cfg, state, {"source": {"format": kind, "path": str(src)}}, local)
    tok = load_tokenizer(tokenizer or tok_file or "default")
    if to == "hf":
        return _write_hf(cfg, state, out, tok, checkpoint.read_meta(src) if kind == "meshlm" else None)
    return write_family(cfg, state, out, BACKBONES[to], tok)


def _tokenizer_file(folder: Path) -> str | None:
    return str(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else None


def _write_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], out: str | Path, tok, meta=None) -> Path:
    from meshlm.hf import save_hf

    model = MeshLM(cfg)
    model.load_state_dict(state)
    return save_hf(model, _fresh_dir(out), tok, meta)
