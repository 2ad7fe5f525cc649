"""Layer pieces shared by every backbone, and the GPT-NeoX (Pythia) layer. Nothing here knows about
looping.

Shared: rotary position embeddings (the "rotate half" convention of GPT-NeoX and Llama, on the first
`rotary_dims` of each head), RMSNorm, the attention kernel `attend` (SDPA with the looped KV cache
and grouped-query heads), the `Layer` base class every layer kind derives from, and the padding
mask. The Llama and OLMoE layers live in meshlm.model.llama and meshlm.model.moe. Each layer class
attaches itself to its backbone in the registry (meshlm.backbones) with `@layer_of`.

The GPT-NeoX layer is the *parallel* residual of Pythia:

    x ─┬──────────────────────────────────────────┐
       ├─ LN1 ─ Attn(rotary on 25% of head dims) ─ + ─→ x + Attn(LN1 x) + MLP(LN2 x)
       └─ LN2 ─ Linear(d, 4d) ─ GELU ─ Linear(4d, d) ┘

Parameter names follow Hugging Face (`attention.query_key_value`, `mlp.dense_4h_to_h`, …, and for
Llama `self_attn.q_proj`, `mlp.gate_proj`, …) so checkpoints map onto meshlm by renaming layer
indices only. The fused QKV projection is laid out per head as (heads, [q|k|v], head_dim), like
Pythia. Attention runs through `F.scaled_dot_product_attention`, which picks a
flash/memory-efficient kernel on GPUs; a compiled decode step on a CPU attends with its one query
through sums the compiler fuses (`one_query`).

For incremental decoding a layer takes an optional `cache` (see meshlm.model.kv_cache) and the index
of its *unrolled* slot in it: a looped core layer is called once per pass with a different slot.
Layers with a router (MoE) append its logits to `router_logits` when given a list; the others ignore
it.
"""
from __future__ import annotations

import abc
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.backbones import layer_of
from meshlm.config import ModelConfig
from meshlm.model.kv_cache import LayerCache

# cos and the signed sin (−sin on the first half of the rotary dims, +sin on the second): (B, T, r)
Rope = tuple[torch.Tensor, torch.Tensor]


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast bf16/fp16 to fp32 for numerically sensitive ops (softmax, loss); fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embeddings on the first `dims` dims of each head."""

    def __init__(self, dims: int, base: float):
        super().__init__()
        self.dims, self.base = dims, base
        # rebuilt from the config
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        # (dims/2,)
        return 1.0 / (self.base ** (torch.arange(0, self.dims, 2, dtype=torch.float32) / self.dims))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Rope:
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, dims/2), fp32 for accuracy
        sin = freqs.sin()
        # the "rotate half" layout: (B, T, dims)
        return torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate the first rotary_dims r of x (B, H, T, hd); the remaining dims pass through
    unchanged. "Rotate half" (x1, x2) -> (x1·cos − x2·sin, x2·cos + x1·sin) on the halves of the
    r dims is x·cos + roll(x, r/2)·signed_sin: the same numbers bit for bit as splitting,
    negating and concatenating, in 4 tensor ops instead of 8 (decoding runs it twice a layer per
    token; with backward it is also ~1.4x faster at training shapes)."""
    cos, signed_sin = (t.unsqueeze(1) for t in rope)  # (B, 1, T, r)
    r = cos.shape[-1]
    if r == x.shape[-1]:  # Llama: every dim rotates (no slicing and concatenation)
        return x * cos + x.roll(r // 2, -1) * signed_sin
    x_rot = x[..., :r]
    return torch.cat((x_rot * cos + x_rot.roll(r // 2, -1) * signed_sin, x[..., r:]), dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) · weight, normalised in fp32 and cast back before the weight (as Llama and
    OLMoE)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                 + self.eps)).to(x.dtype))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           cache: LayerCache | None, slot: int) -> torch.Tensor:
    """Causal attention of q (B, H, T, hd) over k, v (B, H_kv, T, hd), H a multiple of H_kv
    (grouped-query).

    With a cache, k and v are appended to this unrolled slot's history first (the cache stores H_kv
    heads). mask None: plain causal attention, or (one query after a cached past) attend to every
    key. Otherwise a boolean (B, 1, T, T_past + T) "may attend" mask (built by the model when it is
    needed).
    """
    own = getattr(cache, "attend", None)  # a cache that computes attention itself (exit's)
    if own is not None:
        return own(q, k, v, mask, slot)
    if cache is not None:
        k, v = cache.update(k, v, slot)  # (B, H_kv, T_past + T, hd): this slot's whole history
    # no mask and several queries: no past (MeshLM.attention_inputs builds a mask after one), so
    # causal; one query attends to every key. (Not k's length against q's: under a compiled step's
    # symbolic lengths that comparison is no bool.)
    if q.shape[-2] == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
        return one_query(q, k, v, mask)
    # decided by a branch, so that a compiled forward of several tokens with no past and no
    # padding passes SDPA a bool: with a symbolic length the comparison is a SymBool, which SDPA
    # refuses (the graph broke there)
    is_causal = False
    if mask is None and q.shape[-2] > 1:
        is_causal = True
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=gqa)


def one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA's attention of one query, q (B, H, 1, hd), over k, v (B, H_kv, C, hd), mask None or
    (B, 1, 1, C), as sums of products that a compiled graph fuses into its own loops (a decode
    step on a CPU: SDPA's kernel there costs ~25 µs a layer at one query, the fused sums a few).
    Equal to SDPA to floating-point rounding: in fp32 whatever the inputs' dtype, as SDPA's CPU
    kernel accumulates (bf16 scores and weights between the compiled sums doubled the error)."""
    b, h, _, hd = q.shape
    h_kv, c = k.shape[1], k.shape[2]
    dtype, q, k, v = q.dtype, q.float(), k.float(), v.float()  # casts the compiler fuses
    q = q.reshape(b, h_kv, h // h_kv, 1, hd)  # each key/value head's group of query heads
    k, v = k.unsqueeze(2), v.unsqueeze(2)  # (B, H_kv, 1, C, hd)
    scores = (q * k).sum(-1) * hd ** -0.5  # (B, H_kv, G, C)
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, c), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights.unsqueeze(-1) * v).sum(-2).reshape(b, h, 1, hd).to(dtype)


class Layer(nn.Module, abc.ABC):
    """Base class of every layer kind: `forward(x, rope, mask, cache, slot, router_logits) -> x`,
    (B, T, d).

    Wrappers that act per layer (activation checkpointing, compile, FSDP units) find layers by this
    class. `norm` builds the backbone's normalisation (also used for the model's final norm). The
    layer also names its own Linears, so nothing outside it lists a backbone's parameter names:
    `roles` (LoRA and per-loop LoRA targets by role) and `output_projections` (the Linears that
    write into the residual stream, whose init is scaled by 1/√(2·depth): meshlm.model.init).
    """

    # role -> layer-local names of its Linears (a name matches as a suffix)
    roles: ClassVar[dict[str, tuple[str, ...]]] = {}
    output_projections: ClassVar[tuple[str, ...]] = ()  # layer-local names, matched as suffixes

    @staticmethod
    @abc.abstractmethod
    def norm(cfg: ModelConfig) -> nn.Module:
        """The backbone's normalisation layer for width cfg.d_model."""


# -- GPT-NeoX (Pythia) -----------------------------------------------------------------------------
class NeoXAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)  # output projection (depth-scaled init)

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                cache: LayerCache | None = None, slot: int = 0) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.query_key_value(x).view(b, t, self.n_heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # each (B, H, T, hd)
        # q, k become rotated copies; copying v too lets autograd free the fused qkv (3× the size of
        # v). (Rotating q and k together as one (B, H, T, 2, hd) tensor made a training step 1.9%
        # slower: strided kernels.)
        y = attend(apply_rotary(q, rope), apply_rotary(k, rope), v.contiguous(), mask, cache, slot)
        return self.dense(y.transpose(1, 2).reshape(b, t, d))


class NeoXMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.d_model, cfg.mlp_width)
        self.dense_4h_to_h = nn.Linear(cfg.mlp_width, cfg.d_model)  # depth-scaled init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))  # exact (erf) GELU, as Pythia


@layer_of("neox")
class NeoXLayer(Layer):
    """Pre-LN GPT-NeoX layer with parallel residual: x + Attn(LN1 x) + MLP(LN2 x)."""

    roles = {"attention": ("attention.query_key_value", "attention.dense"),
             "mlp": ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}
    output_projections = ("attention.dense", "mlp.dense_4h_to_h")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = self.norm(cfg)
        self.post_attention_layernorm = self.norm(cfg)
        self.attention = NeoXAttention(cfg)
        self.mlp = NeoXMLP(cfg)

    @staticmethod
    def norm(cfg: ModelConfig) -> nn.Module:
        return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                cache: LayerCache | None = None,
                slot: int = 0, router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), rope, mask, cache, slot)
        return x + attn + self.mlp(self.post_attention_layernorm(x))


def attention_mask_from_padding(padding_mask: torch.Tensor, past: int = 0) -> torch.Tensor:
    """(B, S) with 1 for real tokens, 0 for padding -> boolean (B, 1, T, S) causal "may attend"
    mask.

    S = past + T: the mask covers the `past` cached tokens and the T new ones (queries are the last
    T). A query with no real key at or before it (a left pad) attends to itself, so no row is all
    -inf (which would make SDPA return NaN); padding positions' outputs are ignored by callers
    anyway. Any other query attends to real keys only, its own column included only where it is
    real: a static cache (meshlm.model.kv_cache.StaticKVCache) writes the decoded token at a column
    of its own, and the query's nominal column, the last, holds nothing.
    """
    s = padding_mask.shape[-1]
    # (T, 1) absolute positions
    query_pos = torch.arange(past, s, device=padding_mask.device)[:, None]
    key_pos = torch.arange(s, device=padding_mask.device)[None]  # (1, S)
    allowed = (key_pos <= query_pos) & padding_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    return allowed | (key_pos == query_pos) & ~allowed.any(-1, keepdim=True)
