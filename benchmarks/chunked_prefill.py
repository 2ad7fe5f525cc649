"""Chunked prefill in continuous batching (meshlm.serve.batcher, `prefill_chunk`): what a long
prompt arriving among decoding rows costs them, whole prompts against chunks.

    .venv/bin/python benchmarks/chunked_prefill.py                    # d=256, 2+2R4+2 MeSH
    .venv/bin/python benchmarks/chunked_prefill.py --chunks 0,64,256 --prompt 1536

--rows requests decode all the time (each replaced when it finishes); every --every token
boundaries a request with a --prompt-token prompt arrives. Per setting: the running rows'
inter-token latency (the time between two tokens of one request, p50 / p99 / max), the long
requests' time to first token, and tokens/s over the run. Greedy, EOS ignored, random weights (only
the timing matters); each setting runs the same schedule of arrivals, --rounds times in turn
(interleaved), and the table shows medians over rounds of each figure.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchkit import add_shape_arguments, add_timing_arguments, timing_setup

from meshlm.config import ModelConfig
from meshlm.generate import Sampling
from meshlm.model import MeshLM
from meshlm.serve.batcher import Batcher, Request


def run(model, chunk: int | None, args) -> dict[str, float]:
    """One run of the schedule; the figures of the module docstring."""
    batcher = Batcher(model, eos_id=-1, pad_id=1, max_batch=args.rows + 4, prefill_chunk=chunk)
    g = torch.Generator().manual_seed(0)
    stamps: dict[int, list[float]] = {}

    def request(length: int, tokens: int) -> Request:
        prompt = torch.randint(2, args.vocab, (length,), generator=g).tolist()
        r = Request(prompt, Sampling(max_new_tokens=tokens, temperature=0, stop_at_eos=False),
                    on_tokens=lambda r, new: stamps[r.id].extend([time.perf_counter()] * len(new)))
        stamps[r.id] = [time.perf_counter()]  # submission: the first gap is time to first token
        batcher.submit(r)
        return r

    short = [request(16, args.tokens) for _ in range(args.rows)]
    long = []
    start = time.perf_counter()
    for step in range(args.steps):
        if step % args.every == args.every // 2:
            long.append(request(args.prompt, 4))
        short = [r if not r.done.is_set() else request(16, args.tokens) for r in short]
        batcher.step()
    seconds = time.perf_counter() - start
    long_ids = {r.id for r in long}
    gaps = [b - a for rid, t in stamps.items() if rid not in long_ids
            for a, b in zip(t[1:], t[2:]) if b > a]  # between tokens; several at once count once
    gaps.sort()
    return {"itl p50": gaps[len(gaps) // 2] * 1e3, "itl p99": gaps[int(len(gaps) * 0.99)] * 1e3,
            "itl max": gaps[-1] * 1e3,
            "long ttft": statistics.median(stamps[r.id][1] - stamps[r.id][0] for r in long
                                           if len(stamps[r.id]) > 1) * 1e3,
            "tokens/s": batcher.stats.tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.set_defaults(spec="2+2R4+2")
    p.add_argument("--rows", type=int, default=8, help="requests decoding all the time")
    p.add_argument("--tokens", type=int, default=48, help="tokens per decoding request")
    p.add_argument("--prompt", type=int, default=1024, help="the arriving requests' prompt tokens")
    p.add_argument("--every", type=int, default=40, help="token boundaries between arrivals")
    p.add_argument("--steps", type=int, default=200, help="token boundaries per run")
    p.add_argument("--chunks", default="0,64,128,256", help="prefill_chunk values (0: whole)")
    add_timing_arguments(p, rounds=3)
    args = p.parse_args()
    timing_setup(args)
    torch.manual_seed(0)
    model = MeshLM(ModelConfig(spec=args.spec, d_model=args.d_model, n_heads=args.heads,
                               vocab_size=args.vocab, context_length=args.prompt + 64,
                               scheme="mesh")).eval()
    chunks = [int(c) or None for c in args.chunks.split(",")]
    figures: dict[int | None, list[dict]] = {c: [] for c in chunks}
    with torch.no_grad():
        for _ in range(args.rounds):
            for chunk in chunks:
                figures[chunk].append(run(model, chunk, args))
    print(f"spec {args.spec}, d_model {args.d_model}, {args.rows} decoding rows, a "
          f"{args.prompt}-token prompt every {args.every} boundaries, {args.steps} boundaries, "
          f"{torch.get_num_threads()} threads, medians of {args.rounds} rounds")
    whole = None
    for chunk, runs in figures.items():
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        whole = whole or median
        print(f"  chunk {chunk or 'whole':>5}: inter-token p50 {median['itl p50']:6.1f} ms, p99 "
              f"{median['itl p99']:6.1f} ms, max {median['itl max']:6.1f} ms; long prompt's first "
              f"token {median['long ttft']:6.1f} ms; {median['tokens/s']:6.1f} tokens/s "
              f"(p99 / whole {median['itl p99'] / whole['itl p99']:.2f}x, tokens/s / whole "
              f"{median['tokens/s'] / whole['tokens/s']:.2f}x)")


if __name__ == "__main__":
    main()
