"""Decode speed: looped KV cache vs. recomputation, and MeSH vs. base, side by side in one run; prints ratios.

    .venv/bin/python benchmarks/decode_speed.py                  # d=256, spec 2+4R2+2, 256 new tokens
    .venv/bin/python benchmarks/decode_speed.py --d-model 512 --spec 4+8R2+4 --batch 4 --threads 2

Comparisons (targets from the Hugging Face / generation issue):
  1. cached vs. uncached greedy decoding of 256 new tokens (MeSH): tokens/s ≥ 5× with the cache.
  2. MeSH vs. base at the same spec, both cached: tokens/s ≥ 0.95×.
  3. (--append) the cache's in-place appends vs. appending by concatenation (each step copying every slot's
     whole history), MeSH cached; it shows at long contexts:
         .venv/bin/python benchmarks/decode_speed.py --append --skip-uncached --prompt 1024 --new-tokens 128

Each round runs every variant once, in turn (interleaved, so machine noise hits all alike); the table shows
medians. `--clock cpu` measures this process's CPU time instead of wall time: on a shared machine it
ignores the time other jobs hold the cores (use it with --threads 1). Prompts are random tokens; decoding
is greedy with EOS ignored, so every run makes exactly --new-tokens tokens per row (the time includes the
prompt's prefill).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchkit import add_shape_arguments, add_timing_arguments, timing_setup


def build(scheme: str, args) -> torch.nn.Module:
    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    torch.manual_seed(0)
    cfg = ModelConfig(spec=args.spec, d_model=args.d_model, n_heads=args.heads, vocab_size=args.vocab,
                      context_length=args.prompt + args.new_tokens, scheme=scheme)
    return MeshLM(cfg).eval()


def concatenating_cache() -> type:
    """The KV cache appending by concatenation (meshlm's cache before its in-place appends)."""
    from meshlm.model.kv_cache import KVCache

    class ConcatenatingCache(KVCache):
        def write(self, i, key, value):
            return self.concatenate(i, key, value)

    return ConcatenatingCache


def decode_seconds(model, prompts, args, cache: bool, concatenate: bool = False) -> float:
    import meshlm.generate
    from meshlm.generate import Sampling, generate
    from meshlm.model.kv_cache import KVCache

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)
    meshlm.generate.KVCache = concatenating_cache() if concatenate else KVCache  # the cache generate() decodes into
    start = clock()
    out = generate(model, prompts, s, cache=cache)
    elapsed = clock() - start
    meshlm.generate.KVCache = KVCache
    assert all(len(row) == args.new_tokens for row in out)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    add_timing_arguments(p, rounds=5)
    p.add_argument("--skip-uncached", action="store_true", help="only MeSH vs. base (uncached is slow at size)")
    p.add_argument("--append", action="store_true", help="also MeSH cached with appends by concatenation")
    args = p.parse_args()
    timing_setup(args)

    models = {"mesh": build("mesh", args), "base": build("base", args)}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab, (args.batch, args.prompt), generator=g).tolist()
    variants = {"mesh cached": ("mesh", True), "base cached": ("base", True), "mesh uncached": ("mesh", False)}
    if args.skip_uncached:
        del variants["mesh uncached"]
    if args.append:
        variants["mesh cat-append"] = ("mesh", "concatenate")
    decode_seconds(models["mesh"], prompts, argparse.Namespace(**{**vars(args), "new_tokens": 4}), True)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (scheme, cache) in variants.items():
            times[name].append(decode_seconds(models[scheme], prompts, args, bool(cache), cache == "concatenate"))

    tokens = args.batch * args.new_tokens
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"spec {args.spec}, d_model {args.d_model}, vocab {args.vocab}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"{args.rounds} rounds (medians)")
    for name, r in rate.items():
        print(f"  {name:<14} {r:9.1f} tokens/s   ({statistics.median(times[name]):.2f} s)")
    if "mesh uncached" in rate:
        speedup = rate["mesh cached"] / rate["mesh uncached"]
        print(f"cache speed-up (MeSH):      {speedup:6.2f}x   target >= 5x    {'ok' if speedup >= 5 else 'MISSED'}")
    if "mesh cat-append" in rate:
        print(f"in-place / concatenating appends (MeSH cached): {rate['mesh cached'] / rate['mesh cat-append']:6.3f}x")
    ratio = rate["mesh cached"] / rate["base cached"]
    print(f"MeSH / base (cached):       {ratio:6.3f}x   target >= 0.95x {'ok' if ratio >= 0.95 else 'MISSED'}")


if __name__ == "__main__":
    main()
