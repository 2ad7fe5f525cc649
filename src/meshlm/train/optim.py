"""AdamW with the paper's weight-decay split and the cosine learning-rate schedule
(docs/training.md).

Weight decay applies to every matrix (ndim >= 2: layer weights, embeddings, MeSH routers, the
dynamic-mix projection) and to nothing else (biases, LayerNorm weights/biases, static-mix α). The
schedule is a pure function of the step, so a resumed run recomputes it exactly:

    lr(s) = peak · (s+1)/W                                     s < W   (W = ceil(warmup · steps))
    lr(s) = peak · (r + (1−r) · ½(1 + cos(π · (s−W)/(S−1−W))))  s >= W  (r = min_lr_ratio)

(linear warmup; the last step gets r · peak)
"""
from __future__ import annotations

import math

import torch
from torch import nn

from meshlm.train.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # the fused kernel exists for CPU and CUDA; on CPU it is ~8x faster than the default for-loop
    # implementation (12 vs 90 ms per step for the default model) and just as deterministic
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=tuple(cfg.betas),
                             eps=cfg.eps, fused=device.type in ("cpu", "cuda"))


class CosineSchedule:
    """LR multiplier per step. A plain object (not a lambda) so LambdaLR.state_dict() can record
    it."""

    def __init__(self, total_steps: int, warmup: float, min_ratio: float):
        self.total_steps = total_steps
        self.warmup_steps = math.ceil(warmup * total_steps)
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    schedule = CosineSchedule(total_steps, cfg.warmup, cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def retarget(scheduler, cfg: TrainConfig, total_steps: int) -> None:
    """After loading a scheduler's state: keep its step count, take peak LR and shape from `cfg`.

    With an unchanged config this reproduces the saved values exactly (base · multiplier(step), as
    LambdaLR computes them); with a changed one (e.g. more steps) the run continues on the new
    schedule.
    """
    schedule = CosineSchedule(total_steps, cfg.warmup, cfg.min_lr_ratio)
    groups = scheduler.optimizer.param_groups
    scheduler.lr_lambdas = [schedule] * len(groups)
    scheduler.base_lrs = [cfg.lr] * len(groups)
    for group in groups:
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * schedule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]
