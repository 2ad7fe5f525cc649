"""Plain decoding through one compiled step over a static looped KV cache.

A decode step runs ~25 tensor ops a layer (norms, rotary, the cache write, attention, residuals) and
the loop's bookkeeping around them; on a CPU their dispatch costs about 3 ms a token at d = 768, a
fifth of an int4 model's step. Compiled (torch.compile, Inductor) they fuse into a few kernels, and
that overhead goes. A compiled step needs shapes that do not change from token to token: the cache
is a meshlm.model.kv_cache.StaticKVCache, preallocated to the generation's length (rounded up to
COLUMNS, so that nearby lengths share one compiled step) and written in place, and the step takes a
(B, W) padding mask over its first W columns: those filled so far and the query's empty nominal
one, rounded up to COLUMNS, a width the compiled step takes as dynamic (StaticKVCache.window), so a
step reads what has been decoded, not the whole capacity.

`CompiledDecoder` is a Decoder (meshlm.generate.decoder): the prompts prefill eagerly, as a
PlainDecoder does, into a KVCache that then becomes the static one; every step after is the compiled
forward — the prelude, the loop of every scheme and the coda, at the full depth or with per-token
exit — with the sampling outside it. Under exit the step's decisions (which tokens loop on, whether
the loop ends) stay in Python between compiled pieces (meshlm.generate.steps), so exit is compiled
by torch.compile only, not ahead of time. Speculation (a cache that rolls back) runs its rounds
through the model's compiled stages instead (meshlm.generate.speculative, steps.CompiledStages).
The tokens are the eager path's to floating-point rounding (Inductor fuses what the eager ops round
separately); tests/test_compiled.py checks greedy tokens against it.

Compiling costs seconds (torch.compile caches its work per process and, for Inductor's kernels, on
disk); a compiled step is reused for every call with the same model, batch size and capacity.
`race` compiles it for a generation's shapes and times it against the eager step, so that
`meshlm generate --compile` decodes compiled only where that is faster (as `meshlm serve --compile`
and the kernels' probes choose).
"""
from __future__ import annotations

import time

import torch

from meshlm import machine
from meshlm.errors import ConfigError
from meshlm.generate import steps
from meshlm.generate.ahead import step_for
from meshlm.generate.batch import Batch
from meshlm.generate.decoder import Choose, PlainDecoder, Step
from meshlm.model import MeshLM
from meshlm.model.exit import ExitRule
from meshlm.model.kv_cache import StaticKVCache

COLUMNS = 64  # a static cache's capacity is a multiple of this: fewer distinct compiled shapes
RACE_STEPS, RACE_ROUNDS = 2, 3  # a timed call's steps; the turns each way after an untimed one
AHEAD_PLAIN = ("--aot compiles the plain full-depth step into one library, and exit and "
               "speculation decide per token in Python; use --compile with --exit or --speculate")


def capacity_for(cached: int, new_tokens: int) -> int:
    """Columns for `cached` prompt positions, `new_tokens` decoded ones and the decoded token's own
    column, rounded up to COLUMNS."""
    return -(-(cached + new_tokens + 1) // COLUMNS) * COLUMNS


def check_room(model: MeshLM, prompts: list[list[int]], new_tokens: int) -> None:
    """ConfigError unless the longest prompt, the new tokens and the decoded token's own column
    fit the context (the static cache's last column is the decoded token's nominal one)."""
    need, context = max(map(len, prompts)) + new_tokens + 1, model.config.context_length
    if need > context:
        raise ConfigError(f"a compiled step needs one column beyond the prompt and the new tokens "
                          f"({need} > context_length={context}); decode one token fewer or drop "
                          "--compile")


class CompiledDecoder:
    """Plain decoding at the full depth, or with per-token `exit` (an ExitRule), with a compiled
    step (module docstring). `new_tokens`: the most tokens a row will decode (the static cache's
    room). `compiled=False` runs the same step eagerly over the static cache (what the compiled one
    computes, to rounding); `ahead=True` steps through the same forward compiled ahead of time
    (meshlm.generate.ahead), built or loaded at the prefill (not under exit: ConfigError)."""

    def __init__(self, model: MeshLM, schedule: tuple[int, ...], choose: Choose,
                 new_tokens: int, compiled: bool = True, ahead: bool = False,
                 exit: ExitRule | None = None):
        if ahead and exit is not None:
            raise ConfigError(AHEAD_PLAIN)
        self.model, self.schedule, self.choose = model, schedule, choose
        self.new_tokens, self.ahead, self.exit = new_tokens, ahead, exit
        self.forward = steps.compiled(dynamic=False) if compiled else steps.step
        self.cache: StaticKVCache | None = None
        self.padding: torch.Tensor | None = None
        self.built = None  # with `ahead`: the AOT-compiled step (meshlm.generate.ahead.AheadStep)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
        batch = PlainDecoder(self.model, self.schedule, self.choose, self.exit).prefill(ids, mask)
        # rounded up where the context allows (check_room: the exact need always fits)
        capacity = min(capacity_for(batch.cached, self.new_tokens),
                       max(self.model.config.context_length, batch.cached + self.new_tokens + 1))
        self.cache = StaticKVCache.of(batch.kv, capacity)
        batch.kv = self.cache  # the eager cache is freed; only this decoder's steps use the batch
        # the steps' padding mask: the prompts' columns; each step marks its token's column real,
        # and the batch's mask is a view of it; one spare column past the capacity, as the cache's
        # (a window is never the whole row, whose contiguity would specialise the compiled step)
        self.padding = batch.mask.new_zeros(len(batch), capacity + 1)
        self.padding[:, :batch.cached] = batch.mask
        if self.ahead:
            self.built = step_for(self.model, self.schedule, self.cache,
                                  batch.pending[:, None],
                                  self.padding[:, :min(capacity, COLUMNS)])
        return batch

    @torch.no_grad()
    def step(self, batch: Batch, keep: torch.Tensor | None = None,
             active: torch.Tensor | None = None) -> Step:
        """Feed every row's pending token through the compiled step; its next one."""
        cache, rows = self.cache, len(batch)
        self.padding[:, cache.column] = 1  # the step's token, which the step caches there
        # the columns filled so far and an empty last one (the query's nominal column), rounded up
        # to COLUMNS: one compiled step for every width (StaticKVCache.window)
        width = min(cache.capacity, -(-(cache.column + 2) // COLUMNS) * COLUMNS)
        cache.window = self.padding[:, :width]
        loops = None
        if self.built is not None:
            logits = self.built(batch.pending[:, None], cache.window, cache.at)
        else:
            # under exit the pieces after a decision may specialise to the width (the tracker
            # keeps it as a number): one piece per width there, no error
            mark = torch._dynamo.mark_dynamic if self.exit is None else \
                torch._dynamo.maybe_mark_dynamic
            mark(cache.window, 1)
            logits, loops = self.forward(self.model, self.schedule, batch.pending[:, None],
                                         cache.window, cache, self.exit)
        cache.advance()
        batch.mask = self.padding[:, :cache.column]
        batch.pending = self.choose(logits)
        ran = rows * len(self.schedule) if loops is None else int(loops.sum())
        return Step(batch.pending[:, None].tolist(), [1] * rows, loop_steps=ran)


def race(model: MeshLM, schedule: tuple[int, ...], ids: torch.Tensor, mask: torch.Tensor,
         new_tokens: int, ahead: bool = False, exit: ExitRule | None = None) -> dict | None:
    """Compile the step for a generation of `new_tokens` after prompts ids (B, T) with padding
    mask (B, T) (greedy throwaway copies with the same rows, capacity and `exit`, so that the
    generation then reuses what was compiled), then time it against the eager step as the
    kernels' probes time (machine.race: an untimed call each, then RACE_ROUNDS turns of RACE_STEPS
    steps). Returns machine.race's figures per step ("compiled_ms", "eager_ms") and the
    "seconds" it all took; None where the generation is too short for the throwaway steps (then
    it would not pay either way)."""
    calls = 1 + RACE_ROUNDS
    if new_tokens < calls * RACE_STEPS:
        return None
    start = time.perf_counter()

    def greedy(logits: torch.Tensor) -> torch.Tensor:  # the generation's sampler is left alone
        return logits.argmax(-1)
    fast = CompiledDecoder(model, schedule, greedy, new_tokens, ahead=ahead, exit=exit)
    slow = PlainDecoder(model, schedule, greedy, exit)
    with torch.no_grad():
        racing = {"compiled": (fast, fast.prefill(ids, mask)),
                  "eager": (slow, slow.prefill(ids, mask))}
    raced = machine.race({name: lambda d=d, b=b: [d.step(b) for _ in range(RACE_STEPS)]
                          for name, (d, b) in racing.items()}, RACE_ROUNDS, fastest="compiled")
    return {"compiled_ms": raced["compiled_ms"] / RACE_STEPS,
            "eager_ms": raced["eager_ms"] / RACE_STEPS,
            "seconds": time.perf_counter() - start}
