"""One way to open a model folder, whatever wrote it: `open_model(path)` -> model, tokenizer,
metadata, data.

    folder                                             format   results of eval/probe go to
    <run>/ (its `latest`, else newest step-NNNNNN)     meshlm   <run>/
    <run>/step-NNNNNN/                                 meshlm   <run>/
    `meshlm convert`/`meshlm retrofit` output          meshlm   the folder itself
    `meshlm quantize` output (int8/int4 layers)        meshlm   the folder itself
    `meshlm convert --to hf` output (MeshForCausalLM)  hf       the folder itself
    a LoRA run's checkpoint (train.lora_rank > 0)      meshlm   <run>/; adapters merged
                                                                (meshlm.adapters)
    Hugging Face GPT-NeoX (Pythia) / Llama / OLMoE     neox | llama | olmoe   the folder itself
    org/name[@revision] on the Hugging Face Hub        any above ./org--name (meshlm.hub; cached
                                                       snapshot)

The format is recognised from config.json alone. `locate(path)` reads only that (a `ModelFolder`:
the model config, the tokenizer and data the folder names); `open_model` also loads the weights into
a `MeshLM` (a family folder becomes the vanilla meshlm model with the same logits), checking every
file. Each format's config and weights come from its registered class below the loader
(meshlm.interop.folders.FOLDERS), given the config.json read here: every file of a folder is read
once per open. The loader builds the model once and checks the weights against it once
(`weight_mismatch`). A quantized checkpoint's config.json lists its quantized layers
("quantization"); they are rebuilt before the weights load.

The tokenizer rule, the first that applies:
    1. an explicit choice (`--tokenizer`; for training, `train.tokenizer` other than "default");
    2. the folder's own tokenizer file: the tokenizer.json a meshlm checkpoint carries (config.json
       "tokenizer"; written by training with a non-default tokenizer, by convert and by retrofit),
       or the tokenizer.json beside a Hugging Face folder's config.json;
    3. the tokenizer a meshlm checkpoint's training config names (train.tokenizer: "default",
       "pythia");
    4. the shipped 8,192-token "default" — only for a folder that names none and whose vocabulary
       has exactly 8,192 ids. Any other vocabulary was made with another tokenizer: guessing the
       default there would pass the vocabulary check (8,192 < 50,304) while scoring garbage, so it
       is an error asking for one.
An explicit choice must encode like the tokenizer rules 2-4 give (compared by behaviour, so a
re-exported tokenizer.json is the same one): another tokenizer is a ConfigError unless forced
(`--force-tokenizer`, train.force_tokenizer), since a model scored through ids it was not trained on
gives wrong numbers silently. The data rule (held-out data for eval and probe), the first that
applies:
    1. an explicit `--data` folder;
    2. the prepared folder the checkpoint's training config names (train.data);
    3. "default": the embedded corpus, prepared (once, cached by tokenizer hash) with the tokenizer
       above.
A prepared folder tokenised with a different tokenizer than the model's is a DataError naming both.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshlm import checkpoint, hub
from meshlm.adapters import LoraSpec
from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.data.prepare import PreparedData, prepare_default
from meshlm.data.tasks import data_folder
from meshlm.data.tokenizer import (
    DEFAULT_VOCAB,
    TextTokenizer,
    check_vocab,
    differences,
    folder_chat_template,
    load_tokenizer,
    resolve_tokenizer_path,
)
from meshlm.errors import CheckpointError, ConfigError, DataError, MeshlmError
from meshlm.interop import folders
from meshlm.interop.folders import FOLDERS, KNOWN_FAMILIES, format_of, mismatch
from meshlm.model import MeshLM
from meshlm.quant.calibrate import empty_structure
from meshlm.runtime import devices

_STEP_DIR = re.compile(r"^step-\d+$")


# -- recognising a folder --------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFolder:
    """A recognised model folder, read as far as its config.json (no weights)."""

    path: Path  # the folder holding config.json; a run dir is resolved to its checkpoint
    format: str  # "meshlm", "hf" or a family name
    config: dict[str, Any]  # its config.json
    hub: str | None = None  # "org/name@commit" for a Hugging Face Hub snapshot (meshlm.hub)
    # SHA-256 of the config.json bytes read: a meshlm checkpoint's weights load only if the
    # verified manifest names these bytes (no rewrite between recognising and loading)
    config_sha256: str | None = None

    @property
    def run_dir(self) -> Path:
        """Where results about this model go: the run of a step-NNNNNN checkpoint, ./<org>--<name>
        for a Hub snapshot (the cache is not ours to write), else the folder itself."""
        if self.hub:
            return hub.results_dir(self.hub)
        return (self.path.parent if self.format == "meshlm"
                and _STEP_DIR.match(self.path.name) else self.path)

    @property
    def train(self) -> dict[str, Any]:
        """The training config a meshlm checkpoint was written with ({} for every other folder)."""
        return (self.config.get("train") or {}) if self.format == "meshlm" else {}

    @property
    def meta(self) -> dict[str, Any]:
        """A meshlm checkpoint's config.json; for other folders the same keys that apply (format,
        model, and a quantized meshlm-HF export's quantization)."""
        if self.format == "meshlm":
            return self.config
        source = {"format": self.format, "path": str(self.path),
                  **({"hub": self.hub} if self.hub else {})}
        quantized = self.config.get("meshlm_quantization") if self.format == "hf" else None
        return {"format": self.format, "model": self.model_config().to_dict(), "source": source,
                **({"quantization": quantized} if quantized else {})}

    def model_config(self) -> ModelConfig:
        """The model config.json describes, built once per recognised folder."""
        return self._model_config

    @cached_property
    def _model_config(self) -> ModelConfig:
        return FOLDERS[self.format].model_config(self.config, self.path)

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template: the folder's, else its run's (where `meshlm finetune`
        records the one it trained in); None without one (meshlm.data.tokenizer)."""
        return folder_chat_template(self.path, self.run_dir)

    def own_tokenizer(self) -> str | None:
        """Rules 2 and 3: the tokenizer file the folder carries, else the one its training config
        names."""
        if self.format == "meshlm" and self.config.get("tokenizer"):
            return str(self.path / self.config["tokenizer"])
        if self.format != "meshlm" and (self.path / checkpoint.TOKENIZER).is_file():
            return str(self.path / checkpoint.TOKENIZER)
        return self.train.get("tokenizer")

    def tokenizer_source(self, override: str | os.PathLike | None = None) -> str | None:
        """The tokenizer rule (module docstring): "default", "pythia" or a tokenizer.json path; None
        when the folder names none and its vocabulary is not the default tokenizer's."""
        if override:
            return str(override)
        own = self.own_tokenizer()
        if own:
            return own
        return "default" if self.model_config().vocab_size == DEFAULT_VOCAB else None

    def require_tokenizer(self, override: str | os.PathLike | None = None) -> str:
        """tokenizer_source, or a DataError saying how to name the tokenizer."""
        source = self.tokenizer_source(override)
        if source is None:
            raise DataError(f"{self.path} names no tokenizer, and its "
                            f"{self.model_config().vocab_size:,}-token vocabulary is not the "
                            f"default tokenizer's {DEFAULT_VOCAB:,}; put the model's "
                            "tokenizer.json in the folder or pass --tokenizer (train.tokenizer "
                            "when training)")
        return source

    def chosen_tokenizer(self, override: str | os.PathLike, force: bool = False,
                         setting: str = "--tokenizer",
                         forcing: str = "--force-tokenizer") -> TextTokenizer:
        """The explicitly chosen tokenizer, loaded, once it is known to encode like the folder's own
        (rules 2-4); a ConfigError naming what differs otherwise, unless `force`. A folder naming
        none has nothing to compare with; one whose own tokenizer cannot be loaded (e.g. "pythia"
        before `meshlm fetch`) is warned about and trusted."""
        chosen = load_tokenizer(override)
        own = None if force else self.tokenizer_source()
        if own is None or own == str(override):
            return chosen
        try:
            theirs = load_tokenizer(own)
        except MeshlmError as err:
            print(f"warning: {setting} {override} is not compared with {self.path}'s own tokenizer "
                  f"({err})",
                  file=sys.stderr)
            return chosen
        if chosen.hash != theirs.hash:
            raise ConfigError(f"{setting} {override} does not encode like {self.path}'s tokenizer "
                              f"{theirs.name} (different "
                              f"{', '.join(differences(chosen, theirs))}): the model would read "
                              f"ids it was not trained on; drop {setting}, or pass {forcing} to "
                              "use it anyway")
        return chosen

    def data_source(self) -> str:
        """Data rules 2 and 3: the prepared folder the training config names, else "default"."""
        return str(self.train.get("data") or "default")

    def weights(self, check: bool = True) -> dict[str, torch.Tensor]:
        """The meshlm-named state dict, by the format's class (meshlm.interop.folders.FOLDERS; fp32
        for Hugging Face folders), handed the config.json read on recognising (never read again);
        `check` verifies a meshlm checkpoint's hashes, its config.json as the bytes read then."""
        read = (self.config, self.config_sha256) if self.config_sha256 else None
        return FOLDERS[self.format].weights(self.path, read, self.model_config(), check)


def locate(path: str | os.PathLike | ModelFolder) -> ModelFolder:
    """Recognise a folder (a run dir means its newest complete checkpoint) or a Hugging Face Hub
    name (meshlm.hub: fetched, or read from its cache); CheckpointError if it is none. A ModelFolder
    is recognised already and returned as is: a path is recognised once, however often it is
    used."""
    if isinstance(path, ModelFolder):
        return path
    path, hub_id = hub.resolve(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a checkpoint, run or model folder, "
                              f"or a Hugging Face Hub name org/name[@revision]")
    found = _recognise(path)
    return replace(found, hub=hub_id) if hub_id else found


def _recognise(path: Path) -> ModelFolder:
    """config.json read once: its format names the registered class (meshlm.interop.folders)."""
    config = path / checkpoint.CONFIG
    if config.is_file():
        raw, sha256 = folders.read_json_and_digest(config)
        return ModelFolder(path, format_of(raw, config), raw, config_sha256=sha256)
    if (path / "latest").is_file() or checkpoint.list_checkpoints(path):
        step = checkpoint.resolve(path)
        meta, sha256 = checkpoint.read_meta_and_digest(step)
        return ModelFolder(step, "meshlm", meta, config_sha256=sha256)
    raise CheckpointError(f"{path} has no config.json: it is not a meshlm checkpoint or run, nor a "
                          f"{KNOWN_FAMILIES} or meshlm Hugging Face folder")


# -- opening ---------------------------------------------------------------------------------------
@dataclass
class Opened:
    """An opened model folder: the model (eval mode), its tokenizer and data under the module's
    rules."""

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
        """The data rule (module docstring): the prepared folder to take held-out windows from."""
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
    """weight_mismatch as the CheckpointError naming `folder` (meshlm.interop.folders.mismatch)."""
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
    """Open any model folder (see the module docstring; a ModelFolder from `locate` is not
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
