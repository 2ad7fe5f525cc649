"""What `meshlm train` checks before any compute (every problem in one error), and the warnings it prints:
the device and the memory the run needs there (meshlm.train.footprint), the tokenizer and its vocabulary, the
prepared data (tokenizer, length, ids, a step count that repeats it absurdly), init_from, the trackers' packages,
the run folder; and what a resume changes (changed_settings, model_change). Read-only: safe on every rank."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from meshlm import checkpoint
from meshlm.data.prepare import PreparedData
from meshlm.data.tasks import data_folder, window_length
from meshlm.data.tokenizer import check_vocab, load_tokenizer
from meshlm.errors import Problems
from meshlm.loading import locate
from meshlm.runtime.devices import device_problem
from meshlm.train import trackers
from meshlm.train.config import TrainConfig
from meshlm.train.footprint import memory_problem, schedule_warnings
from meshlm.train.ownership import owner_problem

__all__ = ["changed_settings", "model_change", "preflight", "schedule_warnings"]


def changed_settings(saved: dict, current: dict, run_name: str) -> list[str]:
    """The train fields a resume changes. An unset name means the run folder's name, so `train.name=<that>`
    (or leaving it unset) is the same run, not a change."""
    saved, current = {**saved, "name": saved.get("name") or run_name}, {**current, "name": current["name"] or run_name}
    return sorted(k for k, v in current.items() if saved.get(k, v) != v)


def model_change(ckpt: checkpoint.Checkpoint, now: dict, cfg: TrainConfig) -> str:
    """Why a checkpoint cannot be resumed with this model config: the fields that differ, and the train setting
    behind a derived one (model.max_loops follows train.loops)."""
    saved = ckpt.meta["model"]
    diff = [f"model.{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    loops = ckpt.meta.get("train", {}).get("loops", cfg.loops)
    cause = f" (model.max_loops follows train.loops, {loops!r} -> {cfg.loops!r})" if loops != cfg.loops else ""
    return (f"{ckpt.path} was written for another model config ({'; '.join(diff)}){cause}; resume with the settings "
            f"the run started with")


def preflight(cfg: TrainConfig, resume: bool = False) -> None:
    """What `train` needs besides a valid config, checked before any compute, every problem in one error:
    the device, the tokenizer and its vocabulary, the prepared data (tokenizer, length), init_from, the run
    folder. Read-only: safe on every rank."""
    p = Problems()
    p.need(not (problem := device_problem(cfg.device, "train.device")), problem or "")
    model_cfg, seq_len = cfg.model_config(), cfg.sequence_length()
    if not problem:  # an estimate over the free memory is refused before anything is allocated
        p.need(not (short := memory_problem(cfg, model_cfg, seq_len, planned_device(cfg), world_size())), short or "")
    source = p.check(cfg.tokenizer_source)
    tok = p.check(load_tokenizer, source) if source is not None else None
    if tok is not None:
        p.check(check_vocab, model_cfg.vocab_size, tok)
    path = p.check(data_folder, cfg.data)  # a task: source is generated here (once, into the cache)
    if path is not None and p.need(path.is_dir(), f"train.data={cfg.data}: {path} does not exist; run "
                                                  f"`meshlm prepare` or set train.data=default"):
        _data_problems(p, path, seq_len, model_cfg, tok, cfg.seq_len)
    if cfg.init_from and (folder := p.check(locate, cfg.init_from)) and cfg.tokenizer != "default":
        p.check(folder.chosen_tokenizer, cfg.tokenizer, cfg.force_tokenizer, "train.tokenizer",
                "train.force_tokenizer=true")  # must encode like the weights' own tokenizer
    for problem in trackers.missing([n for n in cfg.tracker_names() if n != "tensorboard"]):
        p.need(False, problem)
    p.writable(cfg.run_dir(), "run folder")
    busy = owner_problem(cfg.run_dir())  # another training in this folder: nothing else about it matters
    p.need(busy is None, busy or "")
    existing = checkpoint.list_checkpoints(cfg.run_dir())
    p.need(resume or not existing or bool(busy), f"{cfg.run_dir()} already holds checkpoints (newest "
                                   f"{existing[0].name if existing else ''}); pass --resume to continue, or choose "
                                   f"another run with train.name=... or train.out_dir=...")
    p.raise_if_any()


def _data_problems(p: Problems, path: Path, seq_len: int, model_cfg, tok, asked_seq_len: int) -> None:
    """The prepared folder's problems for preflight: each split opens (sizes, checksums), holds a window of the
    training length (task data: its example block, within the context), has ids within the vocabulary, and was
    prepared with the run's tokenizer."""
    splits = [data for split in ("train", "val") if (data := p.check(PreparedData, path, split)) is not None]
    if not splits:
        return
    manifest = splits[0].manifest
    seq_len = p.check(window_length, manifest, asked_seq_len) or seq_len  # task data: its example block
    p.need(seq_len <= model_cfg.context_length,
           f"the task data's examples are {seq_len} tokens but the model's context_length is "
           f"{model_cfg.context_length}; set model.context_length={seq_len} or more")
    for data in splits:
        p.check(data.num_sequences, seq_len)
        p.check(data.check_ids, model_cfg.vocab_size)
    if tok is not None and not tok.made(manifest["tokenizer"]):
        p.need(False, f"{path} was prepared with tokenizer {manifest['tokenizer']['name']!r}, not "
                      f"{tok.name!r}; set train.tokenizer to match or prepare the data again")


def planned_device(cfg: TrainConfig) -> torch.device:
    """The device parallel.setup will pick (read-only: nothing is initialised)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
