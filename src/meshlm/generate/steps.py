"""One decode step as a function of tensors, and its compiled forms.

`step(model, schedule, tokens, padding, cache, exit)` feeds tokens (B, 1) after a cache at the full
depth of `schedule` (the prelude, the loop of every scheme, the coda), or with per-token `exit` (an
ExitRule), and returns the (B, V) logits of its last position and, under exit, the (B, 1) loop
steps each token ran: what a plain decoder's step computes, with nothing around it, so that
torch.compile can take it whole. `forward` is its logits without exit (what AOTInductor exports,
meshlm.generate.ahead). Two compiled forms share it:

    compiled(dynamic=False)  over a StaticKVCache (meshlm.generate.compiled): every step has the
                             same shapes, one graph per batch size and capacity
    compiled(dynamic=True)   over the growing KVCache a serving cohort joins and leaves rows in
                             (meshlm.generate.decoder.PlainDecoder(compiled=True)): the batch size
                             and the cache length are symbolic, so rows joining and leaving reuse
                             the graph; the caller grows the cache outside it (KVCache.reserve) and
                             always passes a mask, so Dynamo compiles three graphs in all (one
                             specialised to the first lengths, one general, one for a batch of one)

Under exit the step decides from the tokens' states whether a token loops on (and, at batch 1,
whether the loop ends): Dynamo breaks the graph at each such decision and compiles the pieces
between them, so one step is a few compiled graphs with those decisions in Python between them,
the same decisions the eager step takes.

torch.compile is lazy: Inductor runs at the first call of a shape, and caches its kernels on disk.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch

BACKEND = "inductor"  # torch.compile's backend ("eager": Dynamo's tracing and guards alone, as fast
# tests use it)
# Inductor's checks of tensors' sizes and strides in the generated Python, ~300 a 12-layer w4a8
# step (~1 us each): its inputs, which Dynamo's guards checked before the step ran, and the
# outputs of meshlm's kernel operators, whose allocation tests/test_operators.py checks. Off: a
# step without weight products ran 0.457 against 0.483 ms (d = 768, 2 threads, docs/quantize.md)
INDUCTOR_OPTIONS = {"size_asserts": False}
# compiled forms of one frame Dynamo keeps before it runs the frame eagerly for good: under exit a
# step's pieces after each decision are frames of their own, specialised to the loop step they
# resume at and to the rows still looping (a 1+2R4+1 model at batch 2 passed torch's default of 8)
RECOMPILE_LIMIT = 64
# where Dynamo warns, at the first graph break on a tensor read as a number, that it broke the
# graph there: exit's decisions are such reads, meant to stay in Python (the module docstring)
ITEM_BREAKS = logging.getLogger("torch._dynamo.variables.tensor")


def step(model, schedule: tuple[int, ...], tokens: torch.Tensor, padding: torch.Tensor | None,
         cache, exit=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step: tokens (B, 1) after the cache, padding (B, cached + 1) or None, `exit` an
    ExitRule or None -> (B, V) logits, and under exit the (B, 1) loop steps each token ran (else
    None)."""
    run = model.start(tokens, padding, cache, exit)
    model.advance(run, schedule)
    logits = model.readout(run, schedule)[:, -1]
    return logits, None if exit is None else run.track.loops


def forward(model, schedule: tuple[int, ...], tokens: torch.Tensor,
            padding: torch.Tensor | None, cache) -> torch.Tensor:
    """`step`'s logits at the full depth (no exit)."""
    return step(model, schedule, tokens, padding, cache)[0]


@functools.cache
def compiled(dynamic: bool):
    """`step` compiled, with static or symbolic shapes (module docstring)."""
    options = INDUCTOR_OPTIONS if BACKEND == "inductor" else None
    traced = torch.compile(step, dynamic=dynamic, backend=BACKEND, options=options,
                           recompile_limit=RECOMPILE_LIMIT)

    def call(*args):
        with warnings.catch_warnings(), _quiet(ITEM_BREAKS):
            # tracing reads config.layout through its lru_cache, which Dynamo warns that it traces
            # through: harmless (the spec is a constant)
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools")
            return traced(*args)
    return call


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """`logger`'s warnings left out while the block runs."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
