"""The one way tokens are produced: a Decoder prefills a Batch and steps it; `decode` is the loop.

    Decoder             prefill(ids, mask) -> Batch, each row's first token pending
                        step(batch, keep, active) -> Step, what every row emitted
    PlainDecoder        the full depth, or per-token exit (an ExitRule): one token per row a step;
                        a step (a prefill's forward too) resumable a few loop steps at a time, so
                        continuous batching spreads a deep request's step over boundaries
    SpeculativeDecoder  (meshlm.generate.speculative) a plain step or a draft-verify round
    CompiledDecoder     (meshlm.generate.compiled) a plain step (full depth or per-token exit)
                        compiled once over a static KV cache (`meshlm generate --compile`)
    decode              the loop over a decoder: meshlm.generate.stream and speculative.stream

Each row's token is the decoder's `choose(logits)`: one rule and generator for the batch
(meshlm.generate), or each row its own (meshlm.serve's requests). Continuous batching joins and
drops rows of the Batch itself (Batch.join, Batch.keep).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from meshlm.errors import ConfigError
from meshlm.generate import steps
from meshlm.generate.batch import Batch
from meshlm.generate.sampling import Sampling, padding_if_any
from meshlm.model import MeshLM
from meshlm.model.exit import ExitRule
from meshlm.model.kv_cache import KVCache
from meshlm.model.lm import LMOutput
from meshlm.model.run import LoopRun

Choose = Callable[[torch.Tensor], torch.Tensor]  # (B, V) last-position logits -> (B,) tokens


@dataclass(frozen=True)
class Step:
    """What one decoding step emitted: row r's tokens[r][:counts[r]]; for a round, the drafted and
    accepted tokens of the rows still generating; `loop_steps`, the core passes its tokens ran."""

    tokens: list[list[int]]
    counts: list[int]
    plain: bool = True  # a plain step, not a draft-verify round
    drafted: int = 0
    accepted: int = 0
    loop_steps: int = 0


@runtime_checkable
class Decoder(Protocol):
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
        """Prompts (B, T), left-padded with padding mask (B, T) -> their batch, first tokens
        pending."""

    def step(self, batch: Batch, keep: torch.Tensor, active: torch.Tensor) -> Step:
        """Feed the pending tokens; row r may still emit keep[r] tokens; `active` (B,) bool marks
        the rows still generating."""


def check_room(model: MeshLM, prompts: list[list[int]], s: Sampling) -> None:
    """ConfigError unless the longest prompt plus max_new_tokens fits the context, with advice that
    works."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token; pass a non-empty prompt")
    longest, context = max(len(p) for p in prompts), model.config.context_length
    if longest >= context:
        raise ConfigError(f"the prompt is {longest} tokens but context_length={context} leaves "
                          f"room for at most {context - 1} prompt tokens plus one new one; shorten "
                          "the prompt")
    if longest + s.max_new_tokens > context:
        raise ConfigError(f"the prompt ({longest} tokens) plus max_new_tokens={s.max_new_tokens} "
                          f"exceeds context_length={context}; pass -n {context - longest} or less, "
                          "or shorten the prompt")


@dataclass(eq=False)
class Forward:
    """A forward of new positions after a cache, under way (MeshLM.start → advance → readout)."""

    run: LoopRun
    mask: torch.Tensor  # (B, cached + T) padding mask over the cache and the new positions

    @property
    def kv(self) -> KVCache:
        return self.run.cache


class PlainDecoder:
    """Plain decoding of one model at one depth schedule, at the full depth or with per-token
    `exit`. `model`: a MeshLM, or its timed stages (meshlm.generate.timing.Timed). `observe(out,
    mask)`, if given, sees every forward's LMOutput with the padding mask of its new positions.
    `pad_done`: a step turns the new positions of rows done (keep 0) into padding, which compaction
    frees (speculation, whose rollback holes need a mask anyway); else they stay real, so that a
    batch without padding attends with no mask. `compiled`: every whole step (not sliced) without
    exit or `observe` runs through meshlm.generate.steps' compiled step with symbolic shapes, over
    the same growing cache, so rows may join and leave between steps; prefill stays eager. (Exit
    steps stay eager here: compiled, the exit tracker's bookkeeping specialised ~60 pieces of a
    tiny model's step while rows came and went, each compiled during serving, for a step 1.00-1.19x
    eager exit's at d = 768 over the static cache: docs/quantize.md.)"""

    def __init__(self, model, schedule: tuple[int, ...], choose: Choose,
                 exit: ExitRule | None = None, observe=None, pad_done: bool = False,
                 compiled: bool = False):
        self.model, self.schedule, self.choose = model, schedule, choose
        self.exit, self.observe, self.pad_done = exit, observe, pad_done
        self.compiled = compiled and exit is None and observe is None
        self.flight: Forward | None = None  # a sliced step under way

    @property
    def busy(self) -> bool:
        """A sliced step is under way: rows may not join or leave until it ends."""
        return self.flight is not None

    @torch.no_grad()
    def start(self, tokens: torch.Tensor, mask: torch.Tensor, kv: KVCache | None = None
              ) -> Forward:
        """A forward of tokens (B, T) after `kv` (a new cache: None), standing at loop step 0."""
        kv = KVCache() if kv is None else kv
        return Forward(self.model.start(tokens, padding_if_any(mask), kv, self.exit), mask)

    @torch.no_grad()
    def finish(self, forward: Forward, loop_slice: int | None = None) -> torch.Tensor | None:
        """Run `loop_slice` more loop steps of `forward` (None: all left); once it has run them
        all, the (B, V) logits of its last position, else None."""
        run, n = forward.run, len(self.schedule)
        self.model.advance(run, self.schedule, None if loop_slice is None else
                           min(run.step + loop_slice, n))
        if run.step < n:
            return None
        logits = self.model.readout(run, self.schedule)
        if self.observe is not None:
            self.observe(LMOutput(logits, exit_loops=run.track.loops,
                                  exit_probes=run.track.probes),
                         forward.mask[:, -logits.shape[1]:])
        return logits[:, -1]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
        forward = self.start(ids, mask)
        return Batch(forward.kv, mask, self.choose(self.finish(forward)))

    def step(self, batch: Batch, keep: torch.Tensor | None = None,
             active: torch.Tensor | None = None, loop_slice: int | None = None) -> Step | None:
        """Feed every row's pending token; its next one (rows done, keep 0: see `pad_done`). With
        `loop_slice`, None until the call that runs the step's last loop step."""
        if self.flight is None:
            mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], 1)
            if self.compiled and (loop_slice is None or loop_slice >= len(self.schedule)):
                # one graph: the cache grows outside it (two columns ahead, so the step's view of
                # a buffer is never the whole buffer), a mask even without padding
                batch.kv.reserve(2)
                with torch.no_grad():
                    logits, loops = steps.compiled(dynamic=True)(
                        self.model, self.schedule, batch.pending[:, None], mask, batch.kv,
                        self.exit)
                return self._next(batch, keep, mask, logits, loops)
            self.flight = self.start(batch.pending[:, None], mask, batch.kv)
        forward = self.flight
        logits = self.finish(forward, loop_slice)
        if logits is None:
            return None
        self.flight = None
        return self._next(batch, keep, forward.mask, logits, forward.run.track.loops)

    def _next(self, batch: Batch, keep: torch.Tensor | None, mask: torch.Tensor,
              logits: torch.Tensor, loops: torch.Tensor | None) -> Step:
        """The step's tokens chosen from its (B, V) logits (`loops`: the loop steps each position
        ran, None for all); the batch advanced past it."""
        tokens = self.choose(logits)
        if keep is None or not self.pad_done:  # every fed position stays real: the step's mask
            batch.mask, batch.pending = mask, tokens
        else:
            batch.settle(keep.clamp(max=1), tokens)
        ran = len(batch) * len(self.schedule) if loops is None else int(loops.sum())
        return Step(batch.pending[:, None].tolist(), [1] * len(batch), loop_steps=ran)


def decode(decoder: Decoder, batch: Batch, s: Sampling, eos_id: int = 0, pad_id: int = 1,
           stats=None) -> Iterator[torch.Tensor]:
    """Yield the (B,) next tokens of the prefilled `batch` step by step; rows that reached EOS
    yield `pad_id` and feed it. `stats` (a meshlm.generate.speculative.SpeculationStats) records
    every step, the tokens made and the seconds."""
    start, device = time.perf_counter(), batch.mask.device
    queues = [deque([t]) for t in batch.pending.tolist()]
    made, done = [1] * len(queues), [False] * len(queues)  # tokens generated per row; yielded EOS
    fed_pad = list(done)  # rows that yielded pad last: they feed it
    for _ in range(s.max_new_tokens):
        while not all(d or q for d, q in zip(done, queues)):  # some row still lacks its next token
            if any(fed_pad):
                batch.pending = batch.pending.masked_fill(torch.tensor(fed_pad, device=device),
                                                          pad_id)
            step = decoder.step(batch, *_budget(s, made, done))
            if stats is not None:
                stats.record(step)
            for r, (row, count) in enumerate(zip(step.tokens, step.counts)):
                queues[r].extend(row[:count])
                made[r] += count
        tokens = [pad_id if done[r] else queues[r].popleft() for r in range(len(queues))]
        fed_pad = list(done)
        done = [d or (s.stop_at_eos and t == eos_id) for d, t in zip(done, tokens)]
        if stats is not None:
            stats.tokens += sum(not d for d in fed_pad)
            stats.seconds = time.perf_counter() - start
        yield torch.tensor(tokens, device=device)
        if all(done):
            return


def _budget(s: Sampling, made: list[int], done: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) tokens each row may still emit (0 for rows done) and (B,) bool: the rows still going.
    Rows keep at most the positions they will need in the cache."""
    active = torch.tensor([not d and m < s.max_new_tokens for d, m in zip(done, made)])
    return torch.tensor([s.max_new_tokens - m for m in made]).clamp(min=0) * active, active
