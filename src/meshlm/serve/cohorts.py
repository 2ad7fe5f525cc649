"""Running batches of continuous batching: the rows that decode together, joined and left at token boundaries.

A cohort holds the requests that share one compute setting (`loops`, `exit`, `speculate`): their cache slots
line up, so one forward serves them all. Its state is the batch's looped KV cache, the (B, W) padding mask over
it and each row's pending token (sampled, not yet fed):

    join    prefill the prompts admitted at this boundary as one left-padded batch in a cache of their own
            (exactly what `meshlm.generate` does with several prompts), then stack their rows under the
            batch's, right-aligned (KVCache.stack): the shorter side is left-padded, mask 0, which every query
            ignores and default positions skip
    step    feed every row's pending token in one forward; each row samples its next token with its own
            settings and random generator
    leave   drop finished rows (KVCache.select), then the leading columns no row still needs (drop_front),
            so the cache holds the live requests only: B rows × the longest live sequence

Under `exit` each token stops looping once it has converged; the forward computes only the still-active rows'
core passes (meshlm.model.exit gathers them) and copies exited rows' keys/values forward, so a row decodes as
it would alone. A speculative cohort runs meshlm.generate.speculative's draft-verify rounds over the same rows.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from meshlm.generate.sampling import left_pad, next_token, padding_if_any
from meshlm.generate.speculative import Decoder, Planner, Speculation, SpeculationStats, decode_round
from meshlm.model import MeshLM
from meshlm.model.kv_cache import KVCache


class Rows:
    """A batch's decoding state: cache, padding mask (B, W), pending tokens (B,). speculative.Decoder has the
    same three attributes, so a speculative cohort's decoder is its Rows."""

    def __init__(self, kv: KVCache, mask: torch.Tensor, pending: torch.Tensor):
        self.kv, self.mask, self.pending = kv, mask, pending


def pick(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """(B, V) last-position logits -> (B,) next tokens, each row with its request's sampling and generator
    (greedy rows: the argmax, as meshlm.generate; sampled rows one by one, so a seed's draws are its own)."""
    tokens = logits.argmax(-1)
    for row, request in enumerate(requests):
        if request.sampling.temperature > 0:
            tokens[row] = next_token(logits[row:row + 1], request.sampling, request.generator)[0]
    return tokens


class Cohort(ABC):
    """Rows of requests with one compute setting. Subclasses prefill (`admit`) and decode (`step`)."""

    def __init__(self, model: MeshLM, loops: int | None, pad_id: int):
        self.model, self.loops, self.pad_id = model, loops, pad_id
        self.schedule = model.schedule(loops)
        self.requests: list = []  # row r decodes requests[r]
        self.state: Rows | Decoder | None = None
        self.loop_steps = 0  # core passes run per decoded token, summed over tokens (exit lowers it)
        self.tokens = 0  # tokens decoded by `step`

    def __len__(self) -> int:
        return len(self.requests)

    def prompts(self, requests: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' prompts as (N, T) left-padded ids and their padding mask."""
        return left_pad([r.prompt for r in requests], self.pad_id, self.model.embed_in.weight.device)

    def join(self, requests: list, kv: KVCache, mask: torch.Tensor, pending: torch.Tensor) -> None:
        """Add prefilled requests' rows below the batch's (right-aligned)."""
        first = not self.requests
        self.requests.extend(requests)
        if first:  # the first rows (a speculative cohort's state is already its decoder)
            self.state = self.state or Rows(kv, mask, pending)
            self.state.kv, self.state.mask, self.state.pending = kv, mask, pending
            return
        s = self.state
        width = max(s.mask.shape[1], mask.shape[1])
        s.kv = KVCache.stack([s.kv, kv], room=8)  # room: the next steps append in place
        s.mask = torch.cat([_pad_left(s.mask, width), _pad_left(mask, width)])
        s.pending = torch.cat([s.pending, pending])

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in order); forget the columns that are padding in all of them."""
        s = self.state
        self.requests = [self.requests[r] for r in rows]
        index = torch.tensor(rows, dtype=torch.long, device=s.mask.device)
        s.kv.select(index)
        s.mask, s.pending = s.mask[index], s.pending[index]
        if rows:
            unused = int(s.mask.bool().any(0).long().argmax())  # the first column some row still reads
            s.kv.drop_front(unused)
            s.mask = s.mask[:, unused:]

    @abstractmethod
    def admit(self, requests: list) -> list[int]:
        """Prefill the requests' prompts together and join their rows to the batch; returns each one's first
        token."""

    @abstractmethod
    def step(self) -> list[list[int]]:
        """Decode once for every row; returns each row's new tokens (at least one)."""


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], 1)


class PlainCohort(Cohort):
    """Plain decoding at the full depth, or with per-token exit (`exit`, e.g. "state:0.05")."""

    def __init__(self, model: MeshLM, loops: int | None, exit: str | None, pad_id: int):
        super().__init__(model, loops, pad_id)
        self.exit = exit

    @torch.no_grad()
    def admit(self, requests: list) -> list[int]:
        """Prefill the prompts; join the batch with each one's first token pending. Returns those tokens."""
        (ids, mask), kv = self.prompts(requests), KVCache()
        out = self.model(ids, padding_mask=padding_if_any(mask), cache=kv, loops=self.loops, exit=self.exit)
        tokens = pick(out.logits[:, -1], requests)
        self.join(requests, kv, mask, tokens)
        return tokens.tolist()

    @torch.no_grad()
    def step(self) -> list[list[int]]:
        """Feed every row's pending token; each row's next token."""
        s = self.state
        mask = torch.cat([s.mask, s.mask.new_ones(s.mask.shape[0], 1)], 1)
        out = self.model(s.pending[:, None], padding_mask=padding_if_any(mask), cache=s.kv, loops=self.loops,
                         exit=self.exit)
        s.mask, s.pending = mask, pick(out.logits[:, -1], self.requests)
        self.tokens += len(s.pending)
        self.loop_steps += len(s.pending) * len(self.schedule) if out.exit_loops is None else int(out.exit_loops.sum())
        return [[t] for t in s.pending.tolist()]


class SpeculativeCohort(Cohort):
    """Lossless self-speculation over the batch (meshlm.generate.speculative): one Planner for the cohort, its
    measured costs and acceptance shared by every request; the first request's prompt calibrates it. All rows
    share the sampling filters (greedy cohorts batch; a sampled request gets its own cohort, as its draws come
    from the decoder's one generator)."""

    def __init__(self, model: MeshLM, loops: int | None, speculate: str, new_tokens: int, pad_id: int):
        super().__init__(model, loops, pad_id)
        self.spec = Speculation.parse(speculate)
        self.spec.check(model, self.schedule)
        self.stats = SpeculationStats()
        self.planner = Planner(self.spec, model.config.layout, self.schedule, self.stats, new_tokens)

    @torch.no_grad()
    def admit(self, requests: list) -> list[int]:
        ids, mask = self.prompts(requests)
        lead = requests[0]  # the cohort's requests share sampling filters; a sampled one is alone
        decoder = Decoder(self.model, self.schedule, lead.sampling, lead.generator, self.planner.costs)
        first = self.state is None
        calibrate = first and not (self.spec.final_read is not None and self.planner.fixed)
        pending, agreement, positions = decoder.prefill(ids, mask, self.planner.candidates if calibrate else [])
        if first:
            self.planner.calibrate(agreement, positions)
            self.state = decoder  # the cohort decodes through the first request's decoder; later ones join it
        self.join(requests, decoder.kv, decoder.mask, pending)
        return pending.tolist()

    @torch.no_grad()
    def step(self) -> list[list[int]]:
        """One plain step or one draft-verify round; each row's 1 … γ+1 new tokens."""
        keep = torch.tensor([r.sampling.max_new_tokens - len(r.tokens) for r in self.requests]).clamp(min=1)
        active = torch.ones(len(keep), dtype=torch.bool)
        tokens, counts = decode_round(self.state, self.planner, self.stats, keep, active,
                                      self.model.config.context_length)
        emitted = [row[:count] for row, count in zip(tokens, counts)]
        self.tokens += sum(counts)
        self.loop_steps += sum(counts) * len(self.schedule)  # every emitted token is the full depth's
        return emitted
