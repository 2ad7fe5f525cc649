"""Parameter and FLOP accounting, so comparisons at matched compute are honest.

Counts come from the real module tree built on the meta device (no memory is allocated), so they cannot
drift from the model. Conventions:
- embedding parameters: input embedding + output unembedding (untied, as Pythia);
  non-embedding = everything else (layers, final LayerNorm, scheme parameters such as MeSH routers).
- forward FLOPs per token (PaLM convention, one multiply-add = 2 FLOPs): 2 × matmul weights of every
  *unrolled* layer, + 4·d·T per unrolled layer for attention scores and mixing at context T,
  + 2·d·V for the unembedding, + what the scheme adds (MeSH: counted as in the paper).
  Training FLOPs per token = 3 × forward.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from meshlm.config import ModelConfig
from meshlm.model.lm import MeshLM


@dataclass
class Accounting:
    total_params: int
    embedding_params: int
    non_embedding_params: int
    scheme_params: int  # MeSH routers, learned mixing coefficients; 0 for fixed schemes
    unique_layers: int
    unrolled_layers: int
    loop_steps: int
    slots: int | None  # MeSH buffer size B
    forward_flops_per_token: int
    scheme_flops_per_token: int
    train_flops_per_token: int
    context_length: int

    def to_dict(self) -> dict:
        return asdict(self)


def count(params) -> int:
    return sum(p.numel() for p in params)


def account(model: MeshLM, context_length: int | None = None) -> Accounting:
    cfg = model.config
    layout = cfg.layout
    t = context_length or cfg.context_length
    d = cfg.d_model
    embedding = count(model.embed_in.parameters()) + count(model.embed_out.parameters())
    total = count(model.parameters())
    layer_matmul = 4 * d * d + 2 * cfg.mlp_ratio * d * d  # qkv (3d²) + dense (d²) + MLP (2·ratio·d²)
    scheme_flops = model.scheme.flops_per_token(d, layout.n_steps)
    forward = layout.unrolled_depth * (2 * layer_matmul + 4 * d * t) + 2 * d * cfg.vocab_size + scheme_flops
    return Accounting(
        total_params=total,
        embedding_params=embedding,
        non_embedding_params=total - embedding,
        scheme_params=count(model.scheme.parameters()),
        unique_layers=layout.unique_depth,
        unrolled_layers=layout.unrolled_depth,
        loop_steps=layout.n_steps,
        slots=getattr(model.scheme, "slots", None),
        forward_flops_per_token=forward,
        scheme_flops_per_token=scheme_flops,
        train_flops_per_token=3 * forward,
        context_length=t,
    )


def describe(cfg: ModelConfig, context_length: int | None = None) -> Accounting:
    """Accounting for a config without allocating its weights (meta device)."""
    with torch.device("meta"):
        model = MeshLM(cfg)
    return account(model, context_length)
