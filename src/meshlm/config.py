"""Model configuration: one flat, JSON-serialisable dataclass.

Named presets are in meshlm.presets (`ModelConfig.from_preset`). The spec string ("4+8R2+4": prelude
+ core run K times + coda) is parsed into a `Layout` by meshlm.layout (`parse_spec`, which
describes the grammar); both are importable from here too.

The layer kind is `backbone` (docs/backbones.md): "neox" (Pythia: LayerNorm, parallel residual, GELU
MLP, biases, partial rotary), "llama" (RMSNorm, sequential residual, SwiGLU, no biases, full rotary,
grouped-query attention) or "olmoe" (Llama-style attention with QK-norm and a top-k routed mixture
of SwiGLU experts). Fields left at None take the backbone's default (`rotary_fraction`, `kv_heads`,
`mlp_width`, `uses_qk_norm`); each backbone's defaults and checks are its own, in the registry
meshlm.backbones.

Every invalid field is reported at once, in one `ConfigError` message that says what would be valid.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshlm.backbones import BACKBONES
from meshlm.errors import ConfigError
from meshlm.fields import build, coerce_all, did_you_mean, type_problems, with_defaults
from meshlm.layout import Layout, parse_spec
from meshlm.presets import PRESETS

PREFIX = "invalid model config: "


@dataclass
class ModelConfig:
    """Everything that defines a meshlm model. Plain values only, so it round-trips through JSON."""

    spec: str = "2+4R2+2"  # layers: prelude + core (R = loop steps K) + coda, e.g. 4+8R2+4
    # (parse_spec)
    d_model: int = 256  # hidden width
    n_heads: int = 8  # attention heads (head dim = d_model / n_heads)
    vocab_size: int = 8192  # token ids: the tokenizer's vocabulary (the shipped one has 8,192)
    context_length: int = 512  # the longest sequence, in tokens
    backbone: str = "neox"  # a name in meshlm.backbones.BACKBONES
    rotary_pct: float | None = None  # None -> 0.25 for neox (Pythia), 1.0 (every head dim) for
    # llama/olmoe
    rotary_base: float = 10000.0  # RoPE base frequency
    layer_norm_eps: float = 1e-5  # eps of every norm: LayerNorm (neox) or RMSNorm (llama, olmoe)
    mlp_ratio: int = 4  # sets the MLP width when mlp_hidden is None (see `mlp_width`)
    mlp_hidden: int | None = None  # MLP width (per expert for olmoe); None -> the backbone's rule
    n_kv_heads: int | None = None  # grouped-query attention (llama/olmoe); None -> n_heads
    qk_norm: bool | None = None  # RMSNorm on the q and k projections (llama/olmoe); None -> olmoe
    # only
    tie_embeddings: bool = False  # the output layer reuses the input embedding matrix (Pythia,
    # OLMoE: no)
    n_experts: int = 8  # olmoe: routed experts per layer (OLMoE-1B-7B: 64)
    top_k: int = 2  # olmoe: experts per token (OLMoE-1B-7B: 8)
    norm_topk_prob: bool = False  # olmoe: renormalise the top-k router probabilities to sum to 1
    # (OLMoE: no)
    aux_loss_weight: float = 0.01  # olmoe: load-balancing loss weight in the training loss (OLMoE:
    # 0.01)
    z_loss_weight: float = 0.001  # olmoe: router z-loss weight in the training loss (OLMoE: 0.001)
    scheme: str = "mesh"  # a name in SCHEME_OPTIONS (the classes: meshlm.model.schemes.SCHEMES)
    scheme_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"slots": 5} for mesh
    max_loops: int | None = None  # deepest loop count with its own per-step parameters (MeSH: one
    # router pair per step up to it, the last pair beyond); None -> the spec's K. Set by train.loops
    # sampling to its cap
    loop_lora_rank: int = 0  # per-loop LoRA (relaxed recursion, meshlm.model.loop_lora): each pass
    # of a shared core adds its own rank-r delta to the targeted Linears; 0 = off
    loop_lora_alpha: float | None = None  # deltas are scaled by alpha / rank; None -> alpha = rank
    # (scale 1)
    loop_lora_targets: str = "attention,mlp"  # roles (attention, mlp) or layer-local Linear names,
    # comma-separated
    scale_embeddings: bool = True  # MeSH paper: embeddings × √d (Pythia: off)
    init_std: float = 0.02  # std of the normal weight init (meshlm.model.init)
    scale_output_init: bool = True  # output projections × 1/√(2·unrolled depth) (MeSH paper)
    router_init_std: float = 0.02  # routers start near-uniform (docs/design.md)

    def __post_init__(self) -> None:
        self.validate()

    # -- derived -----------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return parse_spec(self.spec)

    @property
    def loop_cap(self) -> int:
        """max_loops, or the spec's K: how many loop steps have their own scheme parameters."""
        return self.max_loops if self.max_loops is not None else parse_spec(self.spec).n_steps

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary_fraction(self) -> float:
        if self.rotary_pct is not None:
            return self.rotary_pct
        return BACKBONES[self.backbone].rotary_fraction

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_width(self) -> int:
        """Hidden width of the MLP (of each expert for MoE): mlp_hidden, else the backbone's rule
        from mlp_ratio (neox mlp_ratio·d as Pythia; llama ⌈⅔·mlp_ratio·d / 64⌉·64; olmoe mlp_ratio·d
        / 8 = d/2)."""
        return (self.mlp_hidden if self.mlp_hidden is not None
                else BACKBONES[self.backbone].mlp_width(self))

    @property
    def uses_qk_norm(self) -> bool:
        return BACKBONES[self.backbone].qk_norm if self.qk_norm is None else bool(self.qk_norm)

    # -- validation --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Collect every problem (types first, then values), then raise one ConfigError naming each
        bad field."""
        problems, wrong_type = type_problems(self)
        problems += with_defaults(self, wrong_type)._value_problems()
        if problems:
            raise ConfigError(PREFIX + "; ".join(problems))

    def _value_problems(self) -> list[str]:
        """Range and consistency problems; every field holds a value of its type here."""
        problems = []
        layout = None
        try:
            layout = parse_spec(self.spec)
        except ConfigError as err:
            problems.append(str(err))

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need(_is_int(self.d_model) and self.d_model > 0,
             f"d_model={self.d_model!r} must be a positive integer")
        need(_is_int(self.n_heads) and self.n_heads > 0,
             f"n_heads={self.n_heads!r} must be a positive integer")
        if (_is_int(self.d_model) and _is_int(self.n_heads) and self.n_heads > 0
            and self.d_model > 0):
            need(self.d_model % self.n_heads == 0,
                 f"n_heads={self.n_heads} must divide d_model={self.d_model} (e.g. n_heads="
                 f"{_divisor_near(self.d_model, self.n_heads)})")
            if (self.d_model % self.n_heads == 0 and self._known_backbone()
                and _is_number(self.rotary_fraction)):
                need(self.rotary_dims % 2 == 0,
                     f"rotary_pct={self.rotary_fraction} gives {self.rotary_dims} rotary dims per "
                     "head; it must be even (head_dim × rotary_pct)")
        need(_is_int(self.vocab_size) and self.vocab_size > 1,
             f"vocab_size={self.vocab_size!r} must be >= 2")
        need(_is_int(self.context_length) and self.context_length > 0,
             f"context_length={self.context_length!r} must be a positive integer")
        need(self.rotary_pct is None
             or (_is_number(self.rotary_pct) and 0.0 <= self.rotary_pct <= 1.0),
             f"rotary_pct={self.rotary_pct} must be in [0, 1] (or null for the backbone's default)")
        need(self.rotary_base > 0, f"rotary_base={self.rotary_base} must be > 0")
        need(self.layer_norm_eps > 0, f"layer_norm_eps={self.layer_norm_eps} must be > 0")
        need(_is_int(self.mlp_ratio) and self.mlp_ratio > 0,
             f"mlp_ratio={self.mlp_ratio!r} must be >= 1")
        problems.extend(self._backbone_problems())
        problems.extend(self._max_loops_problems(layout))
        problems.extend(self._loop_lora_problems(layout))
        need(self.init_std > 0, f"init_std={self.init_std} must be > 0")
        need(self.router_init_std >= 0, f"router_init_std={self.router_init_std} must be >= 0")
        need(isinstance(self.scheme_options, dict), "scheme_options must be a mapping")
        if isinstance(self.scheme_options, dict):
            problems.extend(scheme_problems(self.scheme, self.scheme_options, layout))
        return problems

    def _max_loops_problems(self, layout: Layout | None) -> list[str]:
        m = self.max_loops
        if m is None or layout is None:
            return []
        if not (_is_int(m) and m >= layout.n_steps):
            return [f"max_loops={m!r} must be an integer >= the spec's {layout.n_steps} loop steps "
                    "(or null)"]
        if m > layout.n_steps and len(layout.cores) != 1:
            return [f"max_loops={m} needs a single-core spec (one core run K times, e.g. "
                    f"\"2+2R2+2\"), not {self.spec!r}"]
        return []

    def _loop_lora_problems(self, layout: Layout | None) -> list[str]:
        r = self.loop_lora_rank
        if not (_is_int(r) and r >= 0):
            return [f"loop_lora_rank={r!r} must be an integer >= 0 (0 = no per-loop LoRA)"]
        if r == 0 or layout is None:
            return []
        out = []
        if not (layout.shares_weights or self.loop_cap > layout.n_steps):
            out.append(f"loop_lora_rank={r} needs a shared core (a spec that repeats one, e.g. "
                       f"\"2+2R2+2\"), but {self.spec!r} runs every core once; set "
                       "loop_lora_rank=0 or loop a core")
        if self.loop_lora_alpha is not None and not self.loop_lora_alpha > 0:
            out.append(f"loop_lora_alpha={self.loop_lora_alpha} "
                       "must be > 0 (or null: alpha = rank)")
        if not self.loop_lora_targets.strip(","):
            out.append("loop_lora_targets is empty; name roles (attention, mlp) or Linear names")
        return out

    def _backbone_problems(self) -> list[str]:
        """Problems with the backbone and the fields only some backbones use (the backbone checks
        those)."""
        if not self._known_backbone():
            return [f"backbone={self.backbone!r} is unknown; choose one of: {', '.join(BACKBONES)}"]
        out, kv = [], self.n_kv_heads
        if self.mlp_hidden is not None and not (_is_int(self.mlp_hidden) and self.mlp_hidden > 0):
            out.append(f"mlp_hidden={self.mlp_hidden!r} must be a positive integer (or null for "
                       "the default)")
        if (kv is not None
            and not (_is_int(kv) and kv > 0 and _is_int(self.n_heads) and self.n_heads % kv == 0)):
            out.append(f"n_kv_heads={kv!r} must be a positive divisor of n_heads={self.n_heads} "
                       "(or null)")
        for name in ("aux_loss_weight", "z_loss_weight"):
            if not (_is_number(getattr(self, name)) and getattr(self, name) >= 0):
                out.append(f"{name}={getattr(self, name)!r} must be a number >= 0")
        return out + BACKBONES[self.backbone].problems(self)

    def _known_backbone(self) -> bool:
        return isinstance(self.backbone, str) and self.backbone in BACKBONES

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """From YAML/JSON values: each coerced to its field's type (meshlm.fields); every problem in
        one error."""
        if not isinstance(data, dict):
            raise ConfigError("a model config must be a mapping of fields, not "
                              f"{type(data).__name__} {data!r}")
        values, problems = coerce_all(cls, data, "model config")
        return build(cls, values, problems, PREFIX)

    def replace(self, **changes: Any) -> ModelConfig:
        return self.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_preset(cls, name: str, /, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}{did_you_mean([name], PRESETS)}; choose one "
                              f"of: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _divisor_near(n: int, target: int) -> int:
    return min((k for k in range(1, n + 1) if n % k == 0), key=lambda k: abs(k - target))


# -- schemes: the names `scheme` may take and the options each accepts -----------------------------
# The scheme classes are in meshlm.model.schemes (MeSH in meshlm.model.memory); each registers under
# a name declared here, so a config checks its scheme without importing the model (which imports
# this module).
@dataclass(frozen=True)
class SchemeOptions:
    """One scheme's `scheme_options`: their defaults, and a check of their values on a layout."""

    defaults: dict[str, Any] = field(default_factory=dict)
    check: Callable[[dict[str, Any], Layout | None], list[str]] | None = None  # layout None: the
    # spec is invalid

    def problems(self, name: str, options: dict[str, Any], layout: Layout | None) -> list[str]:
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            valid = sorted(self.defaults) or "none"
            return [f"scheme_options {unknown} are not options of scheme {name!r} (valid: {valid})"]
        return self.check(options, layout) if self.check else []


def _shares_no_weights(options: dict[str, Any], layout: Layout | None) -> list[str]:
    if layout and layout.shares_weights:
        return ["scheme 'vanilla' shares no weights, but the spec repeats a core; use scheme "
                "'base' (or another scheme) for a looped core, or a spec without R"]
    return []


def _alpha_init_is_three_numbers(options: dict[str, Any], layout: Layout | None) -> list[str]:
    a = options.get("alpha_init", _MIX["alpha_init"])
    if isinstance(a, (list, tuple)) and len(a) == 3 and all(_is_number(x) for x in a):
        return []
    return [f"scheme_options.alpha_init={a!r} must be 3 numbers (core, anchor h⁰, embeddings e)"]


MESH_ROUTING = ("learned", "uniform")  # uniform: the frozen-router ablation (no router parameters)


def _mesh_options(options: dict[str, Any], layout: Layout | None) -> list[str]:
    out, b = [], options.get("slots")
    if not (b is None or (_is_int(b) and b >= 2)):
        default = f"K+3 = {layout.n_steps + 3}" if layout else "K+3"
        out.append(f"scheme_options.slots={b!r} must be an integer >= 2 (default {default})")
    routing = options.get("routing", "learned")
    if routing not in MESH_ROUTING:
        out.append(f"scheme_options.routing={routing!r} must be one of: {', '.join(MESH_ROUTING)}")
    return out


_MIX = {"alpha_init": [1.0, 1.0, 0.0]}  # α for (core output, anchor h⁰, embeddings e)
SCHEME_OPTIONS: dict[str, SchemeOptions] = {
    "base": SchemeOptions(),
    "vanilla": SchemeOptions(check=_shares_no_weights),
    **{name: SchemeOptions() for name in ("residual", "anchor", "anchor-emb", "residual+anchor",
                                          "residual+anchor+anchor-emb", "anchor+anchor-emb")},
    "static-mix": SchemeOptions(_MIX, _alpha_init_is_three_numbers),
    "dynamic-mix": SchemeOptions(_MIX, _alpha_init_is_three_numbers),
    # slots None -> K + 3
    "mesh": SchemeOptions({"slots": None, "routing": "learned"}, _mesh_options),
}
SCHEME_ALIASES = {"anchor*": "anchor-emb", "residual+anchor+anchor*": "residual+anchor+anchor-emb",
                  "anchor+anchor*": "anchor+anchor-emb"}  # the paper's names


def canonical_scheme(name: str) -> str:
    return SCHEME_ALIASES.get(name, name)


def scheme_problems(name: str, options: dict[str, Any], layout: Layout | None) -> list[str]:
    spec = SCHEME_OPTIONS.get(canonical_scheme(name))
    if spec is None:
        return [f"scheme={name!r} is unknown; choose one of: {', '.join(sorted(SCHEME_OPTIONS))} "
                "(or 'anchor*')"]
    return spec.problems(canonical_scheme(name), options, layout)
