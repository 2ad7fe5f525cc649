"""The steps of self-speculative decoding over a Batch: calibrating prefill and rounds (a plain
step is meshlm.generate.decoder.PlainDecoder's).

Each step runs on the model's three stages, through `stages`: the MeshLM itself, or the timing
wrapper meshlm.generate.timing.Timed, which measures them for the planner. A step returns what it
emitted and changes nothing but its batch (cache, mask, pending tokens). One round (docs/design.md,
"Self-speculative decoding"), with C positions cached and y₀ pending:

    draft    x = y₀, d₁ … d_γ one at a time: enter → advance to step K_d (kept: prelude, loops)
             (first γ) early_exit → readout → q_{i+1} → d_{i+1}  (draft-only: coda K/V cropped)
    verify   LoopRun.join of the γ+1 runs → advance K_d … K → readout: p₁ … p_{γ+1}, ONE forward
    accept   longest prefix (`accept`), then one token from p or the residual: 1 … γ+1 tokens
    settle   every slot back to C + the most any row kept; a row's rejected positions → padding
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.generate.batch import Batch
from meshlm.generate.sampling import Sampling, draw, padding_if_any, probabilities
from meshlm.generate.timing import Timed
from meshlm.model import MeshLM
from meshlm.model.kv_cache import KVCache
from meshlm.model.run import LoopRun


def accept(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, s: Sampling,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling per row (Leviathan et al.; Chen et al.). p (B, γ+1, V) full,
    q (B, γ, V) draft, d (B, γ) drafts. Returns (B,) accepted counts and (B,) the next token: from
    the residual max(0, p − q) at the first rejection, or from p_{γ+1} when every draft passed.
    Greedy (one-hot p, q) needs no randomness."""
    b, gamma, v = q.shape
    p_d = p[:, :gamma].gather(-1, d[..., None]).squeeze(-1)  # (B, γ) p_i(d_i)
    q_d = q.gather(-1, d[..., None]).squeeze(-1)  # (B, γ) q_i(d_i) > 0: d_i was drawn from q_i
    greedy = s.temperature == 0
    u = torch.zeros_like(q_d) if greedy else \
        torch.rand(q_d.shape, generator=generator, device=q.device)
    passed = u * q_d < p_d  # accept with probability min(1, p/q); greedy: exactly d_i = argmax p_i
    accepted = passed.long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
    q_padded = torch.cat([q, q.new_zeros(b, 1, v)], 1)  # after the last draft, "residual" = p
    index = accepted[:, None, None].expand(b, 1, v)
    p_at = p.gather(1, index).squeeze(1)  # (B, V)
    residual = (p_at - q_padded.gather(1, index).squeeze(1)).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p = q there: a rejection had probability 0
    residual = torch.where(empty, p_at, residual)
    return accepted, draw(residual / residual.sum(-1, keepdim=True), s, generator)


@dataclass(frozen=True, eq=False)
class Rounds:
    """Decoding steps of one model at one depth schedule and one sampling rule."""

    model: MeshLM
    schedule: tuple[int, ...]
    s: Sampling
    generator: torch.Generator | None = None
    stages: Timed | None = None  # the stages timed for the planner; None: the model's own, untimed

    @property
    def _stages(self):
        return self.model if self.stages is None else self.stages

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, depths: list[int], positions: int
                ) -> tuple[Batch, dict[tuple[int, bool], float], int]:
        """Run the prompts (B, T) with padding mask (B, T); returns the batch, its first new token
        pending, and the calibration: for each K_d in `depths` and each readout (final read or not),
        how well the draft's distribution q matches the full model's p on the prompt's last
        `positions` positions, mean Σ_x min(p, q) — the expected acceptance of speculative sampling
        (greedy: how often the argmaxes agree) — and how many real positions that mean is over."""
        kv, stages, n = KVCache(), self._stages, ids.shape[1]
        last = min(positions, n) if depths else 1  # calibrated positions: the prompt's last ones
        run = stages.start(ids, padding_if_any(mask), kv)
        exits: dict[tuple[int, bool], torch.Tensor] = {}  # (K_d, final read) -> (B, last, d)
        for step in range(len(self.schedule)):
            stages.advance(run, self.schedule, step + 1)
            if step + 1 in depths:
                exits.update(self._exit_states(run, last))
        # the head on every position (not only the last ones) so that the readout's cost at n tokens
        # is measured: a verification's cost at γ+1 is interpolated, not extrapolated
        p = probabilities(stages.readout(run, self.schedule)[:, -last:], self.s)  # (B, last, V)
        q = self._draft_readouts(run.last(last), list(exits.values()), kv)
        real = mask[:, -last:].bool()
        agreement = {key: float(torch.minimum(p, q_key).sum(-1)[real].mean())
                     for key, q_key in zip(exits, q)}
        batch = Batch(kv, mask, draw(p[:, -1], self.s, self.generator))
        return batch, agreement, int(real.sum())

    def _exit_states(self, run: LoopRun, last: int) -> dict[tuple[int, bool], torch.Tensor]:
        """The states (B, last, d) a draft stopping here would hand its coda: the loop state, and
        the scheme's early-exit read where it differs (MeSH: the final read router)."""
        exit_h = self.model.scheme.early_exit(run.h, run.ctx, len(self.schedule))
        states = {(run.step, False): run.h[:, -last:]}
        if exit_h is not run.h:  # the default early_exit is the state itself
            states[(run.step, True)] = exit_h[:, -last:]
        return states

    def _draft_readouts(self, tail: LoopRun, states: list[torch.Tensor], kv: KVCache
                        ) -> list[torch.Tensor]:
        """The draft distributions q (B, T, V) of C candidate draft states (each (B, T, d), the T
        positions of `tail`) at once, as drafts read: one coda + head over the C·B rows, the coda
        seeing the earlier positions' full-depth keys/values (each row's own, repeated C times) and
        keeping none of its own. (C readouts one by one cost ~3% of a 96-token decode.)"""
        if not states:
            return []
        view = kv.repeated(len(states), tail.past)  # each row's full-depth past, C times
        copies = LoopRun.stack([tail.with_state(h) for h in states], view)
        logits = self.model.readout(copies, self.schedule)  # untimed: not a stage of decoding
        return list(probabilities(logits, self.s).chunk(len(states)))

    def _front(self, kv: KVCache, tokens: torch.Tensor, mask: torch.Tensor, stop: int) -> LoopRun:
        """start → advance to loop step `stop`; mask (B, cached + T) covers the cache and T."""
        run = self._stages.start(tokens, padding_if_any(mask), kv)
        return self._stages.advance(run, self.schedule, stop)

    def round(self, batch: Batch, k_d: int, gamma: int, final_read: bool,
              keep_limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-verify round. Returns (B, γ+1) tokens and (B,) counts: row r emitted
        tokens[r, :count[r]] (its accepted drafts, then the full model's next token). keep_limit
        (B,): at most this many fed positions stay real per row (0 for finished rows)."""
        past = batch.cached
        runs, d, q = self._draft(batch, k_d, gamma, final_read)
        coda = range(len(batch.kv) - self.model.config.layout.coda, len(batch.kv))  # the last slots
        batch.kv.crop(past, coda)  # the draft's coda keys/values are draft-only
        verified = self._stages.advance(LoopRun.join(runs), self.schedule)  # loops K_d … K
        p = probabilities(self._stages.readout(verified, self.schedule), self.s)  # (B, γ+1, V)
        accepted, final = accept(p, q, d, self.s, self.generator)
        tokens = torch.cat([d, final[:, None]], 1).scatter_(1, accepted[:, None], final[:, None])
        batch.settle(torch.minimum(accepted + 1, keep_limit), final)  # y₀, d₁ … worth keeping
        return tokens, accepted + 1

    def _draft(self, batch: Batch, k_d: int, gamma: int, final_read: bool
               ) -> tuple[list[LoopRun], torch.Tensor, torch.Tensor]:
        """Draft γ tokens after the pending ones with K_d loop passes. Returns the γ+1 runs,
        standing at step K_d (the last token needs only its shared part), the (B, γ) drafts and
        their (B, γ, V) draft distributions."""
        ones = batch.mask.new_ones(len(batch), gamma + 1)
        runs, drafts, q, token = [], [], [], batch.pending
        for i in range(gamma + 1):
            runs.append(self._front(batch.kv, token[:, None],
                                    torch.cat([batch.mask, ones[:, :i + 1]], 1), k_d))
            if i == gamma:
                break
            exit_h = self.model.scheme.early_exit(runs[-1].h, runs[-1].ctx, len(self.schedule)) \
                if final_read else runs[-1].h
            logits = self._stages.readout(runs[-1].with_state(exit_h), self.schedule)
            q.append(probabilities(logits[:, -1], self.s))  # (B, V)
            token = draw(q[-1], self.s, self.generator)
            drafts.append(token)
        return runs, torch.stack(drafts, 1), torch.stack(q, 1)
