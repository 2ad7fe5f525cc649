"""A forward pass in progress: `LoopRun`, the state `MeshLM.enter` → `advance` → `readout` share,
and `Stages`, every intermediate state a run keeps for probes (`return_states=True`).

Self-speculative decoding (meshlm.generate.rounds) joins consecutive runs over the same rows into
one (`LoopRun.join`: the drafted tokens verified in one forward) and stacks runs over the same
positions (`LoopRun.stack`: several draft states read out in one coda pass).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from meshlm.model.exit import ExitTracker, NoExit
from meshlm.model.kv_cache import LayerCache
from meshlm.model.layers import Rope, attention_mask_from_padding
from meshlm.model.reveal import Revealing
from meshlm.model.schemes import LoopContext, concat_contexts, map_contexts


@dataclass
class Stages:
    """Every intermediate state of one forward pass, each (B, T, d); for probes and analysis."""

    embeddings: torch.Tensor  # e (√d-scaled if configured)
    prelude: torch.Tensor  # p = f_pre(e)
    states: list[torch.Tensor] = field(default_factory=list)  # h⁰ … h^K
    core_outputs: list[torch.Tensor] = field(default_factory=list)  # f_core(h^t), t = 0 … K−1
    coda: torch.Tensor | None = None  # f_coda(h^K), before the final LayerNorm
    # MeSH (write, read)
    routing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    router_logits: list[torch.Tensor] = field(default_factory=list)  # MoE: (B·T, E) per layer call


@dataclass
class LoopRun:
    """A forward pass in progress (`MeshLM.enter` → `advance` → `readout`): the state after `step`
    loop passes over T tokens that follow `past` cached ones, the scheme's per-token context, and
    what every remaining layer needs (rotary tables, mask, cache). The model joins and splits runs
    (`join`, `stack`, `last`, `with_state`; not under exit, whose tracker follows one run's tokens);
    code outside meshlm.model never builds one by hand."""

    h: torch.Tensor  # (B, T, d) the loop state h^step
    ctx: LoopContext  # per-token scheme values (anchors, MeSH's written values and coefficients)
    rope: Rope
    mask: torch.Tensor | None  # (B, 1, T, T_past + T) or None
    cache: LayerCache | None
    step: int = 0  # loop passes done
    routed: list[torch.Tensor] = field(default_factory=list)  # MoE router logits of every layer
    # call, in order
    stages: Stages | None = None  # only with return_states=True
    # who is still looping (meshlm.model.exit; NO_EXIT: all), given by MeshLM.enter and start (no
    # default instance here: torch.compile cannot trace a dataclass default that is an object)
    track: ExitTracker | NoExit | None = None
    past: int = 0  # tokens cached before this run's: its mask covers past + T keys
    # training's delayed reveal (meshlm.model.reveal): both inputs' contexts, or None
    revealing: Revealing | None = None

    def attention_mask(self) -> torch.Tensor:
        """The (B or 1, 1, T, past + T) boolean mask; without one (no padding) the run is causal."""
        if self.mask is not None:
            return self.mask
        ones = torch.ones(1, self.past + self.h.shape[1], dtype=torch.bool, device=self.h.device)
        return attention_mask_from_padding(ones, self.past)

    def with_state(self, h: torch.Tensor) -> LoopRun:
        """The same run at loop state h (B, T, d): what a readout of another state reads (a
        speculative draft's early exit). This run is unchanged."""
        return replace(self, h=h)

    def last(self, n: int) -> LoopRun:
        """The run of its last n tokens, the earlier ones becoming its past (same cache, step)."""
        t = self.h.shape[1]
        if n >= t:
            return self
        return replace(self, h=self.h[:, -n:], ctx=map_contexts(lambda x: x[0][:, -n:], [self.ctx]),
                       rope=tuple(r[:, -n:] for r in self.rope),
                       mask=self.attention_mask()[:, :, -n:], past=self.past + t - n,
                       routed=[], stages=None)

    @classmethod
    def join(cls, runs: list[LoopRun]) -> LoopRun:
        """Consecutive runs over the same rows (each one's tokens right after the previous one's, at
        one loop step, over one cache) as one run over all their tokens. Resuming it equals having
        run the tokens together from the start: every scheme's context is per token."""
        if len(runs) == 1:
            return runs[0]
        for a, b in zip(runs, runs[1:]):
            if b.past != a.past + a.h.shape[1] or b.step != a.step or b.cache is not a.cache:
                raise ValueError("LoopRun.join takes consecutive runs at one step over one cache")
        width = runs[-1].past + runs[-1].h.shape[1]  # keys of the last token
        masks = [_widened(r.attention_mask(), width) for r in runs]  # (B or 1, 1, T_i, width)
        rope = tuple(_cat_rows(list(parts), 1) for parts in zip(*(r.rope for r in runs)))
        return replace(runs[0], h=torch.cat([r.h for r in runs], 1), rope=rope,
                       ctx=concat_contexts([r.ctx for r in runs]), mask=_cat_rows(masks, 2),
                       routed=[], stages=None)

    @classmethod
    def stack(cls, runs: list[LoopRun], cache: LayerCache | None) -> LoopRun:
        """Runs over the same positions (equal past and T) as one run over all their rows, in order,
        reading and writing `cache`, whose rows must follow that order."""
        first = runs[0]
        if any(r.past != first.past or r.h.shape[1] != first.h.shape[1] for r in runs):
            raise ValueError("LoopRun.stack takes runs over the same positions (equal past and T)")
        shared = all(r.rope[0] is first.rope[0] and r.rope[0].shape[0] == 1 for r in runs)
        rope = first.rope if shared else \
            tuple(torch.cat(_by_row(list(parts), runs)) for parts in zip(*(r.rope for r in runs)))
        masks = None if all(r.mask is None for r in runs) else \
            torch.cat(_by_row([r.attention_mask() for r in runs], runs))
        return replace(first, h=torch.cat([r.h for r in runs]), rope=rope, mask=masks, cache=cache,
                       ctx=concat_contexts([r.ctx for r in runs], 0), routed=[], stages=None)


def _widened(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(…, S) boolean mask -> (…, width): the extra keys (later tokens) are not attended to."""
    return torch.cat([mask, mask.new_zeros(*mask.shape[:-1], width - mask.shape[-1])], -1)


def _cat_rows(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate along `dim` tensors whose batch dimension is B or a broadcast 1."""
    rows = max(p.shape[0] for p in parts)
    return torch.cat([p.expand(rows, *p.shape[1:]) for p in parts], dim)


def _by_row(parts: list[torch.Tensor], runs: list[LoopRun]) -> list[torch.Tensor]:
    """Each run's tensor with its batch dimension expanded to the run's rows."""
    return [p.expand(r.h.shape[0], *p.shape[1:]) for p, r in zip(parts, runs)]
