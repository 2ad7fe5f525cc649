"""How many loop steps each training step runs (`train.loops`), drawn from (seed, step) alone.

    fixed                          the spec's K every step (today's training, bit for bit)
    fixed:N                        N every step
    uniform:LO-HI                  uniform over LO … HI (inclusive)
    poisson-lognormal:mean=M,cap=C[,sigma=S]
                                   Huginn's recurrence sampler: λ = exp(τ), τ ~ N(log(M − 1) −
                                   S²/2, S), and n = 1 + Poisson(λ), clipped to C. E[λ] = M − 1, so
                                   E[n] = M before the clip (S = 0.5 as in Huginn); n ≥ 1 always.

Every data-parallel rank draws from a generator seeded with (train.seed, step), so all ranks run the
same count at the same step (DDP/FSDP stay in lockstep) and a resumed run draws exactly what the
uninterrupted one did. All micro-batches of one optimizer step share its count. `cap` is the largest
count the distribution can draw. The trainer builds the model with `max_loops` = `horizon`, the
distribution's 95th percentile (at least K): MeSH has one router pair per step up to it and reuses
the last pair beyond, in training and at any depth afterwards. A pair for a step that only the
rarest draws reach would hardly be trained (mean 4, cap 16: P(n >= 12) = 1%) and would read noise at
depth; measured in docs/depth.md ("The router horizon matters").
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np

from meshlm.errors import ConfigError

FORMS = ("fixed, fixed:N, uniform:LO-HI or poisson-lognormal:mean=M,cap=C[,sigma=S] "
         "(e.g. poisson-lognormal:mean=4,cap=16)")
_SALT = 0x6C6F6F7073  # "loops": keeps this stream apart from every other use of the seed
# per-step parameters up to the count that 95% of training steps stay within
HORIZON_QUANTILE = 0.95


@dataclass(frozen=True)
class LoopDistribution:
    kind: str  # "fixed", "uniform" or "poisson-lognormal"
    low: int = 0  # fixed: N (0 = the spec's K); uniform: LO
    high: int = 0  # uniform: HI; poisson-lognormal: the cap
    mean: float = 0.0  # poisson-lognormal
    sigma: float = 0.5

    @property
    def sampled(self) -> bool:
        return self.kind != "fixed"

    def cap(self, k: int) -> int:
        """The largest count ever drawn (k = the spec's loop steps)."""
        return (self.low or k) if self.kind == "fixed" else self.high

    def horizon(self, k: int) -> int:
        """The deepest step count with its own per-step parameters: the HORIZON_QUANTILE of the
        counts drawn, at least k, at most the cap."""
        return self.cap(k) if self.kind == "fixed" else _horizon(self, k)

    def draw(self, seed: int, step: int) -> int | None:
        """The loop count of optimizer step `step`; None = the model's own K (plain `fixed`)."""
        if self.kind == "fixed":
            return self.low or None
        rng = np.random.default_rng([seed, step, _SALT])
        if self.kind == "uniform":
            return int(rng.integers(self.low, self.high + 1))
        rate = (math.exp(rng.normal(math.log(self.mean - 1) - self.sigma ** 2 / 2, self.sigma))
                if self.mean > 1 else 0.0)
        return int(min(1 + rng.poisson(rate), self.high))


@functools.lru_cache(maxsize=64)
def _horizon(dist: LoopDistribution, k: int) -> int:
    """LoopDistribution.horizon, from a fixed-seed sample of 100,000 counts drawn as `draw` draws
    them (~10 ms, so once per distribution: TrainConfig.derive_model asks on every call)."""
    rng = np.random.default_rng(_SALT)
    if dist.kind == "uniform":
        counts = rng.integers(dist.low, dist.high + 1, size=100_000)
    else:
        rates = (np.exp(rng.normal(math.log(dist.mean - 1) - dist.sigma ** 2 / 2, dist.sigma,
                                   size=100_000))
                 if dist.mean > 1 else np.zeros(100_000))
        counts = np.minimum(1 + rng.poisson(rates), dist.high)
    return int(min(dist.high, max(k, math.ceil(np.quantile(counts, HORIZON_QUANTILE)))))


def parse_loops(text: str) -> LoopDistribution:
    """`train.loops` -> a LoopDistribution; ConfigError naming the valid forms otherwise."""
    text = str(text).strip().lower()
    kind, _, args = text.partition(":")
    try:
        if kind == "fixed":
            dist = LoopDistribution("fixed", low=int(args) if args else 0)
            ok = not args or dist.low >= 1
        elif kind == "uniform":
            m = re.fullmatch(r"(\d+)-(\d+)", args)
            dist = LoopDistribution("uniform", low=int(m.group(1)), high=int(m.group(2)))
            ok = 1 <= dist.low <= dist.high
        elif kind == "poisson-lognormal":
            values = dict(item.split("=", 1) for item in args.split(","))
            if set(values) - {"mean", "cap", "sigma"} or not {"mean", "cap"} <= set(values):
                raise ValueError
            dist = LoopDistribution(kind, high=int(values["cap"]), mean=float(values["mean"]),
                                    sigma=float(values.get("sigma", 0.5)))
            if dist.high < dist.mean:
                raise ConfigError(f"train.loops={text!r}: cap={dist.high} is below "
                                  f"mean={dist.mean:g}; the cap must be >= the mean (valid: "
                                  f"{FORMS})")
            ok = dist.mean >= 1 and dist.sigma >= 0
        else:
            ok = False
    except ConfigError:
        raise
    except (ValueError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ConfigError(f"train.loops={text!r} is not a loop distribution; use {FORMS} (counts "
                          ">= 1)")
    return dist
