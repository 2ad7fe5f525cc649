"""Which layers are quantized, what calibration sees, and the clip each output row gets.

Parts of a MeshLM, by module name: `prelude.*`, `cores.*` (the looped, weight-shared layers),
`coda.*`, `head` (`embed_out`, untied models only) and `routers` (an MoE layer's `mlp.gate`). The
embedding table is a lookup (decoding reads one row per token) and a tied head reads it too: both
stay full precision always.

Calibration runs the full-precision model over held-out windows at its trained schedule and, for
every layer to quantize, accumulates the Gram matrix of its inputs, Σ = Σ_visits XᵀX (in, in), over
every call: a core layer is called once per loop pass, so Σ holds the inputs of all passes, not only
the first (`visits` counts them; tests/test_quant.py checks the count). The output error of a
quantized weight Ŵ on those inputs is ‖X(W − Ŵ)ᵀ‖² = Σ_n (W − Ŵ)_n Σ (W − Ŵ)_nᵀ, one term per output
row, so each row picks the clip in CLIPS with the smallest term (GPTQ's Hessian proxy, used here for
the range only: round-to-nearest, no error feedback). Without calibration data Σ = I: plain weight
error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshlm.quant.linear import QuantizedLinear, dequantize, quantize_weight

PARTS = ("prelude", "cores", "coda", "head", "routers")
CLIPS = (1.0, 0.97, 0.94, 0.9, 0.86, 0.82, 0.78, 0.74, 0.7)


def part_of(name: str) -> str:
    """The part a Linear's module name belongs to (module docstring)."""
    if name == "embed_out":
        return "head"
    if name.endswith("mlp.gate"):
        return "routers"
    return name.split(".")[0]


def targets(model: nn.Module, parts: set[str]) -> dict[str, nn.Linear]:
    """{module name: nn.Linear} of the parts to quantize, in module order."""
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return {name: m
            for name, m in model.named_modules() if type(m) is nn.Linear and part_of(name) in parts}


@dataclass
class Calibration:
    """Per target layer: the input Gram matrix over every visit, the visit count and the rows
    seen."""

    gram: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (in, in) fp64
    visits: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)


@torch.no_grad()
def calibrate(model: nn.Module, layers: dict[str, nn.Linear],
              batches: list[torch.Tensor]) -> Calibration:
    """Run `model` (full precision, fp32) over `batches` of (B, T) ids, recording every call of
    every layer."""
    cal = Calibration()

    def recorder(name: str):
        def hook(module, inputs):
            x = inputs[0].detach().reshape(-1, module.in_features).double()
            cal.gram[name] = cal.gram.get(name, 0) + x.T @ x
            cal.visits[name] = cal.visits.get(name, 0) + 1
            cal.rows[name] = cal.rows.get(name, 0) + x.shape[0]
        return hook

    handles = [layer.register_forward_pre_hook(recorder(name)) for name, layer in layers.items()]
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return cal


def best_clip(weight: torch.Tensor, gram: torch.Tensor | None, bits: int,
              group_size: int) -> torch.Tensor:
    """(out,) the clip per output row with the smallest output error Σ_n (W − Ŵ)_n Σ (W − Ŵ)_nᵀ."""
    w = weight.detach().float()
    sigma = None if gram is None else (gram / gram.diagonal().mean().clamp(min=1e-30)).float()
    errors = []
    for c in CLIPS:
        diff = w - dequantize(quantize_weight(w, bits, group_size, torch.full((w.shape[0],), c)),
                              group_size)
        # (out,); Σ = I without data
        errors.append(((diff if sigma is None else diff @ sigma) * diff).sum(1))
    return torch.tensor(CLIPS)[torch.stack(errors).argmin(0)]


def quantize_layers(model: nn.Module, layers: dict[str, nn.Linear], bits: int, group_size: int,
                    cal: Calibration | None = None, activations: str = "bf16") -> dict[str, float]:
    """Replace each of `layers` in `model` by its QuantizedLinear (in place); returns {name: mean
    clip}."""
    clips = {}
    for name, layer in layers.items():
        clip = best_clip(layer.weight, cal.gram.get(name) if cal else None, bits, group_size)
        replace_module(model, name,
                       QuantizedLinear.from_linear(layer, bits, group_size, clip, activations))
        clips[name] = float(clip.mean())
    return clips


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def structure_of(model: nn.Module) -> dict | None:
    """The part of a `quantization` entry that empty_structure needs ({"bits", "group_size",
    "activations", "layers"}), read off `model`'s QuantizedLinear layers; None for a model without
    any."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:
        return None
    (bits, group_size, activations), = {(m.bits, m.group_size if m.bits == 4 else None,
                                         m.activations) for m in layers.values()}
    return {"bits": bits, "group_size": group_size, "activations": activations,
            "layers": list(layers)}


def describe(structure: dict) -> str:
    """A structure_of entry in words, e.g. "8 linear layers int8 with int8 activations"."""
    int8 = structure.get("activations") == "int8"
    kind = ((f"int4 in groups of {structure['group_size']}" if structure["bits"] == 4 else
             "int8" if int8 else "int8 weight-only") + (" with int8 activations" if int8 else ""))
    return f"{len(structure['layers'])} linear layers {kind}"


def empty_structure(model: nn.Module, spec: dict) -> None:
    """Give `model` the QuantizedLinear layers named in a checkpoint's `quantization` entry (weights
    follow via load_state_dict): how meshlm.loading opens a quantized checkpoint. An entry without
    "activations" (written before int8 activations existed) is weight-only, bf16."""
    for name in spec["layers"]:
        layer = model.get_submodule(name)
        replace_module(model, name,
                       QuantizedLinear(layer.in_features, layer.out_features,
                                       layer.bias is not None, spec["bits"], spec["group_size"],
                                       spec.get("activations", "bf16")))
