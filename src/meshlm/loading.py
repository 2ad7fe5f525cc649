"""One way to open a model folder, whatever wrote it: `open_model(path)` -> model, tokenizer,
metadata, data.

Which folders open, and how, is meshlm.folders: `locate(path)` recognises a folder from its
config.json alone (meshlm.folders.locate: the table of folders, the tokenizer rule and the data
rule), the format registry gives its config and weights (meshlm.folders.formats.FOLDERS, handed the
config.json locate read: every file of a folder is read once per open), and a meshlm checkpoint's
files are checked against its manifest (meshlm.folders.integrity). `open_model` builds the model
once, as a `MeshLM` (a family folder becomes the vanilla meshlm model with the same logits), and
checks the weights against it once (`weight_mismatch`). A quantized checkpoint's config.json lists
its quantized layers ("quantization"); they are rebuilt before the weights load. A LoRA run's
checkpoint opens with its adapters merged (meshlm.adapters). `Opened` gives the tokenizer and the
held-out data under the rules of meshlm.folders.locate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshlm.adapters import LoraSpec
from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.data.prepare import PreparedData, prepare_default
from meshlm.data.tasks import data_folder
from meshlm.data.tokenizer import TextTokenizer, check_vocab, load_tokenizer, resolve_tokenizer_path
from meshlm.errors import CheckpointError, ConfigError, DataError
from meshlm.folders.formats import KNOWN_FAMILIES, mismatch
from meshlm.folders.locate import ModelFolder, locate
from meshlm.model import MeshLM
from meshlm.quant.calibrate import empty_structure
from meshlm.runtime import devices


@dataclass
class Opened:
    """An opened model folder: the model (eval mode), its tokenizer and data under the rules of
    meshlm.folders.locate."""

    model: MeshLM
    folder: ModelFolder
    tokenizer_override: str | None = None
    force_tokenizer: bool = False  # an override that encodes unlike the folder's own is accepted
    merged: bool = False  # a LoRA run's checkpoint: its adapters were merged into the base weights
    # on opening

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def run_dir(self) -> Path:
        return self.folder.run_dir

    @property
    def format(self) -> str:
        return self.folder.format

    @property
    def meta(self) -> dict[str, Any]:
        return self.folder.meta

    @property
    def train(self) -> dict[str, Any]:
        return self.folder.train

    @property
    def seq_len(self) -> int:
        """The training sequence length, else the model's context length."""
        return int(self.train.get("seq_len") or 0) or self.model.config.context_length

    @property
    def tokenizer_source(self) -> str | None:
        """The tokenizer rule's answer: "default", "pythia", a tokenizer.json path, or None (none
        known)."""
        return self.folder.tokenizer_source(self.tokenizer_override)

    @cached_property
    def tokenizer(self) -> TextTokenizer:
        """Loaded on first use (conversion may not need one), checked against the model's
        vocabulary."""
        if self.tokenizer_override:
            tok = self.folder.chosen_tokenizer(self.tokenizer_override, self.force_tokenizer)
        else:
            tok = load_tokenizer(self.folder.require_tokenizer())
        check_vocab(self.model.config.vocab_size, tok)
        return tok

    @property
    def tokenizer_file(self) -> Path | None:
        """The tokenizer file a checkpoint derived from this model carries, so it stands alone; None
        when none is known (the derived checkpoint then names none either)."""
        source = self.tokenizer_source
        return resolve_tokenizer_path(source) if source else None

    def data_dir(self, override: str | os.PathLike | None = None) -> Path:
        """The data rule (meshlm.folders.locate): the prepared folder to take held-out windows
        from."""
        source = str(override or self.folder.data_source())
        if source == "default":
            return prepare_default(tokenizer=self.folder.require_tokenizer(self.tokenizer_override))
        path = data_folder(source)  # a task: source: the cached task data it was trained on
        if not path.is_dir():
            raise DataError(f"prepared data {path} does not exist; pass --data DIR (a `meshlm "
                            "prepare` output)")
        return path

    def held_out(self, override: str | os.PathLike | None = None,
                 split: str = "val") -> PreparedData:
        data = PreparedData(self.data_dir(override), split)
        data.check_ids(self.model.config.vocab_size)
        prepared_with = data.manifest["tokenizer"]
        if not self.tokenizer.made(prepared_with):
            raise ConfigError(f"{data.dir} was tokenised with {prepared_with['name']!r}, not the "
                              "model's tokenizer "
                              # usage: 2
                              f"{self.tokenizer.name!r}; pass --data prepared with it (or "
                              "--tokenizer)")
        return data


def weight_mismatch(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """How `weights` fail to fit `model` (the first few missing, unexpected and reshaped names);
    None if they fit. The one weight check: every folder's weights pass it, against their model."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if found == expected:
        return None
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    reshaped = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
    return f"missing {missing[:3]}, unexpected {extra[:3]}, other shapes {reshaped[:3]}"


def check_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """weight_mismatch as the CheckpointError naming `folder` (meshlm.folders.formats.mismatch)."""
    found = weight_mismatch(model, weights)
    if found:
        raise mismatch(folder, found)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """A torch.device as is; a name checked by meshlm.runtime.devices (one message for a device
    that is not available)."""
    return name if isinstance(name, torch.device) else devices.resolve_device(name)


def open_model(path: str | os.PathLike | ModelFolder, device: str | torch.device = "cpu",
               tokenizer: str | None = None, check: bool = True,
               force_tokenizer: bool = False) -> Opened:
    """Open any model folder (meshlm.folders.locate; a ModelFolder from `locate` is not
    recognised again) as an eval-mode MeshLM on `device`. `tokenizer` overrides the tokenizer rule
    (refused if it encodes unlike the folder's own, unless `force_tokenizer`); `check` verifies a
    meshlm checkpoint's file hashes. The folder is recognised once, its model built once and its
    weights checked once."""
    folder = locate(path)
    lora = lora_of(folder)
    weights = folder.weights(check)  # verified first: an edited config.json is refused, never built
    model = MeshLM(folder.model_config())
    if lora is not None:  # a LoRA run's checkpoint: base weights + PEFT adapters, merged on load
        lora.apply(model)
    if folder.meta.get("quantization"):  # `meshlm quantize` output: int8/int4 layers (meshlm.quant)
        empty_structure(model, folder.meta["quantization"])
    check_weights(model, weights, folder.path)
    model.load_state_dict(weights)
    if lora is not None:
        lora.merge(model)
    return Opened(model.to(resolve_device(device)).eval(), folder,
                  str(tokenizer) if tokenizer else None,
                  force_tokenizer, merged=lora is not None)


def lora_of(folder: ModelFolder):
    """The LoraSpec (meshlm.adapters) of a checkpoint trained with LoRA, else None. A `meshlm
    quantize` output of a LoRA run carries the run's train settings but holds the merged weights, so
    it has none."""
    if (folder.format != "meshlm" or folder.meta.get("quantization")
        or not int(folder.train.get("lora_rank") or 0)):
        return None
    return LoraSpec.of(folder.train)


def read_family(folder: str | os.PathLike | ModelFolder) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(vanilla ModelConfig, meshlm-named fp32 state dict) of a GPT-NeoX, Llama or OLMoE folder,
    checked against the model its config.json describes (built on the meta device: no memory)."""
    found = locate(folder)
    if found.format not in BACKBONES:
        raise CheckpointError(f"{found.path} is a {found.format} checkpoint, not a Hugging Face "
                              f"{KNOWN_FAMILIES} folder (config.json model_type must be one of "
                              f"{sorted(b.model_type for b in BACKBONES.values())})")
    cfg, state = found.model_config(), found.weights()
    with torch.device("meta"):
        expected = MeshLM(cfg)
    check_weights(expected, state, found.path)
    return cfg, state
