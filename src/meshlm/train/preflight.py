"""What `meshlm train` checks of a resolved plan (meshlm.train.plan) before any compute, every
problem in one error: the device and the memory the run needs there (meshlm.train.footprint), the
tokenizer's vocabulary and the prepared data (meshlm.train.data_source), the trackers' packages, the
run folder; and what a resume changes (changed_settings, model_change). Read-only: safe on every
rank."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from meshlm.errors import Problems
from meshlm.folders import integrity
from meshlm.runtime.devices import device_problem
from meshlm.train import trackers
from meshlm.train.config import TrainConfig
from meshlm.train.data_source import data_problems
from meshlm.train.footprint import memory_problem, schedule_warnings
from meshlm.train.ownership import owner_problem
from meshlm.train.plan import RunPlan

__all__ = ["changed_settings", "model_change", "occupied", "preflight", "schedule_warnings"]


def changed_settings(saved: dict, current: dict, run_name: str) -> list[str]:
    """The train fields a resume changes. An unset name means the run folder's name, so
    `train.name=<that>` (or leaving it unset) is the same run, not a change."""
    saved, current = {**saved, "name": saved.get("name")
                      or run_name}, {**current, "name": current["name"] or run_name}
    return sorted(k for k, v in current.items() if saved.get(k, v) != v)


def model_change(ckpt: integrity.Checkpoint, now: dict, cfg: TrainConfig) -> str:
    """Why a checkpoint cannot be resumed with this model config: the fields that differ, and the
    train setting behind a derived one (model.max_loops follows train.loops)."""
    saved = ckpt.meta["model"]
    diff = [f"model.{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    loops = ckpt.meta.get("train", {}).get("loops", cfg.loops)
    cause = (f" (model.max_loops follows train.loops, {loops!r} -> {cfg.loops!r})"
             if loops != cfg.loops else "")
    return (f"{ckpt.path} was written for another model config ({'; '.join(diff)}){cause}; resume "
            "with the settings the run started with")


def preflight(plan: RunPlan, resume: bool = False) -> None:
    """What `train` needs besides a resolved plan, checked before any compute, every problem in one
    error: the device and its free memory, the tokenizer's vocabulary and the prepared data, the
    trackers, the run folder. Read-only: safe on every rank."""
    cfg, p = plan.cfg, Problems()
    p.need(not (problem := device_problem(cfg.device, "train.device")), problem or "")
    if not problem:  # an estimate over the free memory is refused before anything is allocated
        short = memory_problem(cfg, plan.model, plan.seq_len, planned_device(cfg), world_size())
        p.need(not short, short or "")
    data_problems(p, plan, plan.data_dir)  # the embedded corpus (None) is checked once prepared
    for problem in trackers.missing([n for n in cfg.tracker_names() if n != "tensorboard"]):
        p.need(False, problem)
    p.writable(plan.run_dir, "run folder")
    busy = owner_problem(plan.run_dir)  # another training in this folder: nothing else matters
    p.need(busy is None, busy or "")
    if not busy:
        p.need(not (taken := occupied(plan.run_dir, resume)), taken or "")
    p.raise_if_any()


def occupied(run_dir: Path, resume: bool) -> str | None:
    """Why a fresh run (no --resume) cannot start in `run_dir`: it already holds checkpoints."""
    existing = integrity.list_checkpoints(run_dir)
    if resume or not existing:
        return None
    return (f"{run_dir} already holds checkpoints (newest {existing[0].name}); pass --resume to "
            f"continue, or choose another run with train.name=... or train.out_dir=...")


def planned_device(cfg: TrainConfig) -> torch.device:
    """The device parallel.setup will pick (read-only: nothing is initialised)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
