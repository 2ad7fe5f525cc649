"""Per-step parameters of the loop, and per-loop LoRA (relaxed recursion, Bae et al. 2024, arXiv
2410.20672).

A shared core runs the same weights on every pass; per-step parameters are what make the passes
differ. `PerStep` holds one module per loop step up to a cap and gives step t the min(t, cap −
1)-th: a depth beyond the last trained step reuses the last one. MeSH's router pairs
(meshlm.model.memory) and the per-loop LoRA deltas below are both held this way.

Per-loop LoRA (`ModelConfig.loop_lora_rank` = r > 0): every targeted Linear W of a shared core gets
one low-rank delta per pass of that core,

    pass t:   y = W x + b + (α / r) · B_t A_t x   A_t (r, in), B_t (out, r), t' = min(t, passes − 1)

with `passes` = the loop cap (max_loops, default K) for a single-core spec, else that core's repeat
count. B_t starts at zero (meshlm.model.init), so the model starts as the base model exactly. Only
cores that run more than once get deltas; the prelude and coda run once per forward and have nothing
to relax.

How the pass index reaches the Linear: the model's loop (`MeshLM.advance`, the one loop every path
goes through: training, cached decoding, adaptive exit, self-speculative drafting and verifying)
calls `select_pass(core, t)` right before each core pass, which sets the pass on that core's
`LoopLoRALinear`s. Activation checkpointing recomputes a layer after the loop has moved on, so
`recompute_context` captures the passes at forward time and restores them during the recompute
(meshlm.train.parallel passes it to torch.utils.checkpoint as `context_fn`).

Targets are roles or module names (`targets_of`): "attention" and "mlp" name a layer's projections
in every backbone (OLMoE's experts are batched tensors, not Linears, so its "mlp" is empty);
anything else is matched as a name suffix inside a layer ("query_key_value", "mlp.down_proj").
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.backbones import BACKBONES
from meshlm.errors import ConfigError

ROLES = ("attention", "mlp")  # each layer class names its Linears per role (Layer.roles)


class PerStep(nn.ModuleList):
    """One module per loop step up to a cap; `at(t)` is step t's, the last one for every t beyond
    the cap."""

    def at(self, step: int) -> nn.Module:
        return self[min(step, len(self) - 1)]


class LowRank(nn.Module):
    """x -> scale · B A x: A (rank, in), B (out, rank). Initialised by meshlm.model.init (B = 0)."""

    def __init__(self, d_in: int, d_out: int, rank: int, scale: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, d_in))
        self.B = nn.Parameter(torch.empty(d_out, rank))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B) * self.scale


class LoopLoRALinear(nn.Linear):
    """A core Linear with one `LowRank` delta per pass; `pass_index` (set by `select_pass`) picks
    it. The base weight and bias keep their names, so a checkpoint without deltas loads into it (the
    deltas stay at zero)."""

    def __init__(self, base: nn.Linear, passes: int, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device="meta")
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: no copy, no new init
        device = base.weight.device
        self.loop_lora = PerStep(LowRank(base.in_features, base.out_features, rank,
                                         alpha / rank).to(device)
                                 for _ in range(passes))
        self.pass_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.loop_lora.at(self.pass_index)(x)


def targets_of(layer: nn.Module, targets: str) -> list[str]:
    """Names (inside `layer`) of the plain Linears that `targets` picks: comma-separated roles or
    name suffixes."""
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    roles = getattr(type(layer), "roles", {})
    suffixes = tuple(s for t in wanted for s in roles.get(t, (t,)))
    return [name for name, m in layer.named_modules()
            if type(m) is nn.Linear and name.endswith(suffixes)]


def example_target(backbone: str) -> str:
    """A layer-local Linear name of the backbone's attention, for messages."""
    return BACKBONES[backbone].layer.roles["attention"][0]


def passes_per_core(layout, loop_cap: int) -> list[int]:
    """How many passes of each core have their own delta: the loop cap for one core, else its
    repeats."""
    return [loop_cap] if len(layout.cores) == 1 else list(layout.repeats)


def attach(cores: nn.ModuleList, cfg) -> None:
    """Replace the targeted Linears of every core that runs more than once by LoopLoRALinears (in
    place)."""
    alpha = cfg.loop_lora_alpha if cfg.loop_lora_alpha is not None else float(cfg.loop_lora_rank)
    found = 0
    for core, passes in zip(cores, passes_per_core(cfg.layout, cfg.loop_cap)):
        if passes < 2:
            continue
        for layer in core:
            for name in targets_of(layer, cfg.loop_lora_targets):
                parent, _, attr = name.rpartition(".")
                owner = layer.get_submodule(parent) if parent else layer
                setattr(owner, attr,
                        LoopLoRALinear(getattr(owner, attr), passes, cfg.loop_lora_rank, alpha))
                found += 1
    if not found:
        raise ConfigError(f"loop_lora_targets={cfg.loop_lora_targets!r} matches no Linear of the "
                          f"shared core (backbone {cfg.backbone}); use roles attention, mlp or "
                          f"layer-local names such as {example_target(cfg.backbone)!r}")


def select_pass(core: nn.Module, index: int) -> None:
    """The pass `core` runs next: each of its LoopLoRALinears applies delta min(index, passes −
    1)."""
    for m in core.modules():
        if isinstance(m, LoopLoRALinear):
            m.pass_index = index


def recompute_context(layer: nn.Module):
    """For torch.utils.checkpoint's `context_fn`: (nothing at forward, the passes of now during the
    recompute)."""
    saved = [(m, m.pass_index) for m in layer.modules() if isinstance(m, LoopLoRALinear)]

    @contextlib.contextmanager
    def restore():
        now = [(m, m.pass_index) for m, _ in saved]
        for m, index in saved:
            m.pass_index = index
        try:
            yield
        finally:
            for m, index in now:
                m.pass_index = index

    return contextlib.nullcontext(), restore()


def init_low_rank(module: LowRank) -> None:
    """A as PEFT's LoRA (Kaiming-uniform, a = √5), B = 0: the delta starts at exactly zero."""
    nn.init.kaiming_uniform_(module.A, a=math.sqrt(5))
    nn.init.zeros_(module.B)
