"""Conversion between Hugging Face GPT-NeoX (Pythia) folders, meshlm checkpoints and meshlm HF folders.

    neox  -> meshlm   a vanilla meshlm checkpoint with the same logits (Pythia: no embedding scaling)
    meshlm -> neox    only a vanilla model (no shared layers, no scheme parameters) is a GPT-NeoX; a model
                      trained with scaled embeddings has √d folded into embed_in, which is exact
    meshlm -> hf      a MeshForCausalLM folder (any scheme) for transformers / lm-eval (meshlm.hf)
    hf     -> meshlm  back to a meshlm checkpoint

Formats are recognised from config.json: "format": "meshlm-checkpoint/1" (meshlm), "model_type": "meshlm"
(meshlm HF folder) or "gpt_neox". GPT-NeoX weights are read from model.safetensors, a sharded
model.safetensors.index.json or pytorch_model.bin (loaded with weights_only=True); the output layer may be
`embed_out` (Pythia's files) or `lm_head` (transformers 5 modules). Written GPT-NeoX files use Pythia's
`embed_out.weight`, and config.json carries both transformers-5 `rope_parameters` and Pythia's legacy keys.

A meshlm checkpoint written here is a directory with model.safetensors and config.json in the format of
meshlm.checkpoint (step 0, no optimizer state): `load_model` reads it, and it is the starting point for
continued training. A tokenizer that came with the source is copied in as tokenizer.json.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from meshlm import checkpoint
from meshlm.config import ModelConfig
from meshlm.errors import CheckpointError, ConfigError
from meshlm.model import MeshLM
from meshlm.neox import meshlm_to_neox, neox_config_kwargs, neox_to_meshlm

FORMATS = ("meshlm", "neox", "hf")
_IGNORED_NEOX = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")  # buffers in old files


# -- recognising a folder ----------------------------------------------------------------------------------
def detect_format(path: str | Path) -> str:
    """"meshlm" (checkpoint or run dir), "hf" (a meshlm HF folder) or "neox"; CheckpointError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a checkpoint folder")
    config = path / "config.json"
    if not config.is_file():
        if (path / "latest").is_file() or checkpoint.list_checkpoints(path):
            return "meshlm"
        raise CheckpointError(f"{path} has no config.json: it is not a GPT-NeoX, meshlm or meshlm-HF checkpoint")
    raw = _read_json(config)
    if raw.get("format") == checkpoint.FORMAT:
        return "meshlm"
    kind = {"meshlm": "hf", "gpt_neox": "neox"}.get(raw.get("model_type"))
    if kind is None:
        raise CheckpointError(f"{config} describes model_type {raw.get('model_type')!r}, not a GPT-NeoX (Pythia), "
                              f"meshlm or meshlm-HF checkpoint; pass a folder holding one of those")
    return kind


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable or not JSON ({err}); re-download or re-export it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object; re-download or re-export it")
    return data


# -- GPT-NeoX folders --------------------------------------------------------------------------------------
def neox_model_config(raw: dict[str, Any], where: Path) -> ModelConfig:
    """The vanilla meshlm config of a GPT-NeoX config.json; one error listing everything unsupported."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    d, inter = raw.get("hidden_size"), raw.get("intermediate_size")
    problems = [msg for bad, msg in [
        (raw.get("hidden_act", "gelu") != "gelu", f"hidden_act={raw.get('hidden_act')!r} (meshlm uses exact 'gelu')"),
        (not raw.get("use_parallel_residual", True), "use_parallel_residual=false"),
        (raw.get("tie_word_embeddings", False), "tied input/output embeddings"),
        (not raw.get("attention_bias", True), "attention without bias"),
        (rope.get("rope_type", "default") != "default", f"rope_type={rope.get('rope_type')!r} (only 'default')"),
        (not (isinstance(d, int) and isinstance(inter, int) and d and inter % d == 0),
         f"intermediate_size={inter} is not a multiple of hidden_size={d}"),
    ] if bad]
    if problems:
        raise ConfigError(f"{where}: this GPT-NeoX variant is not supported by meshlm: " + "; ".join(problems))
    return ModelConfig(
        spec=str(raw["num_hidden_layers"]), d_model=d, n_heads=raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], context_length=raw.get("max_position_embeddings", 2048),
        rotary_pct=float(raw.get("rotary_pct", rope.get("partial_rotary_factor", 0.25))),
        rotary_base=float(raw.get("rotary_emb_base", rope.get("rope_theta", raw.get("rope_theta", 10000.0)))),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)), mlp_ratio=inter // d,
        scheme="vanilla", scale_embeddings=False)


def read_neox(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(vanilla ModelConfig, meshlm-named fp32 state dict) of a GPT-NeoX folder, checked against the config."""
    folder = Path(folder)
    if detect_format(folder) != "neox":
        raise CheckpointError(f"{folder} is not a GPT-NeoX checkpoint (config.json model_type must be 'gpt_neox')")
    cfg = neox_model_config(_read_json(folder / "config.json"), folder / "config.json")
    state = {k: v for k, v in _read_neox_weights(folder).items() if not k.endswith(_IGNORED_NEOX)}
    try:
        state = {k: v.float() for k, v in neox_to_meshlm(state, cfg.layout).items()}
    except ValueError as err:
        raise CheckpointError(f"{folder}: the weights do not match config.json ({err})") from None
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


def _read_neox_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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


def write_neox(cfg: ModelConfig, state: dict[str, torch.Tensor], folder: str | Path, tokenizer=None) -> Path:
    """Write a vanilla meshlm model as a GPT-NeoX folder (config.json + model.safetensors [+ tokenizer])."""
    from safetensors.torch import save_file
    from transformers import GPTNeoXConfig

    layout = cfg.layout
    if cfg.scheme not in ("vanilla", "base") or layout.shares_weights or any(k.startswith("scheme.") for k in state):
        raise ConfigError(f"only a vanilla model converts to GPT-NeoX; scheme {cfg.scheme!r} with spec {cfg.spec!r} "
                          f"has no GPT-NeoX equivalent (export it with --to hf instead)")
    state = dict(state)
    if cfg.scale_embeddings:  # e = embed_in(x)·√d  ==  (embed_in·√d)(x): fold the scale into the table
        state["embed_in.weight"] = state["embed_in.weight"] * math.sqrt(cfg.d_model)
    neox = meshlm_to_neox(state, layout)
    neox["embed_out.weight"] = neox.pop("lm_head.weight")  # Pythia's file name for the output layer
    folder = _fresh_dir(folder)
    config = GPTNeoXConfig(**neox_config_kwargs(cfg), architectures=["GPTNeoXForCausalLM"],
                           bos_token_id=0, eos_token_id=0)
    config.save_pretrained(folder)
    raw = _read_json(folder / "config.json")  # add Pythia's legacy rotary keys for older transformers
    raw.update(rotary_pct=cfg.rotary_pct, rotary_emb_base=cfg.rotary_base)
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in neox.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        from meshlm.hf import hf_tokenizer

        hf_tokenizer(tokenizer).save_pretrained(folder)
    return folder


# -- meshlm checkpoints ------------------------------------------------------------------------------------
def write_checkpoint(folder: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor],
                     meta: dict[str, Any] | None = None, tokenizer_file: Path | None = None) -> Path:
    """A step-0 meshlm checkpoint dir (model.safetensors + config.json), written to a temp dir then renamed."""
    from safetensors.torch import save_file

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
                                  "sha256": _sha256(tmp / checkpoint.WEIGHTS)}}
    body = {"format": checkpoint.FORMAT, "model": cfg.to_dict(), "step": 0, "files": files, **extra}
    (tmp / checkpoint.CONFIG).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    if folder.exists():
        folder.rmdir()  # empty (checked by _fresh_dir)
    os.rename(tmp, folder)
    return folder


def checkpoint_tokenizer(path: str | Path) -> str:
    """The tokenizer a meshlm checkpoint was made with: its own tokenizer.json, its training run's, or default."""
    path = checkpoint.resolve(path)
    meta = checkpoint.read_meta(path)
    if meta.get("tokenizer"):
        return str(path / meta["tokenizer"])
    return (meta.get("train") or {}).get("tokenizer", "default")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fresh_dir(folder: str | Path, create: bool = True) -> Path:
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"output {folder} already exists and is not empty; choose a new folder or remove it")
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- one entry point for the CLI ---------------------------------------------------------------------------
def convert(src: str | Path, out: str | Path, to: str | None = None, tokenizer: str | None = None) -> Path:
    """Convert between formats; `to` defaults to meshlm for neox/hf sources and to neox for meshlm sources."""
    from meshlm.tokenizer import load_tokenizer

    src = Path(src)
    kind = detect_format(src)
    to = to or ("neox" if kind == "meshlm" else "meshlm")
    if to not in FORMATS or to == kind:
        raise ConfigError(f"cannot convert {kind} to {to!r}; choose --to from "
                          f"{', '.join(f for f in FORMATS if f != kind)}")
    if kind == "neox":
        cfg, state = read_neox(src)
        tok_file = src / "tokenizer.json"
        tok_file = tok_file if tok_file.is_file() else None
        if to == "meshlm":
            return write_checkpoint(out, cfg, state, {"source": {"format": "neox", "path": str(src)}}, tok_file)
        return _write_hf(cfg, state, out, load_tokenizer(tokenizer or tok_file or "default"))
    if kind == "hf":
        from meshlm.hf import load_hf

        model = load_hf(src).model
        tok_file = src / "tokenizer.json" if (src / "tokenizer.json").is_file() else None
        if to == "meshlm":
            return write_checkpoint(out, model.config, model.state_dict(),
                                    {"source": {"format": "hf", "path": str(src)}}, tok_file)
        return write_neox(model.config, model.state_dict(), out, load_tokenizer(tokenizer or tok_file or "default"))
    model = checkpoint.load_model(src)
    tok = load_tokenizer(tokenizer or checkpoint_tokenizer(src))
    if to == "neox":
        return write_neox(model.config, model.state_dict(), out, tok)
    return _write_hf(model.config, model.state_dict(), out, tok)


def _write_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], out: str | Path, tok) -> Path:
    from meshlm.hf import save_hf

    model = MeshLM(cfg)
    model.load_state_dict(state)
    return save_hf(model, _fresh_dir(out), tok)
