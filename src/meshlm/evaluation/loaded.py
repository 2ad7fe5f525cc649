"""A checkpoint opened for analysis: model, tokenizer, held-out data and where results go.

Everything is read from the checkpoint's own config.json: the model config, and from the training config
the tokenizer, the prepared data ("default" = the embedded corpus, prepared into the cache on first use)
and the sequence length. Results of `meshlm eval` / `meshlm probe` go to the *run* folder (the parent of
step-NNNNNN), so they survive checkpoint pruning and `meshlm report RUN` finds them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshlm import checkpoint
from meshlm.data.prepare import PreparedData, prepare_default
from meshlm.data.tokenizer import check_vocab, load_tokenizer
from meshlm.errors import DataError


@dataclass
class Loaded:
    model: Any  # MeshLM, eval mode
    tokenizer: Any  # TextTokenizer
    meta: dict  # the checkpoint's config.json
    path: Path  # the step-NNNNNN folder
    run_dir: Path

    @property
    def train(self) -> dict:
        return self.meta.get("train") or {}

    @property
    def seq_len(self) -> int:
        return int(self.train.get("seq_len") or 0) or self.model.config.context_length

    def data_dir(self, override: str | os.PathLike | None = None) -> Path:
        """The prepared data the model was trained on (its val split is held out), or `override`."""
        source = str(override or self.train.get("data") or "default")
        if source == "default":
            return prepare_default(tokenizer=self.train.get("tokenizer", "default"))
        path = Path(source).expanduser()
        if not path.is_dir():
            raise DataError(f"prepared data {path} does not exist; pass --data DIR (a `meshlm prepare` output)")
        return path

    def held_out(self, override: str | os.PathLike | None = None, split: str = "val"):
        data = PreparedData(self.data_dir(override), split)
        prepared_with = data.manifest["tokenizer"]["hash"]
        if prepared_with != self.tokenizer.hash:
            raise DataError(f"{data.dir} was tokenised with {data.manifest['tokenizer']['name']!r}, not the "
                            f"checkpoint's tokenizer {self.tokenizer.name!r}; pass --data prepared with it")
        return data


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def open_checkpoint(path: str | os.PathLike, device: str = "auto") -> Loaded:
    """Load and verify a checkpoint (a run folder means its latest step)."""
    step_dir = checkpoint.resolve(path)
    meta = checkpoint.read_meta(step_dir)
    model = checkpoint.load_model(step_dir, device=resolve_device(device))
    tokenizer = load_tokenizer((meta.get("train") or {}).get("tokenizer", "default"))
    check_vocab(model.config.vocab_size, tokenizer)
    return Loaded(model, tokenizer, meta, step_dir, step_dir.parent)
