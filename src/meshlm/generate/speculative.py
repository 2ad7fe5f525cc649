"""Lossless self-speculative decoding: the first K_d loop passes draft, the full K passes verify.

A looped model's shallow loops are a free draft model: prelude → K_d loops → coda → head proposes
tokens, and for a drafted token the prelude and the first K_d loops compute exactly what the full
model computes (same weights, same inputs, the same cached keys/values at those depths). A round
drafts γ tokens, verifies them in one forward at full depth, keeps the longest accepted prefix and
one more token from the full model, and rolls the rest back; docs/design.md ("Self-speculative
decoding") says why this is exact for every scheme, and the sampling filters are applied to the
draft's and the full model's distributions alike, so the output distribution is the full model's.

The pieces, each in its own module, wrapped around the model rather than woven into it:

    planner.py   Speculation (the setting), Costs, Planner: which (K_d, γ) to run, or a plain step
    timing.py    Timed: the model's stages, each timed into the planner's Costs while it works
    rounds.py    Rounds: prefill with calibration, draft-verify round, accept (plain steps:
                 meshlm.generate.decoder.PlainDecoder)
    batch.py     Batch: the cache, padding mask and pending tokens the steps advance

Here: `SpeculativeDecoder`, one step at a time as the planner says (what `stream` runs, and what a
speculative cohort of continuous batching runs at every token boundary, meshlm.serve.cohorts), and
`stream`, which yields the same tokens as meshlm.generate.stream.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from meshlm.generate.batch import Batch
from meshlm.generate.decoder import PlainDecoder, Step, check_room, decode
from meshlm.generate.planner import PRIOR_TOKENS, Planner, Speculation
from meshlm.generate.rounds import Rounds
from meshlm.generate.sampling import Sampling, left_pad, next_token
from meshlm.generate.steps import CompiledStages
from meshlm.generate.timing import Timed
from meshlm.model import MeshLM

__all__ = ["AUTO", "Speculation", "SpeculationStats", "SpeculativeDecoder", "Step", "stream"]

AUTO = Speculation()  # "auto": the planner picks (K_d, γ), or plain steps where nothing pays


@dataclass
class SpeculationStats:
    """Filled in while decoding; `summary()` is the line `meshlm generate --speculate` prints."""

    drafted: int = 0  # drafted tokens verified (rows still generating)
    accepted: int = 0  # of which accepted
    rounds: int = 0
    plain_steps: int = 0
    tokens: int = 0  # new tokens produced, all rows
    seconds: float = 0.0
    planner: Planner | None = field(default=None, repr=False)  # its costs, acceptance, setting

    def record(self, step: Step) -> None:
        self.plain_steps += step.plain
        self.rounds += not step.plain
        self.drafted += step.drafted
        self.accepted += step.accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def setting(self) -> str:
        """What the planner settled on: "K_d=2 γ=4", or "plain"."""
        return "" if self.planner is None else self.planner.setting

    @property
    def acceptance_by_depth(self) -> dict[int, float]:
        return {} if self.planner is None else self.planner.acceptance_by_depth

    @property
    def predicted_speedup(self) -> float | None:
        return None if self.planner is None else self.planner.predicted_speedup

    def summary(self) -> str:
        alphas = ", ".join(f"K_d={k}: {a:.0%}" for k, a in sorted(self.acceptance_by_depth.items()))
        return (f"speculate: {self.setting or 'plain'}; acceptance {self.acceptance:.1%} "
                f"({self.accepted}/{self.drafted} drafted, {self.rounds} rounds, "
                f"{self.plain_steps} plain steps); "
                f"{self.tokens / max(self.seconds, 1e-9):.1f} tokens/s"
                + (f"; per-depth α {alphas}" if alphas else ""))


class SpeculativeDecoder:
    """Decodes batches of one model, depth and sampling rule by speculation, one step at a time as
    its planner says. Every stage is timed for the planner while it does real work, until the
    planner decodes plainly for good (then untimed, exactly meshlm.generate's step)."""

    def __init__(self, model: MeshLM, schedule: tuple[int, ...], spec: Speculation, s: Sampling,
                 generator: torch.Generator | None = None, compiled: bool = False):
        spec.check(model, schedule)
        self.planner = Planner(spec, model.config.layout, schedule, s.max_new_tokens)
        self.compiled = compiled  # rounds and plain steps through compiled stages; prefill eager
        self.timed = Timed(CompiledStages(model) if compiled else model, self.planner.costs)
        self.rounds = Rounds(model, schedule, s, generator, self.timed)
        self.prefilling = Rounds(model, schedule, s, generator, Timed(model, self.planner.costs)) \
            if compiled else self.rounds

        def choose(logits: torch.Tensor) -> torch.Tensor:
            return next_token(logits, s, generator)
        self.plain = PlainDecoder(model, schedule, choose, compiled=compiled)  # untimed
        self.timed_plain = PlainDecoder(self.timed, schedule, choose, pad_done=True)
        self.context = model.config.context_length
        self.calibrated = False

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
        """Prefill prompts (B, T) with padding mask (B, T); the first batch calibrates."""
        depths = [] if self.calibrated else self.planner.calibrates
        batch, agreement, positions = self.prefilling.prefill(ids, mask, depths, PRIOR_TOKENS)
        if not self.calibrated:
            self.planner.calibrate(agreement, positions)
            self.calibrated = True
        return batch

    @torch.no_grad()
    def step(self, batch: Batch, keep: torch.Tensor, active: torch.Tensor) -> Step:
        """One plain step or one round for a batch whose row r may still emit keep[r] tokens (0 for
        rows done; `active` (B,) bool marks the others)."""
        choice = self.planner.next()
        gamma = 0 if choice is None else min(choice[1], int(keep.max()) - 1)
        if batch.cached + gamma + 1 > self.context:  # rollback holes took the room: squeeze out
            batch.compact()
            gamma = max(min(gamma, self.context - batch.cached - 1), 0)
        if self.compiled:  # the cache grows outside the compiled stages (PlainDecoder's reason)
            batch.kv.reserve(gamma + 2)
        keep = keep.to(batch.mask.device)
        if gamma < 1:
            return self._plain_step(batch, keep)
        k_d = choice[0]
        with self.timed.overhead("round-overhead", gamma + 1) as span:
            final_read = self.planner.final_read[k_d]
            tokens, counts = self.rounds.round(batch, k_d, gamma, final_read, keep)
        accepted = (counts - 1).cpu()[active]
        self.planner.observe(k_d, accepted, gamma, span.seconds)
        drafted = gamma * int(active.sum())
        return Step(tokens.tolist(), counts.tolist(), False, drafted, int(accepted.sum()),
                    int(counts.sum()) * len(self.rounds.schedule))

    def _plain_step(self, batch: Batch, keep: torch.Tensor) -> Step:
        if self.planner.plain_for_good:  # nothing pays: meshlm.generate's own step, no bookkeeping
            return self.plain.step(batch)
        with self.timed.overhead("plain-overhead", 1):
            return self.timed_plain.step(batch, keep)


@torch.no_grad()
def stream(model: MeshLM, prompts: list[list[int]], s: Sampling,
           speculate: Speculation = AUTO, eos_id: int = 0, pad_id: int = 1,
           loops: int | None = None, stats: SpeculationStats | None = None,
           compiled: bool = False) -> Iterator[torch.Tensor]:
    """Yield the (B,) next tokens step by step, exactly as meshlm.generate.stream would (greedy: the
    same tokens; sampling: the same distribution), computed by speculative rounds. Rows that reached
    EOS yield `pad_id`. `stats` (optional) receives acceptance, tokens/s and the chosen setting.
    `speculate` is typed (Speculation.parse turns "auto", "K_d" or "K_d:γ" into one).
    `compiled`: the rounds and plain steps run through the model's compiled stages
    (meshlm.generate.steps.CompiledStages; `meshlm generate --compile --speculate`)."""
    if not isinstance(speculate, Speculation):
        raise TypeError(f"speculate={speculate!r}: pass a Speculation (meshlm.generate.planner."
                        f"Speculation.parse({str(speculate)!r})); settings travel typed")
    schedule, stats = model.schedule(loops), stats if stats is not None else SpeculationStats()
    device = next(model.parameters()).device
    generator = None if s.seed is None else torch.Generator(device).manual_seed(s.seed)
    decoder = SpeculativeDecoder(model, schedule, speculate, s, generator, compiled)
    stats.planner = decoder.planner
    check_room(model, prompts, s)
    batch = decoder.prefill(*left_pad(prompts, pad_id, device))
    yield from decode(decoder, batch, s, eos_id, pad_id, stats)
