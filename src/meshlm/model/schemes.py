"""State-passing schemes: how the loop's state is updated around each core pass (spec §3).

The model runs one loop for every scheme (see meshlm.model.lm); a scheme only answers two questions:

    begin(e, p)        -> h⁰            the loop-entry state, from embeddings e and prelude output p
    update(t, h, u)    -> h^{t+1}       the next state, from h^t and the core output u = f_core(h^t)

Per-forward quantities (e, h⁰, the MeSH buffer, router weights) live in a `LoopContext`, never on the
module, so one model can run several forwards at once and incremental decoding needs no extra cache.

A new scheme is one small class decorated with `@register("name")`; the test battery is parametrised over
`SCHEMES`, so it is tested for free. Options (e.g. MeSH's slot count) come from `ModelConfig.scheme_options`
and are declared in the class's `OPTIONS` with their defaults.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from meshlm.config import Layout, ModelConfig

SCHEMES: dict[str, type[Scheme]] = {}
ALIASES = {"anchor*": "anchor-emb", "residual+anchor+anchor*": "residual+anchor+anchor-emb",
           "anchor+anchor*": "anchor+anchor-emb"}


def register(name: str):
    def wrap(cls: type[Scheme]) -> type[Scheme]:
        cls.name = name
        SCHEMES[name] = cls
        return cls

    return wrap


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


@dataclass
class LoopContext:
    """What one forward pass carries through the loop. Every field is per token — (B, T, ...) tensors, or
    lists of them — never mixing tokens, so decoding needs no cache for it and `concat_contexts` can join
    the contexts of consecutive runs (self-speculative decoding relies on both)."""

    e: torch.Tensor  # (B, T, d) scaled input embeddings
    h0: torch.Tensor | None = None  # (B, T, d) loop-entry state
    values: list[torch.Tensor] = field(default_factory=list)  # MeSH: e and every written state, (B, T, d)
    coefficients: torch.Tensor | None = None  # MeSH: slot b = Σ_j coefficients[..., b, j]·values[j]
    routing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # MeSH (write, read)


def concat_contexts(contexts: list[LoopContext]) -> LoopContext:
    """Join the contexts of consecutive token runs along T (dim 1): every field is per token, (B, T, ...),
    or a list of such tensors or of tuples of them (one entry per write). Speculative decoding joins the
    one-token draft runs this way and resumes the loop over all of them at once."""
    def join(parts):
        first = parts[0]
        if first is None:
            return None
        if isinstance(first, torch.Tensor):
            return torch.cat(parts, dim=1)
        if isinstance(first, tuple):
            return tuple(join(list(group)) for group in zip(*parts))
        return [join(list(group)) for group in zip(*parts)]  # a list: one entry per write

    return LoopContext(**{f.name: join([getattr(c, f.name) for c in contexts]) for f in fields(LoopContext)})


class Scheme(nn.Module, abc.ABC):
    name: ClassVar[str] = ""
    OPTIONS: ClassVar[dict[str, Any]] = {}  # option name -> default

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.options = {**self.OPTIONS, **cfg.scheme_options}

    @classmethod
    def problems(cls, options: dict[str, Any], layout: Layout | None) -> list[str]:
        """Human-readable problems with these options on this layout (None: the spec is invalid)."""
        unknown = sorted(set(options) - set(cls.OPTIONS))
        if unknown:
            valid = sorted(cls.OPTIONS) or "none"
            return [f"scheme_options {unknown} are not options of scheme {cls.name!r} (valid: {valid})"]
        return []

    def begin(self, ctx: LoopContext, p: torch.Tensor) -> torch.Tensor:
        ctx.h0 = p
        return p

    @abc.abstractmethod
    def update(self, t: int, h: torch.Tensor, u: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """h^{t+1} from h^t (B, T, d) and the core output u = f_core(h^t) (B, T, d)."""

    def flops_per_token(self, d_model: int, n_steps: int) -> int:
        """Forward FLOPs the scheme adds per token (beyond the layers)."""
        return 0


# -- fixed additive schemes: h^{t+1} = f_core(h^t) + Σ terms ---------------------------------------------
class Additive(Scheme):
    TERMS: ClassVar[tuple[str, ...]] = ()  # any of "residual" (h^t), "anchor" (h⁰), "anchor-emb" (e)

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
    """No weight sharing: every layer distinct. Same computation as base; the layout may not repeat cores."""

    @classmethod
    def problems(cls, options, layout):
        extra = ["scheme 'vanilla' shares no weights, but the spec repeats a core; use scheme 'base' (or "
                 "another scheme) for a looped core, or a spec without R"] if layout and layout.shares_weights else []
        return super().problems(options, layout) + extra


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


# -- learned combinations: h^{t+1} = α₁·f_core(h^t) + α₂·h⁰ + α₃·e ----------------------------------------
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
    OPTIONS = {"alpha_init": [1.0, 1.0, 0.0]}

    @classmethod
    def problems(cls, options, layout):
        out = super().problems(options, layout)
        a = options.get("alpha_init", cls.OPTIONS["alpha_init"])
        if not (isinstance(a, (list, tuple)) and len(a) == 3 and all(isinstance(x, (int, float)) for x in a)):
            out.append(f"scheme_options.alpha_init={a!r} must be 3 numbers (core, anchor h⁰, embeddings e)")
        return out

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


def scheme_problems(name: str, options: dict[str, Any], layout: Layout | None) -> list[str]:
    from meshlm.model import memory  # noqa: F401  (registers "mesh")

    cls = SCHEMES.get(canonical(name))
    if cls is None:
        return [f"scheme={name!r} is unknown; choose one of: {', '.join(sorted(SCHEMES))} (or 'anchor*')"]
    return cls.problems(options, layout)


def build_scheme(cfg: ModelConfig) -> Scheme:
    from meshlm.model import memory  # noqa: F401  (registers "mesh")

    return SCHEMES[canonical(cfg.scheme)](cfg)
