"""State-passing schemes: how the loop's state is updated around each core pass (docs/design.md).

The model runs one loop for every scheme (see meshlm.model.lm); a scheme only answers two questions:

    begin(e, p)        -> h⁰            the loop-entry state, from embeddings e and prelude output p
    update(t, h, u)    -> h^{t+1}       the next state, from h^t and the core output u = f_core(h^t)

Per-forward quantities (e, h⁰, the MeSH buffer, router weights) live in a `LoopContext`, never on
the module, so one model can run several forwards at once and incremental decoding needs no extra
cache.

A new scheme is one small class decorated with `@register("name")`; the test battery is parametrised
over `SCHEMES`, so it is tested for free. Its name and options (e.g. MeSH's slot count, with their
defaults and checks) are declared in meshlm.config.SCHEME_OPTIONS, where a config validates them
without importing the model; `self.options` holds the defaults overridden by
`ModelConfig.scheme_options`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from meshlm.config import SCHEME_OPTIONS, ModelConfig, canonical_scheme
from meshlm.model.registry import named_into

SCHEMES: dict[str, type[Scheme]] = {}


def register(name: str):
    """Class decorator: the scheme called `name` (declared, with its options, in
    meshlm.config.SCHEME_OPTIONS)."""
    if name not in SCHEME_OPTIONS:
        raise ValueError(f"scheme {name!r} has no entry in meshlm.config.SCHEME_OPTIONS; declare "
                         "its options there")

    return named_into(SCHEMES, name)


@dataclass
class LoopContext:
    """What one forward pass carries through the loop. Every field is per token — (B, T, ...)
    tensors, or lists of them — never mixing tokens, so decoding needs no cache for it and
    `concat_contexts` can join the contexts of consecutive runs (self-speculative decoding relies on
    both)."""

    e: torch.Tensor  # (B, T, d) scaled input embeddings
    h0: torch.Tensor | None = None  # (B, T, d) loop-entry state
    values: list[torch.Tensor] = field(default_factory=list)  # MeSH: e and every written state, (B,
    # T, d)
    coefficients: torch.Tensor | None = None  # MeSH: slot b = Σ_j coefficients[..., b, j]·values[j]
    # MeSH (write, read)
    routing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def map_contexts(fn, contexts: list[LoopContext]) -> LoopContext:
    """One context whose every per-token tensor is fn(the aligned tensors of `contexts`); fields
    are (B, T, ...) tensors, or lists of them or of tuples of them (one entry per write)."""
    def combine(parts):
        first = parts[0]
        if first is None:
            return None
        if isinstance(first, torch.Tensor):
            return fn(parts)
        if isinstance(first, tuple):
            return tuple(combine(list(group)) for group in zip(*parts))
        return [combine(list(group)) for group in zip(*parts)]  # a list: one entry per write

    return LoopContext(**{f.name: combine([getattr(c, f.name) for c in contexts])
                          for f in fields(LoopContext)})


def concat_contexts(contexts: list[LoopContext], dim: int = 1) -> LoopContext:
    """Join the contexts of consecutive token runs along T (dim 1), or of runs over other rows
    along B (dim 0); meshlm.model.run.LoopRun.join and LoopRun.stack join runs with it."""
    return map_contexts(lambda parts: torch.cat(parts, dim=dim), contexts)


class Scheme(nn.Module, abc.ABC):
    name: ClassVar[str] = ""
    # whether `update` reads the input (ctx.e or ctx.h0) at every step: what a delayed reveal of the
    # input (meshlm.model.reveal) needs to act after the loop has started
    reinjects: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.options: dict[str, Any] = {**SCHEME_OPTIONS[self.name].defaults, **cfg.scheme_options}

    def begin(self, ctx: LoopContext, p: torch.Tensor) -> torch.Tensor:
        ctx.h0 = p
        return p

    @abc.abstractmethod
    def update(self, t: int, h: torch.Tensor, u: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """h^{t+1} from h^t (B, T, d) and the core output u = f_core(h^t) (B, T, d)."""

    def early_exit(self, h: torch.Tensor, ctx: LoopContext, n_steps: int) -> torch.Tensor:
        """What the coda reads when the loop stops at state h, before the n_steps the model runs (a
        speculative draft). Only the draft uses it; the loop's own state is untouched. Default: h
        itself."""
        return h

    def truncate(self, ctx: LoopContext) -> None:
        """Truncated backprop is about to start (the steps so far ran without autograd): a scheme
        that carries one value per step (MeSH) may fold them to bound memory. Stateless schemes have
        nothing to do."""

    def flops_per_token(self, d_model: int, n_steps: int) -> int:
        """Forward FLOPs the scheme adds per token (beyond the layers)."""
        return 0

    def facts(self) -> dict[str, int]:
        """What parameter accounting reports about the scheme beyond its parameter count
        (meshlm.model.accounting: MeSH's slots and router pairs). Fixed schemes have nothing to
        add."""
        return {}


# -- fixed additive schemes: h^{t+1} = f_core(h^t) + Σ terms ---------------------------------------
class Additive(Scheme):
    TERMS: ClassVar[tuple[str, ...]] = ()  # any of "residual" (h^t), "anchor" (h⁰), "anchor-emb"
    # (e)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.reinjects = any(term != "residual" for term in cls.TERMS)

    def update(self, t, h, u, ctx):
        terms = {"residual": h, "anchor": ctx.h0, "anchor-emb": ctx.e}
        for term in self.TERMS:
            u = u + terms[term]
        return u

    def flops_per_token(self, d_model, n_steps):
        return len(self.TERMS) * d_model * n_steps


@register("base")
class Base(Additive):
    """Plain recursion: h^{t+1} = f_core(h^t)."""


@register("vanilla")
class Vanilla(Base):
    """No weight sharing: every layer distinct. Same computation as base; the layout may not repeat
    cores."""


@register("residual")
class Residual(Additive):
    TERMS = ("residual",)


@register("anchor")
class Anchor(Additive):
    TERMS = ("anchor",)


@register("anchor-emb")
class AnchorEmb(Additive):
    """anchor*: anchor to the scaled input embeddings e."""

    TERMS = ("anchor-emb",)


@register("residual+anchor")
class ResidualAnchor(Additive):
    TERMS = ("residual", "anchor")


@register("residual+anchor+anchor-emb")
class ResidualAnchorAnchorEmb(Additive):
    TERMS = ("residual", "anchor", "anchor-emb")


@register("anchor+anchor-emb")
class AnchorAnchorEmb(Additive):
    TERMS = ("anchor", "anchor-emb")


# -- learned combinations: h^{t+1} = α₁·f_core(h^t) + α₂·h⁰ + α₃·e ---------------------------------
class MixCoefficients(nn.Module):
    """Marker base for learned mixing coefficients (initialised by meshlm.model.init)."""


class StaticAlpha(MixCoefficients):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.alpha  # (3,), broadcast over tokens


class DynamicAlpha(MixCoefficients):
    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model, 3)  # per-token α from h^t

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)  # (B, T, 3)


class Mix(Scheme):
    """Option alpha_init: the initial α (init.py)."""

    reinjects = True

    def update(self, t, h, u, ctx):
        a = self.alpha(h).to(u.dtype)
        return a[..., 0:1] * u + a[..., 1:2] * ctx.h0 + a[..., 2:3] * ctx.e

    def flops_per_token(self, d_model, n_steps):
        return 5 * d_model * n_steps  # three scalings and two additions per element


@register("static-mix")
class StaticMix(Mix):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = StaticAlpha()


@register("dynamic-mix")
class DynamicMix(Mix):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = DynamicAlpha(cfg.d_model)

    def flops_per_token(self, d_model, n_steps):
        return super().flops_per_token(d_model, n_steps) + n_steps * 3 * (2 * d_model + 1)


def build_scheme(cfg: ModelConfig) -> Scheme:
    """The scheme module of a validated config (meshlm.model imports meshlm.model.memory, which adds
    "mesh")."""
    return SCHEMES[canonical_scheme(cfg.scheme)](cfg)
