"""Loop-aware quantization (`meshlm quantize RUN --bits 8|4 [--activations int8|bf16]`;
docs/quantize.md).

    calibrate   the full-precision model over training windows; every visit of a shared core layer
                recorded
    quantize    the chosen parts' nn.Linear layers -> QuantizedLinear (int8 per channel, int4
                grouped; weight-only, or with int8-rounded activation rows), each output
                row's clip chosen on the calibration inputs (meshlm.quant.calibrate)
    report      per loop step the state distance to the full-precision model, and the loss at each
                loop count (meshlm.quant.report): how the error compounds over loops
    write       a meshlm checkpoint like any other (safetensors, manifest of hashes) whose
                config.json carries {"quantization": {"bits", "group_size", "activations",
                "parts", "layers", "calibration", "report"}}; meshlm.loading rebuilds the
                quantized layers from it, so generate / eval / serve open it as is

The model module knows nothing of this: quantization replaces modules, the loop is the same code.
"""
from __future__ import annotations

import copy

import torch

from meshlm.quant.calibrate import PARTS, calibrate, quantize_layers, targets
from meshlm.quant.linear import ACTIVATIONS, GROUP_SIZES, QuantizedLinear

__all__ = ["ACTIVATIONS", "DEFAULT_PARTS", "GROUP_SIZES", "PARTS", "QuantizedLinear",
           "default_activations", "quantize_model"]

# prelude, coda, head and routers stay fp32 by default (docs/quantize.md measures it)
DEFAULT_PARTS = ("cores",)


def default_activations(bits: int) -> str:
    """int8 weights take int8 activations by default: as fast as weight-only where the CPU has no
    int8 dot-product instructions (the same kernel runs), 1.5-3.7x faster per layer where it has
    them, at every row count, for ±0.0002 nats (docs/quantize.md). int4 weights take bf16: int8
    activations with them (w4a8) are fast only through the kernel meshlm compiles (without a C
    compiler their torch ops are many times slower), so they are asked for."""
    return "int8" if bits == 8 else "bf16"


def quantize_model(model, bits: int, parts: tuple[str, ...] = DEFAULT_PARTS, group_size: int = 64,
                   batches: list[torch.Tensor] | None = None, activations: str | None = None
                   ) -> tuple[torch.nn.Module, dict]:
    """(a quantized copy of `model`, its `quantization` entry). `batches`: (B, T) id tensors to
    calibrate on (None: clip by plain weight error); `activations`: "bf16" (weight-only) or "int8"
    (int8 weights only: each activation row rounded to int8, meshlm.quant.linear); None:
    default_activations(bits)."""
    activations = activations or default_activations(bits)
    layers = targets(model, set(parts))
    cal = calibrate(model, layers, batches) if batches else None
    quantized = copy.deepcopy(model)
    clips = quantize_layers(quantized, targets(quantized, set(parts)), bits, group_size, cal,
                            activations)
    spec = {"bits": bits, "group_size": group_size if bits == 4 else None,
            "activations": activations, "parts": sorted(parts),
            "layers": list(layers), "mean_clip": sum(clips.values()) / max(len(clips), 1),
            "calibration": None if cal is None else {"batches": len(batches), "visits": cal.visits,
                                                     "rows": cal.rows}}
    return quantized.eval(), spec
