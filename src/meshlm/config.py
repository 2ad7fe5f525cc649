"""Model configuration: one flat, JSON-serialisable dataclass, spec-string parsing and named presets.

A spec string describes the layer layout of a Prelude–Recurrent–Coda model (spec §2):

    "4+8R2+4"    prelude of 4 layers, one core of 8 layers run 2 times (shared weights), coda of 4
    "4+8+8+4"    prelude 4, two different cores of 8 layers run once each, coda 4 (non-shared)
    "24"         a plain 24-layer stack: one core of 24 layers run once (vanilla)

Tokens are separated by "+"; the first is the prelude, the last the coda, every token between is a core
("C" or "CrK", r/R case-insensitive). The loop runs the cores in order, each K times; one *step* is one
core pass, so `n_steps` = ΣK. Unrolled (compute) depth = P + ΣC·K + D; unique depth = P + ΣC + D.

Every invalid field is reported at once, in one `ConfigError` message that says what would be valid.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

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


def parse_spec(spec: str) -> Layout:
    """Parse "P+CrK+D", "P+C1+C2+…+D" or "N"; raise ConfigError with the grammar on failure."""
    grammar = 'use "P+CrK+D" (e.g. "4+8R2+4"), "P+C1+C2+D" (e.g. "4+8+8+4") or "N" (e.g. "24")'
    tokens = str(spec).replace(" ", "").split("+")
    if len(tokens) == 2 or any(t == "" for t in tokens):
        raise ConfigError(f"spec {spec!r} is malformed: {grammar}")
    ends, middle = (("0", "0"), tokens) if len(tokens) == 1 else ((tokens[0], tokens[-1]), tokens[1:-1])
    if not all(t.isdigit() for t in ends):
        raise ConfigError(f"spec {spec!r}: prelude and coda must be layer counts >= 0; {grammar}")
    cores, repeats = [], []
    for tok in middle:
        m = _CORE.match(tok)
        if not m:
            raise ConfigError(f"spec {spec!r}: core {tok!r} is not C or CrK; {grammar}")
        c, k = int(m.group(1)), int(m.group(2) or 1)
        if c < 1 or k < 1:
            raise ConfigError(f"spec {spec!r}: core {tok!r} needs >= 1 layer run >= 1 time; {grammar}")
        cores.append(c)
        repeats.append(k)
    return Layout(int(ends[0]), tuple(cores), tuple(repeats), int(ends[1]))


@dataclass
class ModelConfig:
    """Everything that defines a meshlm model. Plain values only, so it round-trips through JSON."""

    spec: str = "2+4R2+2"
    d_model: int = 256
    n_heads: int = 8
    vocab_size: int = 8192
    context_length: int = 512
    rotary_pct: float = 0.25  # Pythia rotates the first 25% of each head's dims
    rotary_base: float = 10000.0
    layer_norm_eps: float = 1e-5
    mlp_ratio: int = 4
    scheme: str = "mesh"  # a name in meshlm.model.schemes.SCHEMES
    scheme_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"slots": 5} for mesh
    scale_embeddings: bool = True  # MeSH paper: embeddings × √d (Pythia: off)
    init_std: float = 0.02
    scale_output_init: bool = True  # output projections × 1/√(2·unrolled depth) (MeSH paper)
    router_init_std: float = 0.02  # routers start near-uniform (spec §8)

    def __post_init__(self) -> None:
        self.validate()

    # -- derived -------------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return parse_spec(self.spec)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    # -- validation ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Collect every problem, then raise one ConfigError naming each bad field."""
        problems = []
        layout = None
        try:
            layout = parse_spec(self.spec)
        except ConfigError as err:
            problems.append(str(err))

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need(_is_int(self.d_model) and self.d_model > 0, f"d_model={self.d_model!r} must be a positive integer")
        need(_is_int(self.n_heads) and self.n_heads > 0, f"n_heads={self.n_heads!r} must be a positive integer")
        if _is_int(self.d_model) and _is_int(self.n_heads) and self.n_heads > 0 and self.d_model > 0:
            need(self.d_model % self.n_heads == 0,
                 f"n_heads={self.n_heads} must divide d_model={self.d_model} (e.g. n_heads="
                 f"{_divisor_near(self.d_model, self.n_heads)})")
            if self.d_model % self.n_heads == 0:
                need(self.rotary_dims % 2 == 0,
                     f"rotary_pct={self.rotary_pct} gives {self.rotary_dims} rotary dims per head; "
                     "it must be even (head_dim × rotary_pct)")
        need(_is_int(self.vocab_size) and self.vocab_size > 1, f"vocab_size={self.vocab_size!r} must be >= 2")
        need(_is_int(self.context_length) and self.context_length > 0,
             f"context_length={self.context_length!r} must be a positive integer")
        need(0.0 <= self.rotary_pct <= 1.0, f"rotary_pct={self.rotary_pct} must be in [0, 1]")
        need(self.rotary_base > 0, f"rotary_base={self.rotary_base} must be > 0")
        need(self.layer_norm_eps > 0, f"layer_norm_eps={self.layer_norm_eps} must be > 0")
        need(_is_int(self.mlp_ratio) and self.mlp_ratio > 0, f"mlp_ratio={self.mlp_ratio!r} must be >= 1")
        need(self.init_std > 0, f"init_std={self.init_std} must be > 0")
        need(self.router_init_std >= 0, f"router_init_std={self.router_init_std} must be >= 0")
        need(isinstance(self.scheme_options, dict), "scheme_options must be a mapping")
        if isinstance(self.scheme_options, dict):
            from meshlm.model.schemes import scheme_problems  # the registry knows each scheme's options

            problems.extend(scheme_problems(self.scheme, self.scheme_options, layout))
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    # -- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        return self.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _divisor_near(n: int, target: int) -> int:
    return min((k for k in range(1, n + 1) if n % k == 0), key=lambda k: abs(k - target))


# -- presets -----------------------------------------------------------------------------------------
# Pythia shapes (spec §2 table). Pythia pads the vocabulary to 50,304 rows and uses 2048-token contexts;
# the paper trains at 4096. `pythia-*` presets are vanilla stacks; `pythia-*-<spec>` are the paper's
# recursive splits, MeSH by default (pick any other scheme with scheme=...).
_PYTHIA = {  # name: (layers, d_model, heads)
    "70m": (6, 512, 8),
    "160m": (12, 768, 12),
    "410m": (24, 1024, 16),
    "1b": (16, 2048, 8),
    "1.4b": (24, 2048, 16),
    "2.8b": (32, 2560, 32),
    "6.9b": (32, 4096, 32),
}
_PAPER_SPLITS = {
    "160m": ["2+4R2+2"],
    "410m": ["4+8R2+4", "3+6R3+3"],
    "1b": ["3+5R2+3"],
    "1.4b": ["4+8R2+4", "4+8+8+4"],
    "2.8b": ["6+10R2+6"],
    "6.9b": ["6+10R2+6"],
}


def _pythia(size: str, spec: str | None) -> dict[str, Any]:
    layers, d, heads = _PYTHIA[size]
    base = dict(d_model=d, n_heads=heads, vocab_size=50304, context_length=4096)
    if spec is None:
        return {**base, "spec": str(layers), "scheme": "vanilla"}
    return {**base, "spec": spec, "scheme": "mesh"}


PRESETS: dict[str, dict[str, Any]] = {
    **{f"pythia-{s}": _pythia(s, None) for s in _PYTHIA},
    **{f"pythia-{s}-{spec}": _pythia(s, spec) for s, specs in _PAPER_SPLITS.items() for spec in specs},
    # CPU scale. `tiny` is for tests; `mesh-small` is what `meshlm train` trains by default.
    "tiny": dict(spec="1+2R2+1", d_model=64, n_heads=4, vocab_size=512, context_length=128),
    "mesh-small": dict(spec="2+4R2+2", d_model=256, n_heads=8, vocab_size=8192, context_length=256),
    "vanilla-small": dict(spec="12", d_model=256, n_heads=8, vocab_size=8192, context_length=256,
                          scheme="vanilla"),
}
