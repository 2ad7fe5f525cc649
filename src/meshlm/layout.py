"""The layer layout of a Prelude–Recurrent–Coda model, parsed from a spec string (docs/design.md):

    "4+8R2+4"    prelude of 4 layers, one core of 8 layers run 2 times (shared weights), coda of 4
    "4+8+8+4"    prelude 4, two different cores of 8 layers run once each, coda 4 (non-shared)
    "24"         a plain 24-layer stack: one core of 24 layers run once (vanilla)

Tokens are separated by "+"; the first is the prelude, the last the coda, every token between is a
core ("C" or "CrK", r/R case-insensitive). The loop runs the cores in order, each K times; one
*step* is one core pass, so `n_steps` = ΣK. Unrolled (compute) depth = P + ΣC·K + D; unique depth =
P + ΣC + D.

A model config (meshlm.config.ModelConfig.layout) parses its `spec` here; nothing here needs torch.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from meshlm.errors import ConfigError

_CORE = re.compile(r"^(\d+)(?:[rR](\d+))?$")


@dataclass(frozen=True)
class Layout:
    """The parsed spec: layer counts only, no weights."""

    prelude: int
    cores: tuple[int, ...]  # layers of each distinct core
    repeats: tuple[int, ...]  # how many times each core runs
    coda: int

    @property
    def schedule(self) -> tuple[int, ...]:
        """Core index for every loop step, e.g. (0, 0) for "4+8R2+4", (0, 1) for "4+8+8+4"."""
        return tuple(i for i, k in enumerate(self.repeats) for _ in range(k))

    @property
    def n_steps(self) -> int:
        return sum(self.repeats)

    @property
    def unique_depth(self) -> int:
        return self.prelude + sum(self.cores) + self.coda

    @property
    def unrolled_depth(self) -> int:
        return self.prelude + sum(c * k for c, k in zip(self.cores, self.repeats)) + self.coda

    @property
    def shares_weights(self) -> bool:
        return any(k > 1 for k in self.repeats)


@functools.lru_cache(maxsize=256)
def parse_spec(spec: str) -> Layout:
    """Parse "P+CrK+D", "P+C1+C2+…+D" or "N"; raise ConfigError with the grammar on failure. Cached
    (the Layout is frozen): `ModelConfig.layout` is read on every forward, and decoding runs many
    small ones."""
    grammar = 'use "P+CrK+D" (e.g. "4+8R2+4"), "P+C1+C2+D" (e.g. "4+8+8+4") or "N" (e.g. "24")'
    tokens = str(spec).replace(" ", "").split("+")
    if len(tokens) == 2 or any(t == "" for t in tokens):
        raise ConfigError(f"spec {spec!r} is malformed: {grammar}")
    ends, middle = ((("0", "0"), tokens) if len(tokens) == 1
                    else ((tokens[0], tokens[-1]), tokens[1:-1]))
    if not all(t.isdigit() for t in ends):
        raise ConfigError(f"spec {spec!r}: prelude and coda must be layer counts >= 0; {grammar}")
    cores, repeats = [], []
    for tok in middle:
        m = _CORE.match(tok)
        if not m:
            raise ConfigError(f"spec {spec!r}: core {tok!r} is not C or CrK; {grammar}")
        c, k = int(m.group(1)), int(m.group(2) or 1)
        if c < 1 or k < 1:
            raise ConfigError(f"spec {spec!r}: core {tok!r} needs >= 1 layer run >= 1 time; "
                              f"{grammar}")
        cores.append(c)
        repeats.append(k)
    return Layout(int(ends[0]), tuple(cores), tuple(repeats), int(ends[1]))
