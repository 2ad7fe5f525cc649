"""Lossless self-speculative decoding: the first K_d loop passes draft, the full K passes verify.

A looped model's shallow loops are a free draft model: prelude → K_d loops → coda → head proposes tokens,
and for a drafted token the prelude and the first K_d loops compute exactly what the full model computes
(same weights, same inputs, the same cached keys/values at those depths). One round, with y₀ the pending
token (sampled by the full model, not yet fed) and C tokens in every cache slot:

    draft    for i = 0 … γ, x = y₀, d₁ … d_γ:
               enter(x_i) → advance to step K_d      prelude + loops 1…K_d: K/V and per-token state kept
               (i < γ) early_exit → readout          draft-only: the coda reads scheme.early_exit(h^{K_d})
                       → q_{i+1} → d_{i+1}           (MeSH: the final read router); its coda K/V are
                                                     cropped back to C after the draft
    verify   join the γ+1 runs (h^{K_d} and the scheme context, concat_contexts) → advance K_d … K
             → readout: p₁ … p_{γ+1}, in ONE forward over γ+1 tokens
    accept   longest prefix: greedy d_i = argmax p_i; sampling u_i·q_i(d_i) < p_i(d_i) (Leviathan et al.,
             Chen et al.); then one token from p at the first rejection (the residual max(0, p − q),
             renormalised) or from p_{γ+1} when all γ pass — so every round emits 1 … γ+1 exact tokens
    rollback every slot back to C + max_r(kept_r); a row's rejected positions become padding (mask 0),
             which every later query ignores and default positions skip (left padding included)

The filters (temperature, top-k, top-p) are applied to both p and q (meshlm.generate.probabilities), so the
output distribution is exactly the full model's filtered one; greedy is the same rule with one-hot p and q.
Holes left by rows that accepted fewer tokens than others are squeezed out (`compact`) when the cache would
outgrow the context. docs/design.md ("Self-speculative decoding") says why this is exact for every scheme.

`Planner` picks K_d and γ from measured costs (each stage timed while it does real work: the prefill, plain
steps, drafts, verifications) and measured acceptance (the prefill reads every candidate draft out over the
prompt; rounds refine it), by the expected tokens per round Σ_{i≤γ} α^i against the round's cost; when no
setting is predicted to pay, `auto` falls back to plain decoding.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from meshlm.config import Layout
from meshlm.errors import ConfigError
from meshlm.generate.sampling import Sampling, draw, left_pad, next_token, padding_if_any, probabilities
from meshlm.model import MeshLM
from meshlm.model.kv_cache import KVCache, slot_offsets
from meshlm.model.lm import LoopRun
from meshlm.model.schemes import LoopContext, Scheme, concat_contexts

GAMMA_MAX = 8  # longest draft the planner considers
PRIOR_TOKENS = 4  # the prompt's last positions whose draft agreement seeds each K_d's acceptance, with the
# weight of as many drafted tokens: a prior, soon outweighed by the rounds. The prompt is read teacher-forced,
# while a draft's coda sees the verified tokens' full-depth keys/values, so the two can differ (91% vs. 32%
# on one model, 91% vs. 97% on another)
MIN_GAIN = 1.25  # auto starts speculating only where the cost model predicts this speed-up (it is optimistic:
# it leaves out Python overhead that does not scale with the stages; measured 0.93x where it predicted 1.37x)
LOSS_BUDGET = 0.02  # auto's rounds may cost at most this share of the plain decode's time more than plain
# steps would have: it starts a round only if the round's worst outcome (one token) keeps the loss within it,
# shortening γ to fit, and otherwise decodes plainly for good. The prompt's agreement can mislead (a prompt of
# real text agreed 100%, the model's own repetitive continuation 32%): this bounds what finding out costs
EXPLORE_TOKENS, EXPLORE_GAMMA = 8, 2  # until a K_d has drafted this many tokens, auto drafts at most 2 per
# round: a round that turns out to lose then loses little, and a first look fits in a small budget
KEEP_GAIN = 1.1  # and keeps speculating while it predicts this much: one unlucky round (a rejection right
# after a fully accepted one) must not end speculation for good where it pays (1.36x, measured)
PLAIN_SAMPLES = 3  # plain steps timed before the first round: their median is the plain token's cost


# -- what to do ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Speculation:
    """`auto` (both None), `K_d` (γ chosen) or `K_d:γ`. Parse from text with `Speculation.parse`."""

    draft_loops: int | None = None  # K_d: loop passes of the draft
    draft_tokens: int | None = None  # γ: tokens drafted per round
    final_read: bool | None = None  # the draft's coda reads scheme.early_exit (MeSH: the final read router)
    # or the loop state itself; None: whichever agrees better with the full model on the prompt

    @classmethod
    def parse(cls, text: str | Speculation) -> Speculation:
        if isinstance(text, Speculation):
            return text
        if str(text).strip().lower() == "auto":
            return cls()
        parts = str(text).split(":")
        if len(parts) > 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ConfigError(f"speculate={text!r} is not auto, K_d or K_d:γ; e.g. --speculate auto, 2 or 2:4")
        values = [int(p) for p in parts]
        if len(values) == 2 and values[1] < 1:
            raise ConfigError(f"speculate={text!r}: γ={values[1]} drafted tokens per round must be >= 1")
        return cls(values[0], values[1] if len(values) == 2 else None)

    def check(self, model: MeshLM, schedule: tuple[int, ...]) -> None:
        """One-line errors: no repeated core, K_d outside 1 … K−1, γ < 1."""
        layout, k = model.config.layout, len(schedule)
        if not layout.shares_weights and k == len(layout.cores):
            raise ConfigError(f"speculation drafts with the first loop passes of a repeated core, but spec "
                              f"{model.config.spec!r} repeats none; use a looped spec such as '2+2R4+2'")
        if self.draft_loops is not None and not 1 <= self.draft_loops < k:
            raise ConfigError(f"speculate K_d={self.draft_loops} must be in 1 … {k - 1}: the draft runs fewer "
                              f"loop passes than the model's K={k}")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise ConfigError(f"speculate γ={self.draft_tokens} drafted tokens per round must be >= 1")


@dataclass
class SpeculationStats:
    """Filled in while decoding; `summary()` is the line `meshlm generate --speculate` prints."""

    drafted: int = 0  # drafted tokens verified (rows still generating)
    accepted: int = 0  # of which accepted
    rounds: int = 0
    plain_steps: int = 0
    tokens: int = 0  # new tokens produced, all rows
    seconds: float = 0.0
    setting: str = ""  # what the planner settled on: "K_d=2 γ=4", or "plain"
    acceptance_by_depth: dict[int, float] = field(default_factory=dict)  # K_d -> measured α
    predicted_speedup: float | None = None
    planner: Planner | None = field(default=None, repr=False)  # its measured costs and acceptance

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> str:
        alphas = ", ".join(f"K_d={k}: {a:.0%}" for k, a in sorted(self.acceptance_by_depth.items()))
        return (f"speculate: {self.setting or 'plain'}; acceptance {self.acceptance:.1%} ({self.accepted}/"
                f"{self.drafted} drafted, {self.rounds} rounds, {self.plain_steps} plain steps); "
                f"{self.tokens / max(self.seconds, 1e-9):.1f} tokens/s" + (f"; per-depth α {alphas}" if alphas else ""))


# -- measured costs and the plan ----------------------------------------------------------------------------
class Costs:
    """Seconds of each stage, by tokens in the call: `enter`, loop step k, `readout`, and per-round overhead.

    Stages are timed while doing real work. Costs at n tokens are interpolated linearly between the fewest
    and the most tokens measured; a step never measured at n borrows the mean of its core's measured steps.
    Answers are memoised until the next measurement: the planner asks for the same few hundreds each round."""

    def __init__(self, schedule: tuple[int, ...]):
        self.schedule = schedule
        self.seen: dict[tuple[object, int], list[float]] = {}
        self._memo: dict[tuple[object, int], float] = {}

    def add(self, stage: object, n: int, seconds: float) -> None:
        samples = self.seen.setdefault((stage, n), [])
        samples.append(seconds)
        del samples[:-15]  # the recent ones: medians stay cheap and follow the machine's load
        self._memo.clear()

    def _at(self, stage: object, n: int) -> float | None:
        ns = sorted(m for (s, m) in self.seen if s == stage)
        if not ns:
            return None
        med = {m: sorted(self.seen[(stage, m)])[len(self.seen[(stage, m)]) // 2] for m in ns}
        lo, hi = ns[0], ns[-1]
        if n <= lo or lo == hi:
            return med[lo]
        return med[lo] + (med[hi] - med[lo]) * (n - lo) / (hi - lo)  # beyond hi: extrapolated

    def stage(self, stage: object, n: int) -> float:
        if (stage, n) not in self._memo:
            self._memo[(stage, n)] = self._stage(stage, n)
        return self._memo[(stage, n)]

    def _stage(self, stage: object, n: int) -> float:
        value = self._at(stage, n)
        if value is None and isinstance(stage, tuple):  # ("step", k): borrow the core's other steps
            core = self.schedule[stage[1]]
            same = [v for k, c in enumerate(self.schedule) if c == core
                    for v in [self._at(("step", k), n)] if v is not None]
            value = sum(same) / len(same) if same else None
        return 0.0 if value is None else value

    def front(self, k_d: int, n: int = 1) -> float:
        return self.stage("enter", n) + sum(self.stage(("step", k), n) for k in range(k_d))

    def plain_token(self) -> float:
        return self.front(len(self.schedule)) + self.stage("readout", 1) + self.stage("plain-overhead", 1)

    def round(self, k_d: int, gamma: int) -> float:
        n = gamma + 1
        draft = gamma * (self.front(k_d) + self.stage("readout", 1)) + self.front(k_d)
        verify = sum(self.stage(("step", k), n) for k in range(k_d, len(self.schedule))) + self.stage("readout", n)
        return draft + verify + self.stage("round-overhead", n)

    @property
    def measured(self) -> bool:
        """PLAIN_SAMPLES plain steps have been timed: the first decode step after the prefill runs ~15-20%
        slower than the later ones (new shapes), and a plain token's cost is what every gain and loss is
        counted against."""
        return len(self.seen.get(("plain-overhead", 1), ())) >= PLAIN_SAMPLES


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one round emits when each drafted token is accepted with probability α: Σ_{i≤γ} α^i."""
    return float(sum(alpha ** i for i in range(gamma + 1)))


def layer_bound(layout: Layout, schedule: tuple[int, ...], k_d: int) -> float:
    """Speed-up of K_d at perfect acceptance and γ = GAMMA_MAX, counting layers (the head as one, a verified
    token as a fed one): auto calibrates only the K_d that could reach MIN_GAIN."""
    front = layout.prelude + sum(layout.cores[c] for c in schedule[:k_d])
    rest = sum(layout.cores[c] for c in schedule[k_d:]) + layout.coda + 1
    plain, draft = front + rest, front + layout.coda + 1
    return (GAMMA_MAX + 1) * plain / (GAMMA_MAX * draft + front + rest)


class Planner:
    """Chooses each round's (K_d, γ), or None for a plain step, from measured costs and acceptance."""

    def __init__(self, spec: Speculation, layout: Layout, schedule: tuple[int, ...], stats: SpeculationStats,
                 new_tokens: int = 64):
        self.spec, self.k, self.stats = spec, len(schedule), stats
        self.new_tokens = new_tokens
        self.loss = 0.0  # seconds the rounds so far took beyond what plain steps would have for their tokens
        self.drafted: dict[int, int] = {}  # K_d -> tokens drafted in rounds so far (per row)
        self.costs = Costs(schedule)
        self.counts: dict[int, list[float]] = {}  # K_d -> [accepted, rejections]: prompt prior + rounds
        self.auto = spec.draft_loops is None  # K_d chosen here: it may explore, give up, fall back to plain
        self.candidates = [k_d for k_d in range(1, self.k) if layer_bound(layout, schedule, k_d) >= MIN_GAIN] \
            if self.auto else [spec.draft_loops]
        self.fixed = (spec.draft_loops, spec.draft_tokens) if not self.auto and spec.draft_tokens else None
        self.final_read = {k_d: spec.final_read is not False for k_d in self.candidates}  # chosen by calibrate
        self.choice: tuple[int, int] | None = None
        self.plain_for_good = False  # auto found nothing that pays: plain decoding, untimed, from then on
        stats.setting = f"K_d={spec.draft_loops} γ={spec.draft_tokens}" if self.fixed else ""

    def calibrate(self, agreement: dict[tuple[int, bool], float], positions: int) -> None:
        """Prompt agreement of each (K_d, final_read) draft with the full model (Decoder.prefill): pick each
        K_d's readout and start its acceptance estimate there."""
        for k_d in self.candidates:
            reads = [r for r in (True, False) if (k_d, r) in agreement]
            if not reads:
                continue
            self.final_read[k_d] = max(reads, key=lambda r: agreement[(k_d, r)])
            alpha = agreement[(k_d, self.final_read[k_d])]
            self.counts[k_d] = [alpha * positions, (1 - alpha) * positions]  # as if drafted there
            self.stats.acceptance_by_depth[k_d] = self.alpha(k_d)

    def alpha(self, k_d: int) -> float:
        """Per-token acceptance: the geometric model's estimate, with half a pseudo-count each way."""
        accepted, rejections = self.counts.get(k_d, (0, 0))
        return (accepted + 0.5) / (accepted + rejections + 1)

    def observe(self, k_d: int, accepted: torch.Tensor, gamma: int, seconds: float) -> None:
        """Per-row accepted counts of one round that took `seconds`; a row that stopped before γ saw one
        rejection."""
        self.loss += seconds - (1 + float(accepted.float().mean())) * self.costs.plain_token()
        self.drafted[k_d] = self.drafted.get(k_d, 0) + gamma
        counts = self.counts.setdefault(k_d, [0.0, 0.0])
        counts[0] += int(accepted.sum())
        counts[1] += int((accepted < gamma).sum())
        self.stats.acceptance_by_depth[k_d] = self.alpha(k_d)

    def best(self, k_d: int, alpha: float) -> tuple[float, int]:
        """(predicted speed-up, γ) of the best draft length for K_d at acceptance α."""
        plain = self.costs.plain_token()
        gammas = [self.spec.draft_tokens] if self.spec.draft_tokens else range(1, GAMMA_MAX + 1)
        return max((expected_tokens(alpha, g) * plain / max(self.costs.round(k_d, g), 1e-12), g) for g in gammas)

    def next(self) -> tuple[int, int] | None:
        if self.fixed:
            return self.fixed
        if self.plain_for_good or not self.costs.measured:
            return None  # plain decoding (at first, one timed plain step measures the stages)
        return self._settle()

    def _settle(self) -> tuple[int, int] | None:
        """Re-decided every round, from the acceptance measured so far (the prompt's, then the rounds')."""
        scored = [(*self.best(k_d, self.alpha(k_d)), k_d) for k_d in self.candidates if k_d in self.counts]
        self.choice = self._choose(max(scored)) if scored else None  # None: nothing to draft with
        self.plain_for_good = self.choice is None
        self.stats.setting = "plain" if self.choice is None else f"K_d={self.choice[0]} γ={self.choice[1]}"
        return self.choice

    def _choose(self, best: tuple[float, int, int]) -> tuple[int, int] | None:
        """The round to run from the best-scored (gain, γ, K_d); auto: None where it does not pay enough or
        even γ = 1 could take its loss past the budget."""
        gain, gamma, k_d = best
        self.stats.predicted_speedup = gain
        if not self.auto:
            return k_d, gamma
        if self.drafted.get(k_d, 0) < EXPLORE_TOKENS:
            gamma = min(gamma, EXPLORE_GAMMA)  # still finding out what this K_d accepts
        if gain < (MIN_GAIN if self.choice is None else KEEP_GAIN):  # to start, to carry on
            return None
        plain = self.costs.plain_token()
        room = LOSS_BUDGET * self.new_tokens * plain - self.loss  # what a round may still lose
        fits = next((g for g in range(gamma, 0, -1) if self.costs.round(k_d, g) - plain <= room), None)
        return None if fits is None else (k_d, fits)


# -- the decoder --------------------------------------------------------------------------------------------
class Clock:
    """Stage timer. On CPU this thread's CPU time: on a shared machine other jobs' load barely moves it, only
    ratios of stage costs matter, and it costs ~1 µs (process CPU time costs 0.1-20 ms a call on some systems).
    On CUDA wall time, synchronising so a stage's kernels count in it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()


class Repeated:
    """A read-only view of a KV cache's first `length` positions for C copies of its batch (rows r, B + r,
    2B + r … are row r): a layer sees each row's cached keys/values followed by its own, which are not stored
    (a LayerCache)."""

    def __init__(self, cache: KVCache, copies: int, length: int):
        self.cache, self.copies, self.length = cache, copies, length

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length == 0:
            return key, value
        past = self.cache.slot(layer_idx)  # (B, H, T_cached, hd)
        return tuple(torch.cat([t[..., :self.length, :].repeat(self.copies, 1, 1, 1), new], -2)
                     for t, new in zip(past, (key, value)))

    def get_seq_length(self) -> int:
        return self.length


class Decoder:
    """Batched decoding state: the cache, the padding mask over it, the pending token of every row. Every
    stage is timed into `costs` while it does real work (so measuring costs no extra forward)."""

    def __init__(self, model: MeshLM, schedule: tuple[int, ...], s: Sampling, generator, costs: Costs):
        self.model, self.schedule, self.s, self.generator, self.costs = model, schedule, s, generator, costs
        _, _, coda_start, slots = slot_offsets(model.config.layout, schedule)
        self.coda_slots = range(coda_start, slots)
        self.kv = KVCache()
        self.clock = Clock(next(model.parameters()).device)
        self.stage_seconds = 0.0  # stage time since the current plain step or round began
        self.round_seconds = 0.0  # time the last round took

    @property
    def cached(self) -> int:
        return self.mask.shape[1]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, depths: list[int]
                ) -> tuple[torch.Tensor, dict[tuple[int, bool], float], int]:
        """Run the prompt (stages timed); returns the first new token of every row (the pending token) and the
        calibration: for each K_d in `depths` and each readout (final read or not), how well the draft's
        distribution q matches the full model's p on the prompt's last positions, mean Σ_x min(p, q) — the
        expected acceptance of speculative sampling (greedy: how often the argmaxes agree) — and how many real
        positions that mean is over."""
        self.mask = mask
        n, k = ids.shape[1], len(self.schedule)
        last = min(PRIOR_TOKENS, n) if depths else 1  # calibrated positions: the prompt's last ones
        reads = (True, False) if type(self.model.scheme).early_exit is not Scheme.early_exit else (False,)
        run = self._timed("enter", n, self.model.enter, ids, padding_if_any(mask), None, self.kv)
        exits = {}  # (K_d, final read) -> (B, last, d): the state a draft there would hand its coda
        for step in range(k):
            self._timed(("step", step), n, self.model.advance, run, self.schedule, step + 1)
            for read in reads if step + 1 in depths else ():
                h = self.model.scheme.early_exit(run.h, run.ctx, k) if read else run.h
                exits[(step + 1, read)] = h[:, -last:]
        # the head on every position (not only the last ones) so that the readout's cost at n tokens is measured:
        # a verification's cost at γ+1 is interpolated between 1 and n, not extrapolated from a few small rounds
        logits = self._timed("readout", n, self.model.readout, run, self.schedule)
        p = probabilities(logits[:, -last:], self.s)  # (B, last, V)
        q = self._draft_readouts(list(exits.values()), n - last)
        real = mask[:, -last:].bool()
        agreement = {key: float(torch.minimum(p, q_key).sum(-1)[real].mean()) for key, q_key in zip(exits, q)}
        self.pending = draw(p[:, -1], self.s, self.generator)
        return self.pending, agreement, int(real.sum())

    def _draft_readouts(self, states: list[torch.Tensor], past: int) -> list[torch.Tensor]:
        """The draft distributions q (B, T, V) of C candidate draft states (each (B, T, d), the T positions
        after the first `past`) at once, as drafts read: one coda + head over the C·B rows, the coda seeing
        the `past` earlier positions' full-depth keys/values (each row's own, repeated C times) and not
        keeping its own. (C readouts one by one, each with its own forward, cost ~3% of a 96-token decode.)"""
        if not states:
            return []
        (b, t, _), c = states[0].shape, len(states)
        rope, mask = self.model.attention_inputs((b, t), past, padding_if_any(self.mask), None, states[0].dtype)
        rope = tuple(r.repeat(c, 1, 1) if r.shape[0] > 1 else r for r in rope)  # (C·B or 1, T, r)
        mask = None if mask is None else mask.repeat(c, 1, 1, 1)  # (C·B, 1, T, past + T)
        drafts = LoopRun(h=torch.cat(states), ctx=LoopContext(e=states[0]), rope=rope, mask=mask,
                         cache=Repeated(self.kv, c, past))  # (the coda reads no scheme context)
        return list(probabilities(self.model.readout(drafts, self.schedule), self.s).chunk(c))

    def _timed(self, stage: object, n: int, fn, *args):
        t = self.clock()
        out = fn(*args)
        seconds = self.clock() - t
        self.costs.add(stage, n, seconds)
        self.stage_seconds += seconds
        return out

    def _forward(self, tokens: torch.Tensor, mask: torch.Tensor, stop: int, readout: bool, final_read: bool = False
                 ) -> tuple[LoopRun, torch.Tensor | None]:
        """enter → advance to step `stop` (→ readout: (B, T, V) logits). Stopping early (a draft), the coda
        reads scheme.early_exit of the state; the run keeps the loop's own state for verification."""
        n = tokens.shape[1]
        run = self._timed("enter", n, self.model.enter, tokens, padding_if_any(mask), None, self.kv)
        for k in range(run.step, stop):
            self._timed(("step", k), n, self.model.advance, run, self.schedule, k + 1)
        if not readout:
            return run, None
        exit_run = run
        if stop < len(self.schedule) and final_read:
            exit_run = replace(run, h=self.model.scheme.early_exit(run.h, run.ctx, len(self.schedule)))
        return run, self._timed("readout", n, self.model.readout, exit_run, self.schedule)

    def _new_columns(self, keep: torch.Tensor, width: int) -> torch.Tensor:
        """(B, width) padding-mask columns: 1 for each row's first keep[r] positions, 0 (padding) after."""
        return (torch.arange(width, device=keep.device)[None] < keep[:, None]).to(self.mask.dtype)

    def plain_step(self, keep_limit: torch.Tensor | None, timed: bool = True) -> torch.Tensor:
        """Feed the pending token through the full model; returns (B, 1): the new pending token. Untimed and
        without keep_limit, it is exactly meshlm.generate's step (one forward, next_token)."""
        start, self.stage_seconds = self.clock(), 0.0
        mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)
        if timed:
            logits = self._forward(self.pending[:, None], mask, len(self.schedule), readout=True)[1]
        else:
            logits = self.model(self.pending[:, None], padding_mask=padding_if_any(mask), cache=self.kv,
                                loops=len(self.schedule)).logits
        self.pending = next_token(logits[:, -1], self.s, self.generator)
        if keep_limit is not None:  # rows done generating: their new position becomes padding
            mask = torch.cat([self.mask, self._new_columns(keep_limit.clamp(max=1), 1)], 1)
        self.mask = mask
        if timed:
            self.costs.add("plain-overhead", 1, max(self.clock() - start - self.stage_seconds, 0.0))
        return self.pending[:, None]

    def round(self, k_d: int, gamma: int, keep_limit: torch.Tensor, final_read: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-verify round. Returns (B, γ+1) tokens and (B,) counts: row r emitted tokens[r, :count[r]]
        (its accepted drafts, then the full model's next token). keep_limit (B,): at most this many fed
        positions stay real in the cache per row (0 for finished rows); the others become padding."""
        start, self.stage_seconds = self.clock(), 0.0
        past, ones = self.cached, self.mask.new_ones(self.mask.shape[0], gamma + 1)
        runs, drafts, q = [], [], []
        token = self.pending
        for i in range(gamma + 1):  # the last token needs only its shared part (no draft readout)
            run, logits = self._forward(token[:, None], torch.cat([self.mask, ones[:, :i + 1]], 1), k_d, i < gamma,
                                        final_read)
            runs.append(run)
            if i < gamma:
                q.append(probabilities(logits[:, -1], self.s))  # (B, V)
                token = draw(q[-1], self.s, self.generator)
                drafts.append(token)
        self.kv.crop(past, self.coda_slots)  # the draft's coda keys/values are draft-only
        p = probabilities(self._verify(runs, torch.cat([self.mask, ones], 1), past, k_d), self.s)  # (B, γ+1, V)
        d = torch.stack(drafts, 1)  # (B, γ)
        accepted, final = self._accept(p, torch.stack(q, 1), d)
        tokens = torch.cat([d, final[:, None]], 1).scatter_(1, accepted[:, None], final[:, None])  # (B, γ+1)
        keep = torch.minimum(accepted + 1, keep_limit)  # fed positions of y₀, d₁ … d_n worth keeping
        width = max(int(keep.max()), 1)
        self.kv.crop(past + width)  # every slot: prelude, loops, coda
        self.mask = torch.cat([self.mask, self._new_columns(keep, width)], 1)
        self.pending = final
        self.round_seconds = self.clock() - start
        self.costs.add("round-overhead", gamma + 1, max(self.round_seconds - self.stage_seconds, 0.0))
        return tokens, accepted + 1

    def _verify(self, runs: list[LoopRun], mask: torch.Tensor, past: int, k_d: int) -> torch.Tensor:
        """Resume the γ+1 draft runs at step K_d as one run: loops K_d … K, coda, head. (B, γ+1, V) logits."""
        n = len(runs)
        rope, attn = self.model.attention_inputs((mask.shape[0], n), past, padding_if_any(mask), None,
                                                 runs[0].h.dtype)
        run = LoopRun(h=torch.cat([r.h for r in runs], 1), ctx=concat_contexts([r.ctx for r in runs]),
                      rope=rope, mask=attn, cache=self.kv, step=k_d)
        for k in range(k_d, len(self.schedule)):
            self._timed(("step", k), n, self.model.advance, run, self.schedule, k + 1)
        return self._timed("readout", n, self.model.readout, run, self.schedule)

    def _accept(self, p: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative rejection sampling per row. p (B, γ+1, V) full, q (B, γ, V) draft, d (B, γ) drafts.
        Returns (B,) accepted counts and (B,) the next token: from the residual max(0, p − q) at the first
        rejection, or from p_{γ+1} when every draft passed. Greedy (one-hot p, q) needs no randomness."""
        b, gamma, v = q.shape
        p_d = p[:, :gamma].gather(-1, d[..., None]).squeeze(-1)  # (B, γ) p_i(d_i)
        q_d = q.gather(-1, d[..., None]).squeeze(-1)  # (B, γ) q_i(d_i) > 0: d_i was drawn from q_i
        greedy = self.s.temperature == 0
        u = torch.zeros_like(q_d) if greedy else torch.rand(q_d.shape, generator=self.generator, device=q.device)
        passed = u * q_d < p_d  # accept with probability min(1, p/q); greedy: exactly when d_i = argmax p_i
        accepted = passed.long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
        q_padded = torch.cat([q, q.new_zeros(b, 1, v)], 1)  # after the last draft, "residual" = p itself
        index = accepted[:, None, None].expand(b, 1, v)
        p_at = p.gather(1, index).squeeze(1)  # (B, V)
        residual = (p_at - q_padded.gather(1, index).squeeze(1)).clamp(min=0)
        empty = residual.sum(-1, keepdim=True) <= 0  # p = q there: a rejection had probability 0
        residual = torch.where(empty, p_at, residual)
        return accepted, draw(residual / residual.sum(-1, keepdim=True), self.s, self.generator)

    def compact(self) -> None:
        """Move every row's padding (left padding and rollback holes) to the left, in order, then drop the
        columns that are padding in every row. Attention ignores padding and positions count real tokens,
        so nothing a later token computes changes."""
        real = self.mask.bool()
        order = torch.sort(real.long(), dim=1, stable=True).indices  # (B, T): padding first, then real tokens
        drop = int((~real).sum(1).min())
        order = order[:, drop:]
        self.kv.reorder(order)
        self.mask = self.mask.gather(1, order)


@torch.no_grad()
def stream(model: MeshLM, prompts: list[list[int]], s: Sampling, speculate: str | Speculation = "auto",
           eos_id: int = 0, pad_id: int = 1, loops: int | None = None,
           stats: SpeculationStats | None = None) -> Iterator[torch.Tensor]:
    """Yield the (B,) next tokens step by step, exactly as meshlm.generate.stream would (greedy: the same
    tokens; sampling: the same distribution), computed by speculative rounds. Rows that reached EOS yield
    `pad_id`. `stats` (optional) receives acceptance, tokens/s and the chosen setting."""
    schedule = model.schedule(loops)
    spec = Speculation.parse(speculate)
    spec.check(model, schedule)
    stats = stats if stats is not None else SpeculationStats()
    start = time.perf_counter()
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    context = model.config.context_length
    if ids.shape[1] + s.max_new_tokens > context:
        raise ConfigError(f"the prompt ({ids.shape[1]} tokens) plus max_new_tokens={s.max_new_tokens} exceeds "
                          f"context_length={context}; lower max_new_tokens to at most {context - ids.shape[1]} "
                          f"or shorten the prompt")
    generator = None if s.seed is None else torch.Generator(device).manual_seed(s.seed)
    planner = stats.planner = Planner(spec, model.config.layout, schedule, stats, s.max_new_tokens)
    decoder = Decoder(model, schedule, s, generator, planner.costs)
    rows = ids.shape[0]
    first, agreement, positions = decoder.prefill(ids, mask, [] if spec.final_read is not None and planner.fixed
                                                  else planner.candidates)
    planner.calibrate(agreement, positions)
    queues = [deque([t]) for t in first.tolist()]
    made = [1] * rows  # tokens generated per row, queued or yielded
    done = [False] * rows  # yielded EOS (when stop_at_eos)
    for _ in range(s.max_new_tokens):
        while not all(done[r] or queues[r] for r in range(rows)):  # some row still lacks its next token
            _decode_more(decoder, planner, stats, made, done, s, context)
            for r, (row, count) in enumerate(zip(*decoder.emitted)):
                queues[r].extend(row[:count])
                made[r] += count
        step = [pad_id if done[r] else queues[r].popleft() for r in range(rows)]
        stats.tokens += sum(not d for d in done)
        done = [d or (s.stop_at_eos and t == eos_id) for d, t in zip(done, step)]
        stats.seconds = time.perf_counter() - start
        yield torch.tensor(step, device=device)
        if all(done):
            return


def _decode_more(decoder: Decoder, planner: Planner, stats: SpeculationStats, made: list[int], done: list[bool],
                 s: Sampling, context: int) -> None:
    """One plain step or one speculative round, as the planner says; leaves (tokens, counts) in
    decoder.emitted. Rows still generating keep at most the positions they will need in the cache."""
    if planner.plain_for_good:  # nothing pays: meshlm.generate's own step, no bookkeeping
        if decoder.cached + 1 > context:
            decoder.compact()
        decoder.emitted = (decoder.plain_step(None, timed=False).tolist(), [1] * len(made))
        stats.plain_steps += 1
        return
    active = torch.tensor([not d and m < s.max_new_tokens for d, m in zip(done, made)])
    keep = torch.tensor([s.max_new_tokens - m for m in made]).clamp(min=0) * active
    decoder.emitted = decode_round(decoder, planner, stats, keep, active, context)


def decode_round(decoder: Decoder, planner: Planner, stats: SpeculationStats, keep: torch.Tensor,
                 active: torch.Tensor, context: int) -> tuple[list[list[int]], list[int]]:
    """One plain step or one speculative round for a batch whose row r may still emit keep[r] tokens (0 for
    rows done; `active` (B,) bool marks the others). Returns (B, n) tokens and (B,) counts: row r emitted
    tokens[r][:counts[r]]. Also what continuous batching (meshlm.serve) runs at every token boundary."""
    choice = planner.next()
    gamma = 0 if choice is None else min(choice[1], int(keep.max()) - 1)
    if decoder.cached + gamma + 1 > context:  # rollback holes took the room: squeeze them out
        decoder.compact()
        gamma = max(min(gamma, context - decoder.cached - 1), 0)
    device = decoder.mask.device
    if gamma < 1:
        stats.plain_steps += 1
        return decoder.plain_step(keep.to(device), timed=not planner.plain_for_good).tolist(), [1] * len(keep)
    tokens, counts = decoder.round(choice[0], gamma, keep.to(device), planner.final_read[choice[0]])
    accepted = (counts - 1).cpu()[active]
    planner.observe(choice[0], accepted, gamma, decoder.round_seconds)
    stats.rounds += 1
    stats.drafted += gamma * int(active.sum())
    stats.accepted += int(accepted.sum())
    return tokens.tolist(), counts.tolist()
