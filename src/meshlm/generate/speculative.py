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
    rounds.py    Rounds: prefill with calibration, plain step, draft-verify round, accept
    batch.py     Batch: the cache, padding mask and pending tokens the steps advance

Here: `SpeculativeDecoder`, one step at a time as the planner says (what `stream` runs, and what a
speculative cohort of continuous batching runs at every token boundary, meshlm.serve.cohorts), and
`stream`, which yields the same tokens as meshlm.generate.stream.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from meshlm.errors import ConfigError
from meshlm.generate.batch import Batch
from meshlm.generate.planner import PRIOR_TOKENS, Planner, Speculation
from meshlm.generate.rounds import Rounds
from meshlm.generate.sampling import Sampling, left_pad
from meshlm.generate.timing import Timed
from meshlm.model import MeshLM

__all__ = ["AUTO", "Speculation", "SpeculationStats", "SpeculativeDecoder", "Step", "stream"]

AUTO = Speculation()  # "auto": the planner picks (K_d, γ), or plain steps where nothing pays


@dataclass(frozen=True)
class Step:
    """What one decoding step emitted: row r's tokens[r][:counts[r]]; for a round, the drafted and
    accepted tokens of the rows still generating."""

    tokens: list[list[int]]
    counts: list[int]
    plain: bool = True  # a plain step, not a draft-verify round
    drafted: int = 0
    accepted: int = 0


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
                 generator: torch.Generator | None = None):
        spec.check(model, schedule)
        self.planner = Planner(spec, model.config.layout, schedule, s.max_new_tokens)
        self.timed = Timed(model, self.planner.costs)
        self.plain = Rounds(model, schedule, s, generator)  # untimed
        self.rounds = replace(self.plain, stages=self.timed)
        self.context = model.config.context_length
        self.calibrated = False

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
        """Prefill prompts (B, T) with padding mask (B, T); the first batch calibrates."""
        depths = [] if self.calibrated else self.planner.calibrates
        batch, agreement, positions = self.rounds.prefill(ids, mask, depths, PRIOR_TOKENS)
        if not self.calibrated:
            self.planner.calibrate(agreement, positions)
            self.calibrated = True
        return batch

    def step(self, batch: Batch, keep: torch.Tensor, active: torch.Tensor) -> Step:
        """One plain step or one round for a batch whose row r may still emit keep[r] tokens (0 for
        rows done; `active` (B,) bool marks the others)."""
        choice = self.planner.next()
        gamma = 0 if choice is None else min(choice[1], int(keep.max()) - 1)
        if batch.cached + gamma + 1 > self.context:  # rollback holes took the room: squeeze out
            batch.compact()
            gamma = max(min(gamma, self.context - batch.cached - 1), 0)
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
        return Step(tokens.tolist(), counts.tolist(), False, drafted, int(accepted.sum()))

    def _plain_step(self, batch: Batch, keep: torch.Tensor) -> Step:
        if self.planner.plain_for_good:  # nothing pays: meshlm.generate's own step, no bookkeeping
            token = self.plain.plain_step(batch)
        else:
            with self.timed.overhead("plain-overhead", 1):
                token = self.rounds.plain_step(batch, keep)
        return Step([[t] for t in token.tolist()], [1] * len(batch))


@torch.no_grad()
def stream(model: MeshLM, prompts: list[list[int]], s: Sampling,
           speculate: Speculation = AUTO, eos_id: int = 0, pad_id: int = 1,
           loops: int | None = None, stats: SpeculationStats | None = None
           ) -> Iterator[torch.Tensor]:
    """Yield the (B,) next tokens step by step, exactly as meshlm.generate.stream would (greedy: the
    same tokens; sampling: the same distribution), computed by speculative rounds. Rows that reached
    EOS yield `pad_id`. `stats` (optional) receives acceptance, tokens/s and the chosen setting.
    `speculate` is typed (Speculation.parse turns "auto", "K_d" or "K_d:γ" into one)."""
    if not isinstance(speculate, Speculation):
        raise TypeError(f"speculate={speculate!r}: pass a Speculation (meshlm.generate.planner."
                        f"Speculation.parse({str(speculate)!r})); settings travel typed")
    schedule, stats = model.schedule(loops), stats if stats is not None else SpeculationStats()
    start, device = time.perf_counter(), next(model.parameters()).device
    generator = None if s.seed is None else torch.Generator(device).manual_seed(s.seed)
    decoder = SpeculativeDecoder(model, schedule, speculate, s, generator)
    stats.planner = decoder.planner
    ids, mask = left_pad(prompts, pad_id, device)
    context = model.config.context_length
    if ids.shape[1] + s.max_new_tokens > context:
        raise ConfigError(f"the prompt ({ids.shape[1]} tokens) plus max_new_tokens="
                          f"{s.max_new_tokens} exceeds context_length={context}; lower "
                          f"max_new_tokens to at most {context - ids.shape[1]} or shorten "
                          f"the prompt")
    batch = decoder.prefill(ids, mask)
    queues = [deque([t]) for t in batch.pending.tolist()]
    made, done = [1] * len(queues), [False] * len(queues)  # tokens generated per row; yielded EOS
    for _ in range(s.max_new_tokens):
        while not all(d or q for d, q in zip(done, queues)):  # some row still lacks its next token
            step = decoder.step(batch, *_budget(s, made, done))
            stats.record(step)
            for r, (row, count) in enumerate(zip(step.tokens, step.counts)):
                queues[r].extend(row[:count])
                made[r] += count
        tokens = [pad_id if done[r] else queues[r].popleft() for r in range(len(queues))]
        stats.tokens += sum(not d for d in done)
        done = [d or (s.stop_at_eos and t == eos_id) for d, t in zip(done, tokens)]
        stats.seconds = time.perf_counter() - start
        yield torch.tensor(tokens, device=device)
        if all(done):
            return


def _budget(s: Sampling, made: list[int], done: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) tokens each row may still emit (0 for rows done) and (B,) bool: the rows still going.
    Rows keep at most the positions they will need in the cache."""
    active = torch.tensor([not d and m < s.max_new_tokens for d, m in zip(done, made)])
    return torch.tensor([s.max_new_tokens - m for m in made]).clamp(min=0) * active, active
