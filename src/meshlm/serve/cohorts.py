"""Running batches of continuous batching: the rows that decode together, joined and left at token
boundaries.

A cohort holds the requests that share one compute setting (`loops`, `exit`, `speculate`): their
cache slots line up, so one forward serves them all. Its state is a meshlm.generate.Batch, the
one that self-speculation advances too: the looped KV cache, the (B, W) padding mask over it and
each row's pending token (sampled, not yet fed):

    join    prefill the prompts admitted at this boundary as one left-padded batch in a cache of
            their own (exactly what `meshlm.generate` does with several prompts), then stack their
            rows under the batch's, right-aligned (KVCache.stack): the shorter side is left-padded,
            mask 0, which every query ignores and default positions skip. A plain cohort's
            newcomers may prefill a chunk of columns per boundary instead (`Prefill`), so a long
            prompt does not stall the running rows for the length of its whole prefill
    step    feed every row's pending token in one forward; each row samples its next token with its
            own settings and random generator
    leave   drop finished rows and the leading columns no row still needs (KVCache.select, one
            copy of what stays), so the cache holds the live requests only: B rows × the longest
            live sequence

Under `exit` each token stops looping once it has converged; the forward computes only the
still-active rows' core passes (meshlm.model.exit gathers them) and copies exited rows' keys/values
forward, so a row decodes as it would alone. A speculative cohort runs meshlm.generate.speculative's
decoder over the same rows: each step is a plain step or a draft-verify round, as its planner says.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from meshlm import machine
from meshlm.generate import (
    Batch,
    PlainDecoder,
    Sampling,
    Speculation,
    SpeculationStats,
    SpeculativeDecoder,
    Step,
    left_pad,
    next_token,
)
from meshlm.model import MeshLM
from meshlm.model.exit import ExitRule
from meshlm.serve.requests import Request


def pick(logits: torch.Tensor, requests: list, failed: dict | None = None) -> torch.Tensor:
    """(B, V) last-position logits -> (B,) next tokens, each row with its request's sampling and
    generator (greedy rows: the argmax, as meshlm.generate; sampled rows one by one, so a seed's
    draws are its own). A row whose draw fails (e.g. its logits hold inf/nan) raises, or, given
    `failed`, is recorded there (row -> exception) with its argmax as a placeholder token, so that
    the other rows go on."""
    tokens = logits.argmax(-1)
    for row, request in enumerate(requests):
        if request.sampling.temperature > 0:
            try:
                tokens[row] = next_token(logits[row:row + 1], request.sampling,
                                         request.generator)[0]
            except RuntimeError as err:
                if failed is None:
                    raise
                failed[row] = err
    return tokens


@dataclass(eq=False)  # one group is itself: tensors have no truth value to compare by
class Prefill:
    """Newcomers' prompts prefilled in one cache, `chunk` columns at a time: each chunk is one
    cached forward over the next columns of the left-padded prompts, as speculation's verify feeds
    several tokens after a cache, so the result is the whole prompt's prefill to floating-point
    rounding. The last chunk samples each one's first token. A chunk's forward may itself run
    `loop_slice` loop steps per call (a deep request's prefill, spread over boundaries)."""

    requests: list
    ids: torch.Tensor  # (N, T) left-padded prompts
    mask: torch.Tensor  # (N, T) 1 = real token
    kv: object = None  # the prompts' KV cache, from the first chunk on
    done: int = 0  # columns prefilled so far
    flight: tuple | None = None  # (the chunk's Forward under way, its end column) while sliced

    @classmethod
    def of(cls, requests: list, pad_id: int, device: torch.device) -> Prefill:
        """The requests' prompts, left-padded, with nothing prefilled yet."""
        return cls(requests, *left_pad([r.prompt for r in requests], pad_id, device))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def remaining(self) -> int:
        return self.ids.shape[1] - self.done

    @torch.no_grad()
    def advance(self, model: MeshLM, loops: int | None, exit: ExitRule | None,
                chunk: int | None = None, loop_slice: int | None = None) -> Batch | None:
        """Prefill the next `chunk` columns (None: all that remain), `loop_slice` loop steps of
        their forward per call (None: all); after the last, the rows as a Batch with each one's
        first token pending, else None. (Prefill stays eager under `--compile`: compiled, it
        decoded no faster at 16 requests in flight and tripled the warm-up.)"""
        decoder = PlainDecoder(model, model.schedule(loops), lambda logits: pick(logits,
                                                                                 self.requests),
                               exit)
        if self.flight is None:
            end = self.ids.shape[1] if chunk is None else min(self.done + chunk, self.ids.shape[1])
            forward = decoder.start(self.ids[:, self.done:end], self.mask[:, :end], self.kv)
            self.flight, self.kv = (forward, end), forward.kv
        forward, end = self.flight
        logits = decoder.finish(forward, loop_slice)
        if logits is None:
            return None
        self.flight, self.done = None, end
        if self.remaining:
            return None
        return Batch(self.kv, self.mask, decoder.choose(logits))

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in order): requests stopped while their prompts prefilled."""
        index = torch.tensor(rows, dtype=torch.long, device=self.ids.device)
        self.requests = [self.requests[r] for r in rows]
        self.ids, self.mask = self.ids[index], self.mask[index]
        if self.done:
            self.kv.select(index)


class Cohort(ABC):
    """Rows of requests with one compute setting. Subclasses prefill (`admit`) and decode
    (`step`)."""

    def __init__(self, model: MeshLM, loops: int | None, pad_id: int):
        self.model, self.loops, self.pad_id = model, loops, pad_id
        self.schedule = model.schedule(loops)
        self.requests: list = []  # row r decodes requests[r]
        self.state: Batch | None = None  # the rows' cache, padding mask and pending tokens
        # core passes run per decoded token, summed over tokens (exit lowers it)
        self.loop_steps = 0
        self.tokens = 0  # tokens decoded by `step`
        self.failed: dict[int, Exception] = {}  # the last step's rows that failed alone (row ->
        # why): the batcher ends those requests with finish "error"; the other rows go on

    def __len__(self) -> int:
        return len(self.requests)

    def prompts(self, requests: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' prompts as (N, T) left-padded ids and their padding mask."""
        return left_pad([r.prompt for r in requests], self.pad_id,
                        self.model.embed_in.weight.device)

    def join(self, requests: list, batch: Batch) -> None:
        """Add prefilled requests' rows below the batch's (right-aligned)."""
        self.requests.extend(requests)
        if self.state is None:
            self.state = batch
        else:
            self.state.join(batch)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in order); forget the columns that are padding in all of them."""
        self.requests = [self.requests[r] for r in rows]
        self.state.keep(rows)

    @abstractmethod
    def admit(self, requests: list) -> list[int]:
        """Prefill the requests' prompts together and join their rows to the batch; returns each
        one's first token."""

    @property
    def busy(self) -> bool:
        """A sliced step is under way: rows may not join or leave until it ends."""
        return False

    @torch.no_grad()
    def step(self, loop_slice: int | None = None) -> list[list[int]] | None:
        """Decode once for every row; returns each row's new tokens (at least one). A cohort that
        can slice its step runs at most `loop_slice` loop steps per call and returns None until
        the step is done (None: the whole step at once)."""
        step = self._step(loop_slice)
        if step is None:
            return None
        self.tokens += sum(step.counts)
        self.loop_steps += step.loop_steps
        return [row[:count] for row, count in zip(step.tokens, step.counts)]

    @abstractmethod
    def _step(self, loop_slice: int | None) -> Step | None:
        """The decoder's step over the rows."""


class PlainCohort(Cohort):
    """Plain decoding at the full depth, or with per-token exit (`exit`, an ExitRule): a
    PlainDecoder whose rows each sample with their own request's settings and generator.
    `compiled`: its whole steps without exit run through the compiled step (PlainDecoder)."""

    def __init__(self, model: MeshLM, loops: int | None, exit: ExitRule | None, pad_id: int,
                 compiled: bool = False):
        super().__init__(model, loops, pad_id)
        self.exit = exit
        self.decoder = PlainDecoder(model, self.schedule,
                                    lambda logits: pick(logits, self.requests, self.failed), exit,
                                    compiled=compiled)

    @property
    def busy(self) -> bool:
        return self.decoder.busy

    def admit(self, requests: list) -> list[int]:
        """Prefill the prompts; join the batch with each one's first token pending (returned)."""
        batch = Prefill.of(requests, self.pad_id, self.model.embed_in.weight.device).advance(
            self.model, self.loops, self.exit)
        self.join(requests, batch)
        return batch.pending.tolist()

    def _step(self, loop_slice: int | None) -> Step | None:
        """Feed every row's pending token; each row's next token. With `loop_slice`, the forward
        runs that many loop steps per call and the tokens come with the call that ends it."""
        self.failed = {}
        return self.decoder.step(self.state, loop_slice=loop_slice)


def _prefilled(model: MeshLM, pad_id: int, loops: int | None, compiled: bool,
               prompts: list[list[int]]) -> PlainCohort:
    """A plain cohort of greedy throwaway requests, prefilled (eagerly), its steps compiled or
    not."""
    cohort = PlainCohort(model, loops, None, pad_id, compiled=compiled)
    cohort.requests = [Request(p, Sampling(max_new_tokens=16, temperature=0)) for p in prompts]
    cohort.state = Prefill.of(cohort.requests, pad_id, model.embed_in.weight.device).advance(
        model, loops, None)
    return cohort


def warm(model: MeshLM, pad_id: int, loops: int | None = None,
         rows: int = 16) -> tuple[float, float, float]:
    """Compile the plain step for what a server meets (several rows with padding and without, a
    few steps each, so that Dynamo specialises, then generalises the lengths; one row alone); then
    time `rows` rows' steps both ways as the kernels' probes time (machine.race: the best of 3
    calls of 3 steps, after one). Returns (seconds it took, ms a compiled step, ms an eager
    step)."""
    start = time.perf_counter()
    for prompts in ([[pad_id] * 3, [pad_id] * 2], [[pad_id] * 3] * 2, [[pad_id] * 3]):
        cohort = _prefilled(model, pad_id, loops, True, prompts)
        for _ in range(4):
            cohort.step()
    # 4 prompt positions and 4 calls of 3 steps: 16, what a context of any use holds
    cohorts = {name: _prefilled(model, pad_id, loops, name == "compiled", [[pad_id] * 4] * rows)
               for name in ("compiled", "eager")}
    raced = machine.race({name: lambda c=c: [c.step() for _ in range(3)]
                          for name, c in cohorts.items()}, reps=3, fastest="compiled")
    return time.perf_counter() - start, raced["compiled_ms"] / 3, raced["eager_ms"] / 3


class SpeculativeCohort(Cohort):
    """Lossless self-speculation over the batch (meshlm.generate.speculative): one decoder and
    planner for the cohort, its measured costs and acceptance shared by every request; the first
    request's prompt calibrates it. All rows share the sampling filters (greedy cohorts batch; a
    sampled request gets its own cohort, as its draws come from the decoder's one generator).
    `lead`: the first request, whose sampling and generator the cohort's decoder takes."""

    def __init__(self, model: MeshLM, loops: int | None, speculate: Speculation, pad_id: int,
                 lead):
        super().__init__(model, loops, pad_id)
        self.stats = SpeculationStats()
        self.decoder = SpeculativeDecoder(model, self.schedule, speculate, lead.sampling,
                                          lead.generator)
        self.stats.planner = self.decoder.planner

    @torch.no_grad()
    def admit(self, requests: list) -> list[int]:
        batch = self.decoder.prefill(*self.prompts(requests))
        self.join(requests, batch)
        return batch.pending.tolist()

    def _step(self, loop_slice: int | None) -> Step:
        """One plain step or one draft-verify round; each row's 1 … γ+1 new tokens (a round is
        never sliced)."""
        keep = torch.tensor([r.sampling.max_new_tokens - len(r.tokens)
                             for r in self.requests]).clamp(min=1)
        step = self.decoder.step(self.state, keep, torch.ones(len(keep), dtype=torch.bool))
        self.stats.record(step)
        return step
