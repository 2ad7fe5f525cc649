"""Llama-style dense layers: RMSNorm, sequential residual, rotary on every head dim, SwiGLU, no
biases, GQA.

    x ── RMSNorm ── Attn(q, k, v, o; H_kv ≤ H key/value heads) ── + ── RMSNorm ── SwiGLU ── + ──→
    └──────────────────────────────────────────────────────────┘ └────────────────────────┘

Equal to transformers' `LlamaForCausalLM` with copied weights (tests/test_llama_parity.py).
Parameter names are Llama's (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, …).
Non-standard options: `qk_norm` adds OLMoE's RMSNorm over the *whole* q and k projections (H·hd and
H_kv·hd wide, before the heads are split and before rotary), and `rotary_pct` < 1 rotates only the
first dims of each head.

The attention here is also the OLMoE layer's (meshlm.model.moe): the two backbones differ only in
the feed-forward block, which is the class attribute `LlamaLayer.FeedForward`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.backbones import layer_of
from meshlm.config import ModelConfig
from meshlm.model.kv_cache import LayerCache
from meshlm.model.layers import Layer, RMSNorm, Rope, apply_rotary, attend


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, q_width, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_width, bias=False)
        # output projection (depth-scaled init)
        self.o_proj = nn.Linear(q_width, cfg.d_model, bias=False)
        if cfg.uses_qk_norm:
            self.q_norm = RMSNorm(q_width, cfg.layer_norm_eps)
            self.k_norm = RMSNorm(kv_width, cfg.layer_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                cache: LayerCache | None = None, slot: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, H·hd), (B, T, H_kv·hd) ×2
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, H, T, hd)
        q = apply_rotary(q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2), rope)
        # (B, H_kv, T, hd)
        k = apply_rotary(k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2), rope)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        y = attend(q, k, v, mask, cache, slot)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """down(silu(gate x) · up x). Dense: ignores `router_logits` (it has no router)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_width, cfg.d_model, bias=False)  # depth-scaled init

    def forward(self, x: torch.Tensor,
                router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@layer_of("llama")
class LlamaLayer(Layer):
    """Pre-norm, sequential residual: x + Attn(N1 x), then + FeedForward(N2 ·)."""

    roles = {"attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.o_proj"),
             "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    output_projections = ("self_attn.o_proj", "mlp.down_proj")

    FeedForward: type[nn.Module] = SwiGLU

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = self.norm(cfg)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = self.norm(cfg)
        self.mlp = self.FeedForward(cfg)

    @staticmethod
    def norm(cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.d_model, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                cache: LayerCache | None = None,
                slot: int = 0, router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, slot)
        return x + self.mlp(self.post_attention_layernorm(x), router_logits)
