"""The backbone registry: the layer kinds a model is built from, each owning everything that is its
own.

    backbone  layer class       norm       defaults (fields at None)             HF family
    neox      layers.NeoXLayer  LayerNorm  rotary 25%, MLP 4d                    GPTNeoXForCausalLM
    llama     llama.LlamaLayer  RMSNorm    rotary 100%, SwiGLU ⌈⅔·4d / 64⌉·64    LlamaForCausalLM
    olmoe     moe.OlmoeLayer    RMSNorm    as llama + QK-norm, experts d/2 wide  OlmoeForCausalLM

A backbone is one class registered with `@register_backbone`. It owns
- its defaults for the fields a config leaves at None (`rotary_fraction`, `mlp_width`, `qk_norm`)
  and the checks of the fields only some backbones accept (`problems`); whether it is a mixture of
  experts (`moe`);
- its Hugging Face family: `model_type`, the transformers class, the names of its top-level weights
  and layers, the config translation both ways (`config_from_hf`, `hf_config_kwargs`) and what a
  meshlm model of it cannot be exported with (`export_problems`);
- its layer class (whose `norm` is also the model's final norm): `layer_module` names the module
  that defines it, and the layer attaches itself there with `@layer_of(name)`, so that this module
  imports nothing: meshlm.config reads defaults and checks here without importing torch or the
  model. Importing meshlm.model imports every registered backbone's `layer_module` (no other list).
The loop, the schemes, conversion, accounting and training ask the registry; none of them names a
backbone. A new backbone is therefore two pieces: its layer module in meshlm/model/ and its class
here.
"""
from __future__ import annotations

from typing import Any, ClassVar, Protocol


class ConfigView(Protocol):
    """What a backbone reads of a model: the fields of meshlm.config.ModelConfig named here. A
    protocol, so the registry below the config imports nothing of it (the config validates through
    the registry, not the other way round)."""

    backbone: str
    d_model: int
    n_heads: int
    n_kv_heads: int | None
    mlp_ratio: int
    qk_norm: bool | None
    rotary_base: float
    layer_norm_eps: float
    n_experts: int
    top_k: int
    norm_topk_prob: bool
    aux_loss_weight: float

    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rotary_fraction(self) -> float: ...
    @property
    def uses_qk_norm(self) -> bool: ...

BACKBONES: dict[str, Backbone] = {}


def register_backbone(cls: type[Backbone]) -> type[Backbone]:
    """Class decorator: one instance of `cls` under `cls.name`."""
    BACKBONES[cls.name] = cls()
    return cls


def layer_of(name: str):
    """Class decorator for a layer class (meshlm.model.layers.Layer): the layer of backbone
    `name`."""
    if name not in BACKBONES:
        raise ValueError(f"layer_of({name!r}): no backbone {name!r} is registered; add its class "
                         f"to meshlm.backbones with @register_backbone first")

    def attach(layer: type) -> type:
        BACKBONES[name].layer = layer
        return layer

    return attach


class Backbone:
    name: ClassVar[str] = ""
    title: ClassVar[str] = ""  # for messages, e.g. "GPT-NeoX (Pythia)"
    layer_module: ClassVar[str] = ""  # the module defining its layer class with @layer_of(name)
    moe: ClassVar[bool] = False  # a mixture of experts: router losses in training, active < total
    # parameters
    rotary_fraction: ClassVar[float] = 1.0  # of each head's dims, when rotary_pct is None
    grouped_query: ClassVar[bool] = True  # n_kv_heads < n_heads is possible
    qk_norm_possible: ClassVar[bool] = True
    qk_norm: ClassVar[bool] = False  # when qk_norm is None
    # Hugging Face family
    model_type: ClassVar[str] = ""  # config.json "model_type"
    architecture: ClassVar[str] = ""  # the transformers class, e.g. "LlamaForCausalLM"
    hidden_act: ClassVar[str] = ""  # the activation its config.json must name
    layer_prefix: ClassVar[str] = ""  # its name of unique layer i is f"{layer_prefix}{i}."
    top_level: ClassVar[tuple[tuple[str, str], ...]] = ()  # (its name, meshlm name); the first of
    # duplicates is written
    file_names: ClassVar[dict[str, str]] = {}  # module name -> the name its weight files use, where
    # they differ
    exports_tied: ClassVar[bool] = True  # its folders may tie the output layer to the input
    # embedding

    def __init__(self) -> None:
        self.layer: type | None = None  # set by @layer_of: meshlm.model imports layer_module

    def norm(self, cfg: ConfigView):
        """The backbone's normalisation module for width cfg.d_model (needs meshlm.model
        imported)."""
        return self.layer.norm(cfg)

    def mlp_width(self, cfg: ConfigView) -> int:
        """Hidden width of the MLP (of each expert for MoE) when mlp_hidden is None."""
        return cfg.mlp_ratio * cfg.d_model

    def problems(self, cfg: ConfigView) -> list[str]:
        """Problems with fields this backbone does not accept (the fields' own types are checked by
        the config)."""
        out = []
        if not self.grouped_query and cfg.n_kv_heads not in (None, cfg.n_heads):
            out.append(f"n_kv_heads={cfg.n_kv_heads}: the {self.name} backbone has no "
                       f"grouped-query attention; use backbone {_those_with('grouped_query')}, or "
                       "n_kv_heads=null")
        if not self.qk_norm_possible and cfg.qk_norm:
            out.append(f"qk_norm=true: the {self.name} backbone has no QK-norm; use backbone "
                       f"{_those_with('qk_norm_possible')}")
        return out

    # -- Hugging Face family -----------------------------------------------------------------------
    def hf_problems(self, raw: dict[str, Any]) -> list[str]:
        """What in the family's config.json meshlm does not reproduce (empty: it converts
        exactly)."""
        return []

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields read from the family's config.json, beyond the shape every family
        shares."""
        return {}

    def hf_config_kwargs(self, cfg: ConfigView) -> dict[str, Any]:
        """transformers config kwargs for cfg, beyond the shape every family shares."""
        return {}

    def legacy_config(self, cfg: ConfigView) -> dict[str, Any]:
        """Extra config.json keys older transformers versions read."""
        return {}

    def export_problems(self, cfg: ConfigView) -> list[str]:
        """Why the vanilla model cfg has no exact counterpart in this family (empty: it
        converts)."""
        if cfg.backbone != self.name:
            return [f"a {cfg.backbone!r}-backbone model converts to "
                    f"{BACKBONES[cfg.backbone].title}, not {self.title}"]
        return []


def _those_with(flag: str) -> str:
    return " or ".join(repr(name) for name, b in BACKBONES.items() if getattr(b, flag))


@register_backbone
class NeoXBackbone(Backbone):
    """GPT-NeoX (Pythia): LayerNorm, parallel residual, GELU MLP, biases, rotary on 25% of each
    head."""

    name, title = "neox", "GPT-NeoX (Pythia)"
    layer_module = "meshlm.model.layers"
    rotary_fraction = 0.25  # Pythia's rotary_pct
    grouped_query = qk_norm_possible = False
    model_type, architecture = "gpt_neox", "GPTNeoXForCausalLM"
    hidden_act, layer_prefix = "gelu", "gpt_neox.layers."
    top_level = (("gpt_neox.embed_in.weight", "embed_in.weight"),
                 ("gpt_neox.final_layer_norm.weight", "final_layer_norm.weight"),
                 ("gpt_neox.final_layer_norm.bias", "final_layer_norm.bias"),
                 ("lm_head.weight", "embed_out.weight"),  # transformers 5 module name
                 ("embed_out.weight", "embed_out.weight"))  # Pythia's files
    file_names = {"lm_head.weight": "embed_out.weight"}
    exports_tied = False  # meshlm reads GPT-NeoX folders untied only

    def hf_problems(self, raw):
        d, inter = raw.get("hidden_size"), raw.get("intermediate_size")
        checks = [(not raw.get("use_parallel_residual", True), "use_parallel_residual=false"),
                  (raw.get("tie_word_embeddings", False), "tied input/output embeddings"),
                  (not raw.get("attention_bias", True), "attention without bias"),
                  (not (isinstance(d, int) and isinstance(inter, int) and d and inter % d == 0),
                   f"intermediate_size={inter} is not a multiple of hidden_size={d}")]
        return [message for bad, message in checks if bad]

    def config_from_hf(self, raw):
        rope = raw.get("rope_parameters") or {}
        return dict(rotary_pct=float(raw.get("rotary_pct",
                                             rope.get("partial_rotary_factor", 0.25))),
                    layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
                    mlp_ratio=raw["intermediate_size"] // raw["hidden_size"])

    def hf_config_kwargs(self, cfg):
        return dict(rotary_pct=cfg.rotary_fraction, rotary_emb_base=cfg.rotary_base,
                    layer_norm_eps=cfg.layer_norm_eps,
                    use_parallel_residual=True, attention_bias=True, hidden_dropout=0.0)

    def legacy_config(self, cfg):
        return dict(rotary_pct=cfg.rotary_fraction, rotary_emb_base=cfg.rotary_base)


@register_backbone
class LlamaBackbone(Backbone):
    """Llama: RMSNorm, sequential residual, SwiGLU, no biases, rotary on every head dim,
    grouped-query attention."""

    name, title = "llama", "Llama"
    layer_module = "meshlm.model.llama"
    model_type, architecture = "llama", "LlamaForCausalLM"
    hidden_act, layer_prefix = "silu", "model.layers."
    top_level = (("model.embed_tokens.weight", "embed_in.weight"),
                 ("model.norm.weight", "final_layer_norm.weight"),
                 ("lm_head.weight", "embed_out.weight"))

    def mlp_width(self, cfg):
        # SwiGLU has three matrices: ⅔·ratio·d keeps the MLP's parameters near neox's; rounded up to
        # 64
        return -(-2 * cfg.mlp_ratio * cfg.d_model // (3 * 64)) * 64

    def hf_problems(self, raw):
        d, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
        checks = [(raw.get("attention_bias", False), "attention with bias"),
                  (raw.get("mlp_bias", False), "MLP with bias"),
                  (raw.get("clip_qkv") is not None, f"clip_qkv={raw.get('clip_qkv')}"),
                  (raw.get("head_dim") not in (None, d // heads if d and heads else None),
                   f"head_dim={raw.get('head_dim')} "
                   "(meshlm uses hidden_size / num_attention_heads)")]
        return [message for bad, message in checks if bad]

    def config_from_hf(self, raw):
        return dict(n_kv_heads=raw.get("num_key_value_heads") or raw.get("num_attention_heads"),
                    mlp_hidden=raw["intermediate_size"],
                    layer_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                    tie_embeddings=bool(raw.get("tie_word_embeddings", False)))

    def hf_config_kwargs(self, cfg):
        return dict(num_key_value_heads=cfg.kv_heads, rms_norm_eps=cfg.layer_norm_eps,
                    attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
                    head_dim=cfg.head_dim, mlp_bias=False)

    def export_problems(self, cfg):
        out = super().export_problems(cfg)
        if not out and cfg.rotary_fraction != 1.0:
            out.append(f"{self.title} rotates every head dim; this model has "
                       f"rotary_pct={cfg.rotary_fraction}")
        elif not out and cfg.uses_qk_norm != self.qk_norm:
            out.append(f"{self.title} {'needs' if self.qk_norm else 'has no'} QK-norm "
                       f"(this model: qk_norm={cfg.uses_qk_norm})")
        return out


@register_backbone
class OlmoeBackbone(LlamaBackbone):
    """OLMoE: Llama attention with QK-norm, and a top-k routed mixture of SwiGLU experts."""

    name, title = "olmoe", "OLMoE"
    layer_module = "meshlm.model.moe"
    model_type, architecture = "olmoe", "OlmoeForCausalLM"
    moe = qk_norm = True

    def mlp_width(self, cfg):
        # = d/2 at ratio 4, OLMoE-1B-7B's expert width
        return max(1, cfg.mlp_ratio * cfg.d_model // 8)

    def problems(self, cfg):
        out, e, k = super().problems(cfg), cfg.n_experts, cfg.top_k
        if not (type(e) is int and e >= 1):  # type(True) is bool: booleans are refused
            out.append(f"n_experts={e!r} must be an integer >= 1 (OLMoE-1B-7B: 64)")
        elif not (type(k) is int and 1 <= k <= e):
            out.append(f"top_k={k!r} must be an integer in [1, n_experts={e}] (OLMoE-1B-7B: 8 of "
                       "64)")
        return out

    def config_from_hf(self, raw):
        return dict(super().config_from_hf(raw), n_experts=raw["num_experts"],
                    top_k=raw["num_experts_per_tok"],
                    qk_norm=True, norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                    aux_loss_weight=float(raw.get("router_aux_loss_coef", 0.01)))

    def hf_config_kwargs(self, cfg):
        llama = {k: v for k, v in super().hf_config_kwargs(cfg).items()
                 if k not in ("head_dim", "mlp_bias")}
        return dict(llama, num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                    norm_topk_prob=cfg.norm_topk_prob,
                    router_aux_loss_coef=cfg.aux_loss_weight, clip_qkv=None,
                    output_router_logits=False)
