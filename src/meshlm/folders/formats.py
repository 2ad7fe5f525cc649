"""The registry of model folder formats, below the loader: one registered format per kind of folder.

    format        matches config.json saying       ModelConfig from       weights, in meshlm's names
    meshlm        "format": "meshlm-checkpoint/1"  its "model"            folders.integrity (hashed)
    hf            "model_type": "meshlm"           its "meshlm"           MeshForCausalLM's, its
                                                                          "model." prefix dropped
    neox, llama,  the family's "model_type"        families.model_config  families.to_meshlm
    olmoe

`FOLDERS` is the registry: each format is a small class that `matches` a parsed config.json, builds
the `model_config` it describes and reads the folder's `weights`, given the config.json that
meshlm.folders.locate read (it is read once per open: nothing here reads it again). Like
torchtitan's state-dict adapters, a format turns a folder's own names into meshlm's and knows
nothing of what the model is for: meshlm.folders.locate recognises a folder once, and meshlm.loading
builds its model once and checks these weights against it once (`weight_mismatch`). Nothing here
imports transformers or runs code from a file: a Hugging Face folder's weights are
model.safetensors, a sharded model.safetensors.index.json or pytorch_model.bin
(torch.load(weights_only=True)); a meshlm checkpoint's are verified against its manifest
(meshlm.folders.integrity), with the config.json bytes locate parsed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshlm.backbones import BACKBONES, Backbone
from meshlm.config import ModelConfig
from meshlm.errors import CheckpointError
from meshlm.folders import integrity
from meshlm.interop.families import model_config as family_config
from meshlm.interop.families import to_meshlm

KNOWN_FAMILIES = ", ".join(b.title for b in BACKBONES.values())
HF_PREFIX = "model."  # MeshForCausalLM.base_model_prefix: the weights of the MeshLM it wraps


def read_json(path: Path) -> dict[str, Any]:
    """A Hugging Face folder's config.json or weight index, by the one JSON reader
    (meshlm.folders.integrity.read_json)."""
    return read_json_and_digest(path)[0]


def read_json_and_digest(path: Path) -> tuple[dict[str, Any], str]:
    """read_json, and the SHA-256 of the bytes it parsed (integrity.read_json_and_digest)."""
    return integrity.read_json_and_digest(path, "re-download or re-export it")


# -- the formats -----------------------------------------------------------------------------------
class MeshlmCheckpoint:
    """A meshlm checkpoint folder (meshlm.checkpoint): verified against its manifest on reading
    (meshlm.folders.integrity)."""

    name = "meshlm"

    def matches(self, raw: dict[str, Any]) -> bool:
        return raw.get("format") == integrity.FORMAT

    def model_config(self, raw: dict[str, Any], folder: Path) -> ModelConfig:
        return ModelConfig.from_dict(raw["model"])

    def weights(self, folder: Path, read: tuple[dict[str, Any], str] | None, cfg: ModelConfig,
                check: bool = True) -> dict[str, torch.Tensor]:
        """`read`: (config.json, the SHA-256 of its bytes) as the loader parsed them (None: read
        here); `check` verifies every file against the manifest, config.json by that hash."""
        return integrity.load_checkpoint(folder, with_state=False, check=check,
                                         config=read).weights


class HfExport:
    """A `meshlm convert --to hf` folder (MeshForCausalLM): its MeshLM's weights under "model."."""

    name = "hf"

    def matches(self, raw: dict[str, Any]) -> bool:
        return raw.get("model_type") == "meshlm"

    def model_config(self, raw: dict[str, Any], folder: Path) -> ModelConfig:
        return ModelConfig.from_dict(raw.get("meshlm") or {})

    def weights(self, folder: Path, read: tuple[dict[str, Any], str] | None, cfg: ModelConfig,
                check: bool = True) -> dict[str, torch.Tensor]:
        """fp32; a quantized export's int8/uint8 weights (meshlm.quant) are not numbers to cast, and
        its bf16 scales load back exact."""
        files = read_weight_files(folder, "re-export it with `meshlm convert`")
        return {k.removeprefix(HF_PREFIX): v.float() if v.is_floating_point() else v
                for k, v in files.items()}


class FamilyFolder:
    """A Hugging Face folder of one family (GPT-NeoX, Llama, OLMoE), read as the vanilla meshlm
    model with the same logits (meshlm.interop.families)."""

    def __init__(self, family: Backbone):
        self.family, self.name = family, family.name

    def matches(self, raw: dict[str, Any]) -> bool:
        return raw.get("model_type") == self.family.model_type

    def model_config(self, raw: dict[str, Any], folder: Path) -> ModelConfig:
        return family_config(raw, self.family, folder / integrity.CONFIG)

    def weights(self, folder: Path, read: tuple[dict[str, Any], str] | None, cfg: ModelConfig,
                check: bool = True) -> dict[str, torch.Tensor]:
        """fp32, in meshlm's names; whether they fit cfg's model is the loader's check."""
        files = read_weight_files(folder)
        try:
            state = to_meshlm(files, cfg.layout, self.family)
        except ValueError as err:
            raise mismatch(folder, str(err)) from None
        if cfg.tie_embeddings:
            state.pop("embed_out.weight", None)  # some tied folders store lm_head too: embed_in
        return {k: v.float() for k, v in state.items()}


# the registry, by format name (meshlm.interop.FORMATS): the first that matches a config.json wins
FOLDERS = {f.name: f for f in (MeshlmCheckpoint(), HfExport(),
                               *(FamilyFolder(b) for b in BACKBONES.values()))}


def format_of(raw: dict[str, Any], config: Path) -> str:
    """The name of the registered format (FOLDERS) that a folder's config.json `raw` describes;
    CheckpointError if it is none of them."""
    for name, form in FOLDERS.items():
        if form.matches(raw):
            return name
    raise CheckpointError(f"{config} describes model_type {raw.get('model_type')!r}, not a "
                          f"{KNOWN_FAMILIES}, meshlm or meshlm-HF checkpoint; pass a folder "
                          f"holding one of those")


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
            raise integrity.unreadable_pickle(file, err, fix) from None
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{file} is missing, truncated or corrupt ({str(err)[:100]}); "
                              f"{fix}") from None
