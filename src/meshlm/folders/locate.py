"""Recognising a model folder: `locate(path)` -> a `ModelFolder`, read as far as its config.json.

    folder                                             format   results of eval/probe go to
    <run>/ (its `latest`, else newest step-NNNNNN)     meshlm   <run>/
    <run>/step-NNNNNN/                                 meshlm   <run>/
    `meshlm convert`/`meshlm retrofit` output          meshlm   the folder itself
    `meshlm quantize` output (int8/int4 layers)        meshlm   the folder itself
    `meshlm convert --to hf` output (MeshForCausalLM)  hf       the folder itself
    a LoRA run's checkpoint (train.lora_rank > 0)      meshlm   <run>/; adapters merged
                                                                (meshlm.adapters)
    Hugging Face GPT-NeoX (Pythia) / Llama / OLMoE     neox | llama | olmoe   the folder itself
    org/name[@revision] on the Hugging Face Hub        any above ./org--name (meshlm.folders.hub;
                                                       cached snapshot)

The format is recognised from config.json alone, read once: a `ModelFolder` holds it (and the
SHA-256 of its bytes), the model config it describes, and the tokenizer and data the folder names.
Each format's config and weights come from its registered class (meshlm.folders.formats.FOLDERS),
handed the config.json read here; meshlm.loading.open_model loads the weights into a `MeshLM`.

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
gives wrong numbers silently. The data rule (held-out data for eval and probe; applied by
meshlm.loading.Opened), the first that applies:
    1. an explicit `--data` folder;
    2. the prepared folder the checkpoint's training config names (train.data);
    3. "default": the embedded corpus, prepared (once, cached by tokenizer hash) with the tokenizer
       above.
A prepared folder tokenised with a different tokenizer than the model's is a ConfigError naming
both.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from meshlm.config import ModelConfig
from meshlm.data.tokenizer import (
    DEFAULT_VOCAB,
    TextTokenizer,
    differences,
    folder_chat_template,
    load_tokenizer,
)
from meshlm.errors import CheckpointError, ConfigError, DataError, MeshlmError
from meshlm.folders import formats, hub, integrity
from meshlm.folders.formats import FOLDERS, KNOWN_FAMILIES, format_of


@dataclass(frozen=True)
class ModelFolder:
    """A recognised model folder, read as far as its config.json (no weights)."""

    path: Path  # the folder holding config.json; a run dir is resolved to its checkpoint
    format: str  # "meshlm", "hf" or a family name
    config: dict[str, Any]  # its config.json
    hub: str | None = None  # "org/name@commit" for a Hugging Face Hub snapshot (meshlm.folders.hub)
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
                and integrity.STEP_DIR.match(self.path.name) else self.path)

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
        if self.format != "meshlm" and (self.path / integrity.TOKENIZER).is_file():
            return str(self.path / integrity.TOKENIZER)
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
        """The meshlm-named state dict, by the format's class (meshlm.folders.formats.FOLDERS; fp32
        for Hugging Face folders), handed the config.json read on recognising (never read again);
        `check` verifies a meshlm checkpoint's hashes, its config.json as the bytes read then."""
        read = (self.config, self.config_sha256) if self.config_sha256 else None
        return FOLDERS[self.format].weights(self.path, read, self.model_config(), check)


def locate(path: str | os.PathLike | ModelFolder) -> ModelFolder:
    """Recognise a folder (a run dir means its newest complete checkpoint) or a Hugging Face Hub
    name (meshlm.folders.hub: fetched, or read from its cache); CheckpointError if it is none. A
    ModelFolder is recognised already and returned as is: a path is recognised once, however often
    it is used."""
    if isinstance(path, ModelFolder):
        return path
    path, hub_id = hub.resolve(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a checkpoint, run or model folder, "
                              f"or a Hugging Face Hub name org/name[@revision]")
    found = _recognise(path)
    return replace(found, hub=hub_id) if hub_id else found


def _recognise(path: Path) -> ModelFolder:
    """config.json read once: its format names the registered class (meshlm.folders.formats)."""
    config = path / integrity.CONFIG
    if config.is_file():
        raw, sha256 = formats.read_json_and_digest(config)
        return ModelFolder(path, format_of(raw, config), raw, config_sha256=sha256)
    if integrity.holds_checkpoints(path):
        step = integrity.resolve(path)
        meta, sha256 = integrity.read_meta_and_digest(step)
        return ModelFolder(step, "meshlm", meta, config_sha256=sha256)
    raise CheckpointError(f"{path} has no config.json: it is not a meshlm checkpoint or run, nor a "
                          f"{KNOWN_FAMILIES} or meshlm Hugging Face folder")
