"""Greedy decoding in fp32 and in bf16, each with the weights `meshlm generate --dtype` decodes with
(fp32 laid out by split_linears, bf16 stored): how often each decoding path changes the tokens,
and what decoding in fp32 costs. The measurement behind `--dtype auto` = fp32 for decoding
(docs/serve.md).

    .venv/bin/python benchmarks/decode_precision.py RUN --prompts 30 --new-tokens 32 --threads 1

For each precision the reference is every prompt decoded alone, cached, plainly (meshlm.generate). A
prompt counts as a mismatch when any of its tokens differs on another path:
    batched     all prompts in one left-padded batch
    uncached    the whole sequence recomputed at every step (cache=False)
    speculate   --speculate K_d:γ (lossless in exact arithmetic)
    served      the continuous batcher (meshlm.serve.batcher), one request joining per token
                boundary
Then where the differences come from, per precision: the largest logit difference between a row
decoded alone and in a batch (rows are independent when it is 0: the matmuls are batch-invariant)
and between cached decoding and one forward over the whole sequence (0 only if every reduction is
the same whatever the number of new tokens). Then the speed of plain cached decoding at batch 1
and 16, fp32 vs bf16, as interleaved medians and ratios. Prompts are windows of the held-out
documents (benchkit.corpus_windows); EOS is ignored.
"""
from __future__ import annotations

import argparse

import torch
from benchkit import (
    add_timing_arguments,
    corpus_windows,
    decoding_copy,
    interleaved_medians,
    timing_setup,
)

PRECISIONS = ("fp32", "bf16")  # --dtype values


def autocast(chosen):
    from meshlm.runtime import precision

    return precision.autocast(torch.device("cpu"), chosen)


def paths(model, prompts, n: int, speculate: str, pad_id: int) -> dict[str, list[list[int]]]:
    """Each path's tokens for every prompt."""
    from meshlm.generate import Sampling, generate
    from meshlm.generate.speculative import Speculation
    from meshlm.serve.batcher import Batcher, Request

    s = Sampling(max_new_tokens=n, temperature=0, stop_at_eos=False)
    out = {"alone": [generate(model, [p], s, pad_id=pad_id)[0] for p in prompts],
           "batched": generate(model, prompts, s, pad_id=pad_id),
           "uncached": [generate(model, [p], s, pad_id=pad_id, cache=False)[0] for p in prompts],
           "speculate": [generate(model, [p], s, pad_id=pad_id,
                                  speculate=Speculation.parse(speculate))[0]
                         for p in prompts]}
    batcher, requests = Batcher(model, eos_id=-1, pad_id=pad_id,
                                max_batch=16), [Request(p, s) for p in prompts]
    waiting = list(requests)
    while waiting or batcher.step():
        if waiting:
            batcher.submit(waiting.pop(0))
        batcher.step()
    out["served"] = [r.tokens for r in requests]
    return out


def mismatches(models, prompts, args, pad_id: int) -> None:
    for name, (model, chosen) in models.items():
        with torch.no_grad(), autocast(chosen):
            out = paths(model, prompts, args.new_tokens, args.speculate, pad_id)
        ref = out.pop("alone")
        counts = {path: sum(a != b for a, b in zip(ref, rows)) for path, rows in out.items()}
        tokens = {path: sum(x != y for a, b in zip(ref, rows) for x, y in zip(a, b))
                  for path, rows in out.items()}
        total = len(prompts) * args.new_tokens
        print(f"{name}: prompts differing from plain decoding alone (of {len(prompts)}; tokens of "
              f"{total}): "
              + ", ".join(f"{p} {counts[p]} ({tokens[p]})" for p in counts), flush=True)


def logit_differences(models, prompts) -> None:
    """Max |Δ logit| of a batch row vs. the row alone, and of cached token-by-token decoding vs. one
    forward over the sequence, in fp32 and under bf16 (equal-length prompts: no padding)."""
    from meshlm.model.kv_cache import KVCache

    x = torch.tensor(prompts[:8])  # (8, T)
    half = x.shape[1] // 2
    for name, (model, chosen) in models.items():
        with torch.no_grad(), autocast(chosen):
            whole = model(x).logits.float()
            alone = model(x[:1]).logits.float()
            cache = KVCache()
            steps = [model(x[:, :half], cache=cache).logits]
            steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(half, x.shape[1])]
            cached = torch.cat(steps, 1).float()
        batch = (whole[:1] - alone).abs().max().item()
        incremental = (whole - cached).abs().max().item()
        print(f"{name}: max |Δ logit| batch row vs. alone {batch:.3g}, cached vs. whole sequence "
              f"{incremental:.3g}", flush=True)


def speeds(models, prompts, args, pad_id: int, clock) -> None:
    from meshlm.generate import Sampling, generate

    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)
    for batch in (1, 16):
        rows = (prompts * 16)[:batch]

        def run(model, chosen, rows=rows):
            def step():
                with torch.no_grad(), autocast(chosen):
                    generate(model, rows, s, pad_id=pad_id)
            return step
        t = interleaved_medians({name: run(*pair) for name, pair in models.items()},
                                args.rounds, clock)
        rate = {name: batch * args.new_tokens / sec for name, sec in t.items()}
        print(f"batch {batch}: fp32 {rate['fp32']:.0f} tokens/s, bf16 {rate['bf16']:.0f} tokens/s; "
              f"fp32/bf16 speed {rate['fp32'] / rate['bf16']:.2f}x", flush=True)


def main() -> None:
    from meshlm.loading import open_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a looped model folder (meshlm.loading)")
    p.add_argument("--prompts", type=int, default=30)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--speculate", default="2:3",
                   help="the speculation setting compared (default 2:3)")
    add_timing_arguments(p, rounds=3)
    args = p.parse_args()
    clock = timing_setup(args)
    opened = open_model(args.checkpoint)
    prompts = corpus_windows(opened.tokenizer, args.prompts, args.prompt_tokens)
    models = {name: decoding_copy(opened.model, name) for name in PRECISIONS}
    mismatches(models, prompts, args, opened.tokenizer.pad_id)
    logit_differences(models, prompts)
    speeds(models, prompts, args, opened.tokenizer.pad_id, clock)


if __name__ == "__main__":
    main()
