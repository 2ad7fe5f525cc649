"""Parameter and FLOP accounting, so comparisons at matched compute are honest.

Counts come from the real module tree built on the meta device (no memory is allocated), so they
cannot drift from the model. Conventions:
- embedding parameters: input embedding + output unembedding (counted once when tied);
  non-embedding = everything else (layers, final norm, scheme parameters such as MeSH routers).
- active parameters (mixture of experts): the parameters one token uses, i.e. total minus the
  experts it is not routed to: each layer's experts count k/E of their size. Dense backbones: active
  = total.
- forward FLOPs per token (PaLM convention, one multiply-add = 2 FLOPs), *active* compute: 2 × the
  matmul weights a token meets in every *unrolled* layer (for MoE: the expert router and k of E
  experts),
  + 4·d·T per unrolled layer for attention scores and mixing at context T, + 2·d·V for the
    unembedding,
  + what the scheme adds (MeSH: counted as in the paper). Training FLOPs per token = 3 × forward.
- depth: FLOPs are for the spec's K loop steps; `train_flops_per_token(model, loops,
  backprop_loops)` gives a step at another depth (sampled train.loops, truncated backprop: the
  backward covers only the passes that keep autograd state), which the trainer's MFU averages over
  the steps run. Parameters include every per-step parameter up to `max_loops` (MeSH: `router_pairs`
  = cap + 1, 0 with uniform routing).
- per-loop LoRA (meshlm.model.loop_lora): `loop_lora_params` counts every pass's deltas (r·(in +
  out) per targeted Linear per pass, up to the cap; non-embedding); a pass meets one delta: 2·r·(in
  + out) FLOPs per targeted Linear, added per core pass.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.model.layers import Layer
from meshlm.model.lm import MeshLM
from meshlm.model.loop_lora import LoopLoRALinear, LowRank
from meshlm.model.moe import Experts


@dataclass
class Accounting:
    total_params: int
    embedding_params: int
    non_embedding_params: int
    scheme_params: int  # MeSH routers, learned mixing coefficients; 0 for fixed schemes
    loop_lora_params: int  # per-loop LoRA deltas of every pass up to the cap; 0 without
    # parameters one token uses (MoE: k of E experts per layer); = total_params if dense
    active_params: int
    active_non_embedding_params: int
    unique_layers: int
    unrolled_layers: int
    loop_steps: int
    slots: int | None  # MeSH buffer size B
    loop_cap: int  # max_loops: the deepest loop count with its own per-step parameters (default K)
    # MeSH: one (write, read) pair per step up to the cap, + the transitional one
    router_pairs: int | None
    forward_flops_per_token: int
    scheme_flops_per_token: int
    train_flops_per_token: int
    context_length: int
    backbone: str
    experts: int | None  # MoE: experts per layer (E) and experts per token (k)
    experts_per_token: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def count(params) -> int:
    return sum(p.numel() for p in params)


def active_share(cfg: ModelConfig) -> float:
    """Fraction of each expert tensor one token uses: k/E for MoE, 1 for dense layers."""
    return cfg.top_k / cfg.n_experts if BACKBONES[cfg.backbone].moe else 1.0


def matmul_weights(layer: Layer, share: float) -> float:
    """Weights one token multiplies with in one layer: every Linear's, and `share` of each expert
    tensor."""
    # base weights only
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(count(m.parameters()) for m in layer.modules() if isinstance(m, Experts))
    return linear + share * experts


def account(model: MeshLM, context_length: int | None = None) -> Accounting:
    cfg = model.config
    layout = cfg.layout
    t = context_length or cfg.context_length
    d = cfg.d_model
    embedding = count(model.embed_in.parameters()) + (count(model.embed_out.parameters())
                                                      if model.embed_out else 0)
    total = count(model.parameters())
    share = active_share(cfg)
    experts = sum(count(m.parameters()) for m in model.modules() if isinstance(m, Experts))
    active = total - round((1 - share) * experts)
    # every layer has the same shape
    layer = next(m for m in model.modules() if isinstance(m, Layer))
    layer_matmul = round(matmul_weights(layer, share))  # neox: qkv 3d² + dense d² + MLP 2·ratio·d²
    scheme_flops = model.scheme.flops_per_token(d, layout.n_steps)
    forward = (layout.unrolled_depth * (2 * layer_matmul + 4 * d * t) + 2 * d * cfg.vocab_size
               + scheme_flops
               + loop_lora_flops(model))
    moe = BACKBONES[cfg.backbone].moe
    return Accounting(
        total_params=total,
        embedding_params=embedding,
        non_embedding_params=total - embedding,
        scheme_params=count(model.scheme.parameters()),
        loop_lora_params=sum(count(m.parameters()) for m in model.modules()
                             if isinstance(m, LowRank)),
        active_params=active,
        active_non_embedding_params=active - embedding,
        unique_layers=layout.unique_depth,
        unrolled_layers=layout.unrolled_depth,
        loop_steps=layout.n_steps,
        slots=model.scheme.facts().get("slots"),
        loop_cap=cfg.loop_cap,
        router_pairs=model.scheme.facts().get("router_pairs"),
        forward_flops_per_token=forward,
        scheme_flops_per_token=scheme_flops,
        train_flops_per_token=3 * forward,
        context_length=t,
        backbone=cfg.backbone,
        experts=cfg.n_experts if moe else None,
        experts_per_token=cfg.top_k if moe else None,
    )


def loop_lora_flops(model: MeshLM) -> int:
    """Forward FLOPs per token of the per-loop LoRA deltas: each core pass meets one delta per
    targeted Linear."""
    per_pass = [sum(2 * count(m.loop_lora[0].parameters()) for m in core.modules()
                    if isinstance(m, LoopLoRALinear))
                for core in model.cores]
    return sum(per_pass[c] for c in model.config.layout.schedule)


def describe(cfg: ModelConfig, context_length: int | None = None) -> Accounting:
    """Accounting for a config without allocating its weights (meta device)."""
    with torch.device("meta"):
        model = MeshLM(cfg)
    return account(model, context_length)


def depth_flops_per_token(model: MeshLM, loops: float, codas: float = 1.0,
                          context_length: int | None = None) -> float:
    """Forward FLOPs per token at `loops` core passes and `codas` coda + head passes (both may be
    averages): what adaptive exit costs (kl exit probes the coda and head once per step, plus once
    on h⁰)."""
    cfg = model.config
    layout, d = cfg.layout, cfg.d_model
    t = context_length or cfg.context_length
    layer = next(m for m in model.modules() if isinstance(m, Layer))
    per_layer = 2 * round(matmul_weights(layer, active_share(cfg))) + 4 * d * t
    core = sum(layout.cores) * per_layer  # one pass of the (single) core
    coda_and_head = layout.coda * per_layer + 2 * d * cfg.vocab_size
    lora = loop_lora_flops(model) / max(1, layout.n_steps)  # per core pass
    return (layout.prelude * per_layer + loops * (core + lora) + codas * coda_and_head
            + model.scheme.flops_per_token(d, max(1, round(loops))))


def train_flops_per_token(model: MeshLM, loops: int, backprop_loops: int | None = None,
                          context_length: int | None = None) -> float:
    """Training FLOPs per token of one step run at `loops` core passes: the forward at `loops`, and
    the backward (2× forward, PaLM's convention) of what keeps autograd state, the last
    `backprop_loops` passes (all when None). What MFU divides by when train.loops samples the depth:
    the drawn count, not the spec's K."""
    kept = loops if not backprop_loops else min(loops, backprop_loops)
    forward = depth_flops_per_token(model, loops, context_length=context_length)
    return forward + 2 * depth_flops_per_token(model, kept, context_length=context_length)
