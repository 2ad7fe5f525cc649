"""Decoding with the weights on 2 MB pages (meshlm.runtime.huge_pages: what `meshlm serve` and a
long `meshlm generate` do on Linux) against the same model on the 4 KB pages the allocator gave
it, and what collapsing them cost.

    .venv/bin/python benchmarks/huge_pages.py --threads 2
    .venv/bin/python benchmarks/huge_pages.py --threads 2 --compile aot --precisions int4,w4a8

At d = 768 (12 layers, vocabulary 50304, batch 1), per precision: two copies of one model laid
out as meshlm generate decodes it, one with its weights' memory collapsed into 2 MB pages and one
without (meshlm.decoding.prepare(huge=False)); ms a decoded token of each (compile_decode.step_ms:
a generation of --new-tokens against one of a single token, prefill excluded), eager or through
the compiled step (`--compile jit|aot`), both copies in the same interleaved rounds, the ratio,
the seconds `prepare` took each way and the steps after which the collapse has paid for itself.
Where Linux cannot give 2 MB pages the precision line says why and the ratio is ~1.
"""
from __future__ import annotations

import argparse
import time

import torch
from benchkit import add_timing_arguments, timing_setup
from compile_decode import precisions, step_ms, variant


def main() -> None:
    from meshlm.config import ModelConfig
    from meshlm.generate import Sampling
    from meshlm.model import MeshLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", type=precisions, default="fp32,bf16,w8a8,int4,w4a8")
    p.add_argument("--compile", choices=("eager", "jit", "aot"), default="eager")
    p.add_argument("--new-tokens", type=int, default=64)
    add_timing_arguments(p, rounds=5)
    args = p.parse_args()
    args.batch = 1
    clock = timing_setup(args)
    torch.manual_seed(0)
    model = MeshLM(ModelConfig(spec="12", d_model=768, n_heads=12, vocab_size=50304,
                               context_length=256, scheme="vanilla",
                               scale_embeddings=False)).eval()
    prompts = torch.randint(2, 50304, (1, 32), generator=torch.Generator().manual_seed(0)).tolist()
    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)
    compile = {"eager": False, "jit": True, "aot": "aot"}[args.compile]
    print(f"12 vanilla, d_model 768, batch 1, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, {args.compile}, {args.rounds} rounds (medians)")
    for name in args.precisions:
        runs, seconds = {}, {}
        for pages in ("4 KB", "2 MB"):
            start = time.perf_counter()
            runs[pages] = (*variant(model, name, huge=pages == "2 MB"), compile)
            seconds[pages] = time.perf_counter() - start
        note = runs["2 MB"][1].reason.split("; ")[-1]
        ms, _ = step_ms(runs, prompts, s, args, clock)
        cost, saved = seconds["2 MB"] - seconds["4 KB"], ms["4 KB"] - ms["2 MB"]
        paid = f"paid back after {cost * 1e3 / saved:,.0f} steps" if saved > 0 else "never paid"
        print(f"  {name:5s} 2 MB pages {ms['2 MB']:6.2f} ms a token, 4 KB pages "
              f"{ms['4 KB']:6.2f}: {ms['4 KB'] / ms['2 MB']:.2f}x; laid out in "
              f"{seconds['2 MB']:.2f} s against {seconds['4 KB']:.2f}: {paid} ({note})",
              flush=True)
        del runs


if __name__ == "__main__":
    main()
