"""Model folders as meshlm reads them, below the loader: an adapter per format, as config.json says.

    format        config.json says                 ModelConfig from       weights, in meshlm's names
    meshlm        "format": "meshlm-checkpoint/1"  its "model"            meshlm.checkpoint (hashed)
    hf            "model_type": "meshlm"           its "meshlm"           MeshForCausalLM's, its
                                                                          "model." prefix dropped
    neox, llama,  the family's "model_type"        families.model_config  families.to_meshlm
    olmoe

Like torchtitan's state-dict adapters, an adapter turns a folder's own names into meshlm's and knows
nothing of what the model is for: meshlm.loading recognises a folder once, builds its model once and
checks these weights against it once (`weight_mismatch`). Nothing here imports transformers or runs
code from a file: a Hugging Face folder's weights are model.safetensors, a sharded
model.safetensors.index.json or pytorch_model.bin (torch.load(weights_only=True)); a meshlm
checkpoint's are verified against its manifest.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshlm import checkpoint, manifest
from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.errors import CheckpointError
from meshlm.interop.families import BY_MODEL_TYPE, to_meshlm
from meshlm.interop.families import model_config as family_config

KNOWN_FAMILIES = ", ".join(b.title for b in BACKBONES.values())
HF_PREFIX = "model."  # MeshForCausalLM.base_model_prefix: the weights of the MeshLM it wraps
_REFETCH = {"hf": "re-export it with `meshlm convert`"}  # the fix for a bad weight file, by format


def read_json(path: Path) -> dict[str, Any]:
    """A Hugging Face folder's config.json or weight index, by the one JSON reader
    (meshlm.manifest.read_json)."""
    return read_json_and_digest(path)[0]


def read_json_and_digest(path: Path) -> tuple[dict[str, Any], str]:
    """read_json, and the SHA-256 of the bytes it parsed (meshlm.manifest.read_json_and_digest)."""
    return manifest.read_json_and_digest(path, "re-download or re-export it")


def format_of(raw: dict[str, Any], config: Path) -> str:
    """The format (one of meshlm.interop.FORMATS) that a folder's config.json `raw` describes;
    CheckpointError if it is none of them."""
    if raw.get("format") == checkpoint.FORMAT:
        return "meshlm"
    if raw.get("model_type") == "meshlm":
        return "hf"
    if raw.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[raw["model_type"]].name
    raise CheckpointError(f"{config} describes model_type {raw.get('model_type')!r}, not a "
                          f"{KNOWN_FAMILIES}, meshlm or meshlm-HF checkpoint; pass a folder "
                          f"holding one of those")


def model_config(form: str, raw: dict[str, Any], folder: Path) -> ModelConfig:
    """The ModelConfig of a folder of format `form` whose config.json is `raw`."""
    if form == "meshlm":
        return ModelConfig.from_dict(raw["model"])
    if form == "hf":
        return ModelConfig.from_dict(raw.get("meshlm") or {})
    return family_config(raw, BACKBONES[form], folder / checkpoint.CONFIG)


def read_weights(form: str, folder: Path, cfg: ModelConfig, check: bool = True,
                 config_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The meshlm-named state dict of a folder of format `form` (fp32 for the Hugging Face formats;
    a quantized meshlm-HF export's integer weights stay integers);
    `check` verifies a meshlm checkpoint's hashes, and that its config.json is still the bytes
    hashing to `config_sha256` (the ones cfg was built from). Whether they fit cfg's model is the
    loader's check."""
    if form == "meshlm":
        return checkpoint.load_checkpoint(folder, with_state=False, check=check,
                                          config_sha256=config_sha256).weights
    files = read_weight_files(folder, _REFETCH.get(form, "download it again"))
    if form == "hf":  # int8/uint8 (meshlm.quant): not numbers to cast; bf16 scales load back exact
        return {k.removeprefix(HF_PREFIX): v.float() if v.is_floating_point() else v
                for k, v in files.items()}
    try:
        state = to_meshlm(files, cfg.layout, BACKBONES[form])
    except ValueError as err:
        raise mismatch(folder, str(err)) from None
    if cfg.tie_embeddings:
        state.pop("embed_out.weight", None)  # some tied folders store lm_head too: it is embed_in
    return {k: v.float() for k, v in state.items()}


def mismatch(folder: Path, detail: str) -> CheckpointError:
    """The one error for weights that do not fit the model a folder's config.json describes."""
    return CheckpointError(f"{folder}: the weights do not match config.json ({detail}); the files "
                           f"are truncated or from another model")


def read_weight_files(folder: Path, fix: str = "download it again") -> dict[str, torch.Tensor]:
    """model.safetensors, a sharded model.safetensors.index.json or pytorch_model.bin
    (weights_only), names as stored; `fix` ends the message for a damaged file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (folder / "pytorch_model.bin").is_file():
        files = ["pytorch_model.bin"]
    else:
        raise CheckpointError(f"{folder} has no weights (model.safetensors, "
                              f"model.safetensors.index.json or pytorch_model.bin); download the "
                              f"complete checkpoint")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(_read_file(folder / name, fix))
    return state


def _read_file(file: Path, fix: str) -> dict[str, torch.Tensor]:
    if file.suffix == ".bin":
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle/zip errors have no common base class
            raise checkpoint.unreadable_pickle(file, err, fix) from None
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{file} is missing, truncated or corrupt ({str(err)[:100]}); "
                              f"{fix}") from None
