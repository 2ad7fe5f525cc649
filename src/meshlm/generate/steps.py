"""One decode step as a function of tensors, and its compiled forms.

`forward(model, schedule, tokens, padding, cache)` feeds tokens (B, 1) after a cache at the full
depth of `schedule` (the prelude, the loop of every scheme, the coda) and returns the (B, V)
logits of its last position: what a plain decoder's step computes, with nothing around it, so
that torch.compile can take it whole. Two compiled forms share it:

    compiled(dynamic=False)  over a StaticKVCache (meshlm.generate.compiled): every step has the
                             same shapes, one graph per batch size and capacity
    compiled(dynamic=True)   over the growing KVCache a serving cohort joins and leaves rows in
                             (meshlm.generate.decoder.PlainDecoder(compiled=True)): the batch size
                             and the cache length are symbolic, so rows joining and leaving reuse
                             the graph; the caller grows the cache outside it (KVCache.reserve) and
                             always passes a mask, so Dynamo compiles three graphs in all (one
                             specialised to the first lengths, one general, one for a batch of one)

torch.compile is lazy: Inductor runs at the first call of a shape, and caches its kernels on disk.
"""
from __future__ import annotations

import functools
import warnings

import torch

BACKEND = "inductor"  # torch.compile's backend ("eager": Dynamo's tracing and guards alone, as fast
# tests use it)
# Inductor's checks of tensors' sizes and strides in the generated Python, ~300 a 12-layer w4a8
# step (~1 us each): its inputs, which Dynamo's guards checked before the step ran, and the
# outputs of meshlm's kernel operators, whose allocation tests/test_operators.py checks. Off: a
# step without weight products ran 0.457 against 0.483 ms (d = 768, 2 threads, docs/quantize.md)
INDUCTOR_OPTIONS = {"size_asserts": False}


def forward(model, schedule: tuple[int, ...], tokens: torch.Tensor,
            padding: torch.Tensor | None, cache) -> torch.Tensor:
    """One decode step: tokens (B, 1) after the cache, padding (B, cached + 1) or None -> (B, V)
    logits."""
    run = model.start(tokens, padding, cache)
    model.advance(run, schedule)
    return model.readout(run, schedule)[:, -1]


@functools.cache
def compiled(dynamic: bool):
    """`forward` compiled, with static or symbolic shapes (module docstring)."""
    options = INDUCTOR_OPTIONS if BACKEND == "inductor" else None
    step = torch.compile(forward, dynamic=dynamic, backend=BACKEND, options=options)

    def call(*args):
        with warnings.catch_warnings():  # tracing reads config.layout through its lru_cache, which
            # Dynamo warns that it traces through: harmless (the spec is a constant)
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools")
            return step(*args)
    return call
