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

import functools
import logging
import warnings
from pathlib import Path

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
PACKAGE = str(Path(__file__).resolve().parents[1])  # meshlm's source, as Dynamo's stacks name it


class _OwnBreaks(logging.Filter):
    """Drops ITEM_BREAKS' warnings about a read in meshlm's own code (the warning's stack names
    the file); any other code's stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return PACKAGE not in record.getMessage()


OWN_BREAKS = _OwnBreaks()


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
    return _compiled(step, dynamic)


def _compiled(fn, dynamic: bool):
    """`fn` compiled by torch.compile (BACKEND, INDUCTOR_OPTIONS, RECOMPILE_LIMIT), called with
    the warnings its tracing gives left out."""
    options = INDUCTOR_OPTIONS if BACKEND == "inductor" else None
    traced = torch.compile(fn, dynamic=dynamic, backend=BACKEND, options=options,
                           recompile_limit=RECOMPILE_LIMIT)
    ITEM_BREAKS.addFilter(OWN_BREAKS)  # once: logging keeps a filter once; nothing a call

    def call(*args):
        with warnings.catch_warnings():
            # tracing reads config.layout through its lru_cache, which Dynamo warns that it traces
            # through: harmless (the spec is a constant)
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools")
            return traced(*args)
    return call


def _start(model, tokens, padding, cache, exit):
    return model.start(tokens, padding, cache, exit)


def _advance(model, run, schedule, stop):
    model.advance(run, schedule, stop)  # in place: Dynamo replays the run's changes


def _readout(model, run, schedule, last):
    return model.readout(run, schedule, last)


@functools.cache
def _stage(name: str):
    """One of MeshLM's stages compiled with symbolic shapes (`CompiledStages`)."""
    return _compiled({"start": _start, "advance": _advance, "readout": _readout}[name], True)


class CompiledStages:
    """A MeshLM's three stages, `start`, `advance` and `readout`, each compiled with symbolic
    shapes (torch.compile, `BACKEND`), for decoders that run a model stage by stage over the
    growing KVCache: self-speculation's rounds (meshlm.generate.speculative with `compiled`),
    which draft one token at a time and verify γ + 1 at once. Decoding code runs on the model, on
    meshlm.generate.timing.Timed or on this (or Timed around this) and cannot tell them apart.
    Timed advances one loop step a call, so a compiled `advance` specialises to each loop step
    (and to one token or several), not to each pair of them."""

    def __init__(self, model):
        self.model, self.config, self.scheme = model, model.config, model.scheme

    def parameters(self):
        return self.model.parameters()

    def start(self, input_ids, padding_mask=None, cache=None, exit=None):
        return _stage("start")(self.model, input_ids, padding_mask, cache, exit)

    def advance(self, run, schedule, stop=None):
        _stage("advance")(self.model, run, schedule, stop)
        return run

    def readout(self, run, schedule, last=None):
        return _stage("readout")(self.model, run, schedule, last)


def forget() -> None:
    """Drop every compiled form made so far (`compiled`, the stages), so that the next call
    compiles with the BACKEND then set (tests trace with the eager backend)."""
    compiled.cache_clear()
    _stage.cache_clear()
