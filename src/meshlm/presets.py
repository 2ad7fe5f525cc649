"""Named model presets: `ModelConfig.from_preset(name, **overrides)` starts from one of these.

Plain dicts of ModelConfig fields, importing nothing of meshlm (so meshlm.config can import them):
Pythia's shapes and the MeSH paper's recursive splits, the Llama and OLMoE backbones, and the
CPU-scale models that the tests and the default `meshlm train` use.
"""
from __future__ import annotations

from typing import Any

# Pythia shapes (the Pythia paper's table). Pythia pads the vocabulary to 50,304 rows and uses
# 2048-token contexts; the paper trains at 4096. `pythia-*` presets are vanilla stacks;
# `pythia-*-<spec>` are the paper's recursive splits, MeSH by default (pick any other scheme with
# scheme=...).
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


# Llama and OLMoE backbones (docs/backbones.md). `olmoe-1b-7b` is OLMoE-1B-7B's public shape (6.9B
# total / 1.3B active). The MeSH paper's OLMoE comparison states only "2.6B total / 512M active";
# meshlm's reading is Pythia-410M's trunk (24 layers, d 1024, 16 heads) with OLMoE-1B-7B's MoE
# recipe (64 experts, top-8, expert width d/2 = 512): 2.62B total / 0.51B active
# (tests/test_backbones.py checks the counts).
_OLMOE = dict(backbone="olmoe", vocab_size=50304, context_length=4096, n_experts=64, top_k=8)
_OLMOE_410M = dict(_OLMOE, d_model=1024, n_heads=16, mlp_hidden=512)
_SMALL = dict(d_model=128, n_heads=4, vocab_size=8192, context_length=256)
_SMALL_MOE = dict(_SMALL, backbone="olmoe", n_experts=8, top_k=2, mlp_hidden=128)
_TINY = dict(spec="1+2R2+1", d_model=64, n_heads=4, vocab_size=512, context_length=128)
_LLAMA_OLMOE: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(_TINY, n_kv_heads=2, backbone="llama"),
    "tiny-olmoe": dict(_TINY, backbone="olmoe", n_experts=4, top_k=2),
    # CPU scale: a vanilla 8-layer Llama (the retrofit source) and MeSH models of 8 unrolled layers
    "llama-small": dict(_SMALL, spec="8", scheme="vanilla", backbone="llama", n_kv_heads=2),
    "llama-mesh-small": dict(_SMALL, spec="2+2R2+2", backbone="llama", n_kv_heads=2),
    "olmoe-small": dict(_SMALL_MOE, spec="2+2R2+2"),
    "olmoe-vanilla-small": dict(_SMALL_MOE, spec="8", scheme="vanilla"),
    "olmoe-1b-7b": dict(_OLMOE, spec="16", scheme="vanilla", d_model=2048, n_heads=16,
                        mlp_hidden=1024),
    "olmoe-2.6b-a512m": dict(_OLMOE_410M, spec="24", scheme="vanilla"),
    "olmoe-2.6b-a512m-4+8R2+4": dict(_OLMOE_410M, spec="4+8R2+4", scheme="mesh"),
}

PRESETS: dict[str, dict[str, Any]] = {
    **{f"pythia-{s}": _pythia(s, None) for s in _PYTHIA},
    **{f"pythia-{s}-{spec}": _pythia(s, spec)
       for s, specs in _PAPER_SPLITS.items() for spec in specs},
    # CPU scale. `tiny` is for tests; `mesh-small` is what `meshlm train` trains by default.
    "tiny": dict(_TINY),
    # d=128: on 2 CPU cores a small model sees ~3x the tokens of a d=256 one in the same minutes and
    # ends lower (at equal wall time: d=128 "2+2R2+2" reached val ppl 395, d=256 "1+2R2+1" got 442)
    "mesh-small": dict(_SMALL, spec="2+2R2+2"),
    "vanilla-small": dict(spec="12", d_model=256, n_heads=8, vocab_size=8192, context_length=256,
                          scheme="vanilla"),
    **_LLAMA_OLMOE,
}
