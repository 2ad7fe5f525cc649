"""Activation checkpointing, applied to a model from outside: each layer's activations are
recomputed in backward instead of kept. Used by training (meshlm.train.parallel) and by the Hugging
Face export's `gradient_checkpointing_enable()` (meshlm.hf.modeling), so PEFT on the exported model
can use it too.

It acts in place on every `Layer` (an instance-level forward), so parameter names never change. The
checkpoint is non-reentrant (frozen inputs, as under LoRA, need no gradient trick), and a core
layer's per-loop LoRA pass is the one it ran with, restored for the recompute
(meshlm.model.loop_lora).
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshlm.model.layers import Layer
from meshlm.model.loop_lora import recompute_context


def checkpoint_layers(model: nn.Module, enable: bool = True,
                      checkpoint_fn: Callable | None = None) -> None:
    """Checkpoint every layer with `checkpoint_fn` (default torch.utils.checkpoint.checkpoint;
    transformers passes a partial of it); enable=False undoes it."""
    checkpoint_fn = checkpoint_fn or checkpoint
    for layer in (m for m in model.modules() if isinstance(m, Layer)):
        layer.__dict__.pop("forward", None)  # the class's forward again
        if not enable:
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, _layer=layer, **kwargs):
            return checkpoint_fn(_inner, *args, use_reentrant=False,
                                 context_fn=lambda: recompute_context(_layer), **kwargs)

        layer.forward = forward
