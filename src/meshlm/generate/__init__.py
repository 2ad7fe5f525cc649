"""Text generation with the looped KV cache: sampling, batching with left padding, streaming.

    stream(model, prompts, Sampling(temperature=0.8, top_k=50))   -> yields the next token of every
                                                                  row
    generate(model, prompts, Sampling(...))                       -> the new tokens of every row

Prompts of different lengths are left-padded into one batch; the padding mask covers cached tokens
too and positions count real tokens only, so every row decodes exactly as it would alone. The prompt
is prefilled once, then each step feeds one token per row (meshlm.model.kv_cache: one entry per
unrolled layer; the MeSH buffer is per token and needs no cache). `cache=False` recomputes the whole
sequence every step, as a reference and for the speed benchmark. Temperature 0 is greedy decoding.
`loops` runs the core that many times; `exit` (an ExitRule, e.g. ExitRule.parse("state:0.05"),
meshlm.model.exit) lets each token stop looping once it has converged; `speculate` (a Speculation,
e.g. Speculation.parse("auto"), "K_d" or "K_d:γ") decodes the same tokens (greedy) or the same
distribution (sampling) by lossless self-speculation, the shallow loops drafting for the full depth
(meshlm.generate.speculative). Settings are typed: text is parsed once, where it comes in (the CLI,
an HTTP body, a YAML file).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from meshlm.errors import ConfigError
from meshlm.generate import compiled, speculative
from meshlm.generate.batch import Batch
from meshlm.generate.compiled import CompiledDecoder
from meshlm.generate.decoder import Decoder, PlainDecoder, Step, check_room, decode
from meshlm.generate.sampling import (
    SEED_RANGE,
    Sampling,
    draw,
    left_pad,
    next_token,
    padding_if_any,
    probabilities,
)
from meshlm.generate.speculative import Speculation, SpeculationStats, SpeculativeDecoder
from meshlm.model import MeshLM
from meshlm.model.exit import ExitRule

__all__ = ["LOOP_CAP_FACTOR", "SEED_RANGE", "Batch", "Decoder", "PlainDecoder", "Sampling",
           "Speculation", "SpeculationStats", "SpeculativeDecoder", "Step", "check_loops",
           "check_room", "decode", "draw", "generate", "left_pad", "loop_cap", "next_token",
           "probabilities", "stream"]

# decoding runs at most this many times the trained loop count unless the caller raises the cap
# (meshlm generate / serve --max-loops): the depth study tests stability up to 4K, and past it a
# request's cost grows with no evidence that its answers do
LOOP_CAP_FACTOR = 4


def loop_cap(model: MeshLM, max_loops: int | None = None) -> int:
    """The most core passes a decoding request may ask for: `max_loops`, else LOOP_CAP_FACTOR times
    the trained count."""
    return max_loops or LOOP_CAP_FACTOR * len(model.schedule())


def check_loops(model: MeshLM, loops: int | None, max_loops: int | None = None) -> None:
    """ConfigError (one line, naming the fix) unless `loops` is None or 1 … loop_cap on a
    single-core spec."""
    if loops is None:
        return
    cap = loop_cap(model, max_loops)
    if loops > cap:  # before the schedule is built: a loops of 10^20 must not build it
        why = ("--max-loops" if max_loops else
               f"{LOOP_CAP_FACTOR}x the trained {len(model.schedule())}")
        raise ConfigError(f"loops={loops} is more than this model decodes with (at most {cap}: "
                          f"{why}); ask for {cap} or fewer, or raise the cap with --max-loops")
    model.schedule(loops)  # single-core spec, loops >= 1


@torch.no_grad()
def stream(model: MeshLM, prompts: list[list[int]], s: Sampling, eos_id: int = 0, pad_id: int = 1,
           cache: bool = True, loops: int | None = None, exit: ExitRule | None = None,
           speculate: Speculation | None = None, stats=None,
           observe=None, compile: bool | str = False) -> Iterator[torch.Tensor]:
    """Yield the (B,) next tokens step by step: a PlainDecoder (or, with `speculate`, a
    SpeculativeDecoder) run by `decode`. Rows that reached EOS keep yielding `pad_id`.

    `observe(out, mask)`, if given, sees every forward's LMOutput with the (B, T) padding mask of
    its new positions (under exit, out.exit_loops says how many loop steps each position ran).

    `speculate` (a meshlm.generate.speculative.Speculation) decodes by
    lossless self-speculation (meshlm.generate.speculative): the same tokens when greedy, the same
    distribution when sampling; `stats` (a SpeculationStats) then receives the acceptance rate,
    tokens/s and the chosen setting.

    `compile` decodes through one compiled step over a static cache (meshlm.generate.compiled:
    plain decoding at the full depth or with `exit`, the same tokens to floating-point rounding):
    True or "jit" by torch.compile, "aot" compiled ahead of time by AOTInductor
    (meshlm.generate.ahead; not with `exit` or `speculate`); with `speculate`, the rounds run
    through the model's compiled stages (meshlm.generate.speculative)."""
    if compile and (not cache or observe):
        raise ConfigError("--compile decodes with the KV cache; drop --no-cache (or --compile)")
    if compile == "aot" and (exit is not None or speculate is not None):
        raise ConfigError(compiled.AHEAD_PLAIN)
    if speculate is not None:
        if not cache or exit is not None:
            raise ConfigError("speculative decoding needs the KV cache and the full depth; drop "
                              "--no-cache (cache=False) and --exit")
        yield from speculative.stream(model, prompts, s, speculate, eos_id, pad_id, loops, stats,
                                      bool(compile))
        return
    device = next(model.parameters()).device
    check_room(model, prompts, s)
    if compile:
        compiled.check_room(model, prompts, s.max_new_tokens)
    ids, mask = left_pad(prompts, pad_id, device)
    generator = None if s.seed is None else torch.Generator(device).manual_seed(s.seed)

    def choose(logits: torch.Tensor) -> torch.Tensor:
        return next_token(logits, s, generator)
    if not cache:
        yield from _recomputed(model, ids, mask, s, eos_id, pad_id, loops, exit, choose, observe)
        return
    schedule = model.schedule(loops)
    decoder = CompiledDecoder(model, schedule, choose, s.max_new_tokens,
                              ahead=compile == "aot", exit=exit) if compile else \
        PlainDecoder(model, schedule, choose, exit, observe)
    yield from decode(decoder, decoder.prefill(ids, mask), s, eos_id, pad_id)


def _recomputed(model: MeshLM, ids: torch.Tensor, mask: torch.Tensor, s: Sampling, eos_id: int,
                pad_id: int, loops: int | None, exit: ExitRule | None, choose, observe
                ) -> Iterator[torch.Tensor]:
    """`stream` with cache=False: the whole sequence through the model at every step, the
    reference the decoders are checked against."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(s.max_new_tokens):
        out = model(ids, padding_mask=padding_if_any(mask), loops=loops, exit=exit)
        if observe is not None:
            observe(out, mask)
        token = choose(out.logits[:, -1]).masked_fill(done, pad_id)  # (B,)
        yield token
        done |= (token == eos_id) & s.stop_at_eos
        if done.all():
            return
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)


def generate(model: MeshLM, prompts: list[list[int]], s: Sampling, eos_id: int = 0, pad_id: int = 1,
             cache: bool = True, loops: int | None = None, exit: ExitRule | None = None,
             speculate: Speculation | None = None, stats=None,
             observe=None, compile: bool | str = False) -> list[list[int]]:
    """The new tokens of every row, up to and including EOS (when stop_at_eos). `speculate`,
    `stats`, `observe`, `compile`: see `stream`."""
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    for token in stream(model, prompts, s, eos_id, pad_id, cache, loops, exit, speculate, stats,
                        observe, compile):
        for row, t in enumerate(token.tolist()):
            if not finished[row]:
                out[row].append(t)
                finished[row] = s.stop_at_eos and t == eos_id
    return out
