"""What self-speculative decoding does: the settings (`Speculation`), the measured costs (`Costs`)
and the planner that picks each round's draft depth K_d and length γ from them (`Planner`).

The planner knows nothing of tensors or of the model's code: it reads the layout (to rule out depths
that could never pay), the stage costs that meshlm.generate.timing measures while decoding does real
work, and the acceptance the prefill and the rounds report. It predicts the tokens per round
Σ_{i≤γ} α^i against the round's cost; when no setting is predicted to pay, `auto` decodes plainly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.config import Layout
from meshlm.errors import ConfigError

GAMMA_MAX = 8  # longest draft the planner considers
PRIOR_TOKENS = 4  # the prompt's last positions whose draft agreement seeds each K_d's acceptance,
# with the weight of as many drafted tokens: a prior, soon outweighed by the rounds. The prompt is
# read teacher-forced, while a draft's coda sees the verified tokens' full-depth keys/values, so the
# two can differ (91% vs. 32% on one model, 91% vs. 97% on another)
MIN_GAIN = 1.25  # auto starts speculating only where the cost model predicts this speed-up (it is
# optimistic: it leaves out Python overhead that does not scale with the stages; 1:4 measured
# 1.44x where it predicted 1.69x)
LOSS_BUDGET = 0.02  # auto's rounds may cost at most this share of the plain decode's time more than
# plain steps would have: it starts a round only if the round's worst outcome (one token) keeps the
# loss within it, shortening γ to fit, and otherwise decodes plainly for good. The prompt's
# agreement can mislead (a prompt of real text agreed 100%, the model's own repetitive continuation
# 32%): this bounds what finding out costs
EXPLORE_TOKENS, EXPLORE_GAMMA = 8, 2  # until a K_d has drafted this many tokens, auto drafts at
# most 2 per round: a round that turns out to lose then loses little, and a first look fits a small
# budget
KEEP_GAIN = 1.1  # and keeps speculating while it predicts this much: one unlucky round (a rejection
# right after a fully accepted one) must not end speculation for good where it pays
# (docs/benchmarks.md)
PLAIN_SAMPLES = 3  # plain steps timed before the first round: their median is a plain token's cost


@dataclass(frozen=True)
class Speculation:
    """`auto` (both None), `K_d` (γ chosen) or `K_d:γ`. Parse from text with `Speculation.parse`."""

    draft_loops: int | None = None  # K_d: loop passes of the draft
    draft_tokens: int | None = None  # γ: tokens drafted per round
    final_read: bool | None = None  # the draft's coda reads scheme.early_exit (MeSH: the final
    # read router) or the loop state itself; None: whichever agrees better with the full model on
    # the prompt

    @classmethod
    def parse(cls, text: str | Speculation) -> Speculation:
        if isinstance(text, Speculation):
            return text
        if str(text).strip().lower() == "auto":
            return cls()
        parts = str(text).split(":")
        if len(parts) > 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ConfigError(f"speculate={text!r} is not auto, K_d or K_d:γ; e.g. --speculate "
                              f"auto, 2 or 2:4")
        values = [int(p) for p in parts]
        if len(values) == 2 and values[1] < 1:
            raise ConfigError(f"speculate={text!r}: γ={values[1]} drafted tokens per round must "
                              f"be >= 1")
        return cls(values[0], values[1] if len(values) == 2 else None)

    def check(self, model, schedule: tuple[int, ...]) -> None:
        """One-line errors for a MeshLM: no repeated core, K_d outside 1 … K−1, γ < 1."""
        layout, k = model.config.layout, len(schedule)
        if not layout.shares_weights and k == len(layout.cores):
            raise ConfigError(f"speculation drafts with the first loop passes of a repeated core, "
                              f"but spec {model.config.spec!r} repeats none; use a looped spec "
                              f"such as '2+2R4+2'")
        if self.draft_loops is not None and not 1 <= self.draft_loops < k:
            raise ConfigError(f"speculate K_d={self.draft_loops} must be in 1 … {k - 1}: the draft "
                              f"runs fewer loop passes than the model's K={k}")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise ConfigError(f"speculate γ={self.draft_tokens} drafted tokens per round must be "
                              f">= 1")


class Costs:
    """Seconds of each stage, by tokens in the call: `enter`, loop step k, `readout`, and overheads.

    Stages are timed while doing real work (meshlm.generate.timing). Costs at n tokens are
    interpolated linearly between the fewest and the most tokens measured; a step never measured at
    n borrows the mean of its core's measured steps. Answers are memoised until the next
    measurement: the planner asks for the same few hundreds each round."""

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
        return self.front(len(self.schedule)) + self.stage("readout", 1) + \
            self.stage("plain-overhead", 1)

    def round(self, k_d: int, gamma: int) -> float:
        n = gamma + 1
        draft = gamma * (self.front(k_d) + self.stage("readout", 1)) + self.front(k_d)
        verify = sum(self.stage(("step", k), n) for k in range(k_d, len(self.schedule))) + \
            self.stage("readout", n)
        return draft + verify + self.stage("round-overhead", n)

    @property
    def measured(self) -> bool:
        """PLAIN_SAMPLES plain steps have been timed: the first decode step after the prefill runs
        ~15-20% slower than the later ones (new shapes), and a plain token's cost is what every gain
        and loss is counted against."""
        return len(self.seen.get(("plain-overhead", 1), ())) >= PLAIN_SAMPLES


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round emits when each drafted token is accepted with probability α: Σ_{i≤γ} α^i."""
    return float(sum(alpha ** i for i in range(gamma + 1)))


def layer_bound(layout: Layout, schedule: tuple[int, ...], k_d: int) -> float:
    """Speed-up of K_d at perfect acceptance and γ = GAMMA_MAX, counting layers (the head as one, a
    verified token as a fed one): auto calibrates only the K_d that could reach MIN_GAIN."""
    front = layout.prelude + sum(layout.cores[c] for c in schedule[:k_d])
    rest = sum(layout.cores[c] for c in schedule[k_d:]) + layout.coda + 1
    plain, draft = front + rest, front + layout.coda + 1
    return (GAMMA_MAX + 1) * plain / (GAMMA_MAX * draft + front + rest)


class Planner:
    """Chooses each round's (K_d, γ), or None for a plain step, from measured costs and acceptance.
    `setting`, `acceptance_by_depth` and `predicted_speedup` report what it settled on."""

    def __init__(self, spec: Speculation, layout: Layout, schedule: tuple[int, ...],
                 new_tokens: int = 64):
        self.spec, self.k, self.new_tokens = spec, len(schedule), new_tokens
        self.loss = 0.0  # seconds the rounds so far took beyond what plain steps would have
        self.drafted: dict[int, int] = {}  # K_d -> tokens drafted in rounds so far (per row)
        self.costs = Costs(schedule)
        self.counts: dict[int, list[float]] = {}  # K_d -> [accepted, rejections]: prior + rounds
        self.auto = spec.draft_loops is None  # K_d chosen here: may explore, give up, go plain
        self.candidates = [spec.draft_loops] if not self.auto else \
            [k_d for k_d in range(1, self.k) if layer_bound(layout, schedule, k_d) >= MIN_GAIN]
        self.fixed = (spec.draft_loops, spec.draft_tokens) \
            if not self.auto and spec.draft_tokens else None
        self.final_read = {k_d: spec.final_read is not False for k_d in self.candidates}
        self.choice: tuple[int, int] | None = None
        self.plain_for_good = False  # auto found nothing that pays: plain decoding, untimed
        self.setting = f"K_d={spec.draft_loops} γ={spec.draft_tokens}" if self.fixed else ""
        self.acceptance_by_depth: dict[int, float] = {}  # K_d -> measured α
        self.predicted_speedup: float | None = None

    @property
    def calibrates(self) -> list[int]:
        """The depths whose prompt agreement the prefill should measure (none if all is fixed)."""
        return [] if self.spec.final_read is not None and self.fixed else self.candidates

    def calibrate(self, agreement: dict[tuple[int, bool], float], positions: int) -> None:
        """Prompt agreement of each (K_d, final_read) draft with the full model (the prefill's):
        pick each K_d's readout and start its acceptance estimate there."""
        for k_d in self.candidates:
            reads = [r for r in (True, False) if (k_d, r) in agreement]
            if not reads:
                continue
            self.final_read[k_d] = max(reads, key=lambda r: agreement[(k_d, r)])
            alpha = agreement[(k_d, self.final_read[k_d])]
            self.counts[k_d] = [alpha * positions, (1 - alpha) * positions]  # as if drafted there
            self.acceptance_by_depth[k_d] = self.alpha(k_d)

    def alpha(self, k_d: int) -> float:
        """Per-token acceptance: the geometric model's estimate, half a pseudo-count each way."""
        accepted, rejections = self.counts.get(k_d, (0, 0))
        return (accepted + 0.5) / (accepted + rejections + 1)

    def observe(self, k_d: int, accepted: torch.Tensor, gamma: int, seconds: float) -> None:
        """Per-row accepted counts of one round that took `seconds`; a row that stopped before γ saw
        one rejection."""
        self.loss += seconds - (1 + float(accepted.float().mean())) * self.costs.plain_token()
        self.drafted[k_d] = self.drafted.get(k_d, 0) + gamma
        counts = self.counts.setdefault(k_d, [0.0, 0.0])
        counts[0] += int(accepted.sum())
        counts[1] += int((accepted < gamma).sum())
        self.acceptance_by_depth[k_d] = self.alpha(k_d)

    def best(self, k_d: int, alpha: float) -> tuple[float, int]:
        """(predicted speed-up, γ) of the best draft length for K_d at acceptance α."""
        plain = self.costs.plain_token()
        gammas = [self.spec.draft_tokens] if self.spec.draft_tokens else range(1, GAMMA_MAX + 1)
        return max((expected_tokens(alpha, g) * plain / max(self.costs.round(k_d, g), 1e-12), g)
                   for g in gammas)

    def next(self) -> tuple[int, int] | None:
        if self.fixed:
            return self.fixed
        if self.plain_for_good or not self.costs.measured:
            return None  # plain decoding (at first, timed plain steps measure the stages)
        return self._settle()

    def _settle(self) -> tuple[int, int] | None:
        """Re-decided every round from the acceptance so far (the prompt's, then the rounds')."""
        scored = [(*self.best(k_d, self.alpha(k_d)), k_d) for k_d in self.candidates
                  if k_d in self.counts]
        self.choice = self._choose(max(scored)) if scored else None  # None: nothing to draft with
        self.plain_for_good = self.choice is None
        self.setting = "plain" if self.choice is None else \
            f"K_d={self.choice[0]} γ={self.choice[1]}"
        return self.choice

    def _choose(self, best: tuple[float, int, int]) -> tuple[int, int] | None:
        """The round to run from the best-scored (gain, γ, K_d); auto: None where it does not pay
        enough or even γ = 1 could take its loss past the budget."""
        gain, gamma, k_d = best
        self.predicted_speedup = gain
        if not self.auto:
            return k_d, gamma
        if self.drafted.get(k_d, 0) < EXPLORE_TOKENS:
            gamma = min(gamma, EXPLORE_GAMMA)  # still finding out what this K_d accepts
        if gain < (MIN_GAIN if self.choice is None else KEEP_GAIN):  # to start, to carry on
            return None
        plain = self.costs.plain_token()
        room = LOSS_BUDGET * self.new_tokens * plain - self.loss  # what a round may still lose
        fits = next((g for g in range(gamma, 0, -1) if self.costs.round(k_d, g) - plain <= room),
                    None)
        return None if fits is None else (k_d, fits)
