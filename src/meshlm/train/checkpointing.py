"""A Trainer's checkpoints: the state it saves, the resume that restores exactly that state, and
`train.init_from`'s weights-only start.

state.pt holds the optimizer (keyed by parameter name), the scheduler, the RNG of torch, Python and
CUDA, the best validation loss and the count of non-finite steps in a row: `save` writes exactly
what `_restore` reads, so a run resumed from step-N replays step N with the state the uninterrupted
run had (meshlm.train.trainer).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import torch

from meshlm import atomic, checkpoint
from meshlm.config import ModelConfig
from meshlm.errors import CheckpointError, ConfigError
from meshlm.folders import integrity
from meshlm.folders.locate import ModelFolder
from meshlm.loading import open_model, weight_mismatch
from meshlm.model import MeshLM
from meshlm.train import parallel
from meshlm.train.config import TrainConfig
from meshlm.train.monitor import Metrics
from meshlm.train.optim import retarget
from meshlm.train.plan import RunPlan
from meshlm.train.preflight import changed_settings, model_change, occupied


class Checkpointing:
    """Saving, resuming and initialising, for meshlm.train.trainer.Trainer: it sets the attributes
    below before calling any of these methods."""

    plan: RunPlan
    cfg: TrainConfig
    model_cfg: ModelConfig
    env: parallel.Env
    log: Callable[[str], None]
    run_dir: Path
    total_steps: int
    seq_len: int
    model: MeshLM  # unwrapped: what is saved and loaded
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    metrics: Metrics
    step: int
    best_val: float
    nonfinite_in_row: int

    # -- run directory, resume and init_from -------------------------------------------------------
    def _prepare_run_dir(self, resume: bool) -> None:
        if taken := occupied(self.run_dir, resume):
            raise ConfigError(taken)
        existing = integrity.list_checkpoints(self.run_dir)
        ckpt = self._find_resumable() if resume else None
        if resume and ckpt is None:
            if existing:
                raise CheckpointError(f"no usable checkpoint in {self.run_dir}: every one failed "
                                      "verification")
            self.log(f"no checkpoint in {self.run_dir} yet: starting from step 0")
        if ckpt is not None:
            self._restore(ckpt)
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for name, text in self.plan.run_files:  # ours now (meshlm.train.ownership)
                atomic.write_text(self.run_dir / name, text)
            if ckpt is not None:
                # drop what the killed run logged after its checkpoint
                self.metrics.truncate_after(self.step)
            else:
                self.metrics.path.unlink(missing_ok=True)
        parallel.barrier(self.env)

    def _find_resumable(self) -> integrity.Checkpoint | None:
        """Rank 0 verifies (hashes) the candidates; the others load the one it picked without
        re-hashing."""
        ckpt = checkpoint.find_resumable(self.run_dir, warn=self.log) if self.env.is_main else None
        path = parallel.broadcast_object(ckpt.path if ckpt else None, self.env)
        if ckpt is None and path is not None:
            ckpt = integrity.load_checkpoint(path, check=False)
        return ckpt

    def _restore(self, ckpt: integrity.Checkpoint) -> None:
        if ckpt.meta["model"] != self.model_cfg.to_dict():
            raise CheckpointError(model_change(ckpt, self.model_cfg.to_dict(), self.cfg))
        changed = changed_settings(ckpt.meta["train"], self.cfg.to_dict(), self.run_dir.name)
        if changed:
            self.log(f"warning: resuming with changed train settings: {', '.join(changed)}")
        state = ckpt.state
        parallel.load_full_state(self.model, self.optimizer, ckpt.weights, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the current config's schedule, at the saved step
        retarget(self.scheduler, self.cfg, self.total_steps)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if torch.cuda.is_available() and state["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step, self.best_val = ckpt.step, state["best_val"]
        self.nonfinite_in_row = state["nonfinite_in_row"]
        self.log(f"resumed {self.run_dir} from {ckpt.path.name} (step "
                 f"{self.step}/{self.total_steps})")

    def _initialise_from(self, init: ModelFolder) -> None:
        """Weights only, from any folder meshlm.loading opens: the optimizer and schedule start
        fresh."""
        source = open_model(init)  # the folder the plan located, not recognised again
        path = self.cfg.init_from
        # per-loop LoRA added to a model without it (model.loop_lora_rank=...): its deltas start at
        # their init
        fresh = {k: v for k, v in self.model.state_dict().items() if ".loop_lora." in k}
        weights = {**fresh, **source.model.state_dict()}
        mismatch = weight_mismatch(self.model, weights)
        if mismatch:
            raise CheckpointError(f"train.init_from={path}: its weights do not fit the model "
                                  f"({mismatch}); drop the model.* overrides that change the "
                                  "architecture, or make the new layout with `meshlm retrofit`")
        parallel.load_full_state(self.model, None, weights, None)
        self.log(f"initialised from {source.path} (weights only; optimizer and schedule start at "
                 "step 0)")

    # -- saving ------------------------------------------------------------------------------------
    def save(self, val_loss: float) -> Path | None:
        weights = parallel.full_model_state(self.model)  # collective under FSDP
        optim = parallel.full_optimizer_state(self.model, self.optimizer)
        path = None
        if self.env.is_main:
            is_best = math.isfinite(val_loss) and val_loss < self.best_val
            self.best_val = val_loss if is_best else self.best_val
            state = {
                "step": self.step, "optimizer": optim, "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                        else []},
                "best_val": self.best_val, "nonfinite_in_row": self.nonfinite_in_row,
            }
            meta = {"model": self.model_cfg.to_dict(), "train": self.cfg.to_dict(),
                    "val_loss": val_loss,
                    "tokens": self.step * self.cfg.global_batch * self.seq_len}
            path = checkpoint.save_checkpoint(self.run_dir, self.step, weights, state, meta,
                                              keep_last=self.cfg.keep_last, is_best=is_best,
                                              tokenizer=self.plan.tokenizer_file)
        self.best_val = parallel.broadcast_object(self.best_val, self.env)
        parallel.barrier(self.env)
        return path

