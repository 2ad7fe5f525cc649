"""Decode speed: looped KV cache vs. recomputation, and MeSH vs. base, side by side in one run;
prints ratios.

    .venv/bin/python benchmarks/decode_speed.py                  # d=256, spec 2+4R2+2, 256 new
                                                                   tokens
    .venv/bin/python benchmarks/decode_speed.py --d-model 512 --spec 4+8R2+4 --batch 4 --threads 2

Comparisons (targets from the Hugging Face / generation issue):
  1. cached vs. uncached greedy decoding of 256 new tokens (MeSH): tokens/s ≥ 5× with the cache.
  2. MeSH vs. base at the same spec, both cached: tokens/s ≥ 0.95×.
  4. (--versus-transformers) a vanilla stack of --layers (default 12) layers at --d-model against
     transformers' GPTNeoXForCausalLM.generate on the same weights: transformers fp32 and bf16,
     meshlm fp32 (what `--dtype auto` decodes in: split_linears' layout, multiplied by the kernel
     meshlm.kernels.fp32_rows compiles where it pays; "fp32 split bmm" without that kernel), fp32
     through plain F.linear, bf16 (weights stored in bf16; products of one or two rows by the
     kernel meshlm.kernels.bf16_rows compiles where it pays, "bf16 F.linear" without it), int8,
     int4, w8a8 (int8 weights and activations; meshlm.quant, every layer and the head;
     "w8a8 _int_mm" without the kernel meshlm.quant.row_kernel compiles; "int8 torch's" without
     the weight-only one meshlm.quant.int8_bf16_kernel compiles) and w4a8 (int4
     weights, int8 activations, by the kernel meshlm.quant.int4_kernel compiles), each with the
     weights `meshlm generate` decodes with, and with the weight bytes each reads per token
     against this core's measured copy bandwidth:
         .venv/bin/python benchmarks/decode_speed.py --versus-transformers --d-model 768 \
             --heads 12 \
             --vocab 50304 --new-tokens 64 --rounds 3 --threads 1
     With --aot, also each meshlm precision (not the "without" rows) through the decode step
     compiled ahead of time (`meshlm generate --aot`, the same weights; its compilation in the
     warm-up call, untimed).
  3. (--append) the cache's in-place appends vs. appending by concatenation (each step copying every
     slot's whole history), MeSH cached; it shows at long contexts:
         .venv/bin/python benchmarks/decode_speed.py --append --skip-uncached --prompt 1024 \
             --new-tokens 128

Each round runs every variant once, in turn (interleaved, so machine noise hits all alike); the
table shows medians. `--clock cpu` measures this process's CPU time instead of wall time: on a
shared machine it ignores the time other jobs hold the cores (use it with --threads 1). Prompts are
random tokens; decoding is greedy with EOS ignored, so every run makes exactly --new-tokens tokens
per row (the time includes the prompt's prefill).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchkit import (
    add_shape_arguments,
    add_timing_arguments,
    bf16_without_kernel,
    decoding_copy,
    interleaved_medians,
    read_bandwidth,
    timing_setup,
    weight_bytes_per_token,
)


def build(scheme: str, args) -> torch.nn.Module:
    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    torch.manual_seed(0)
    cfg = ModelConfig(spec=args.spec, d_model=args.d_model, n_heads=args.heads,
                      vocab_size=args.vocab,
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
    # the cache generate() decodes into
    meshlm.generate.KVCache = concatenating_cache() if concatenate else KVCache
    start = clock()
    out = generate(model, prompts, s, cache=cache)
    elapsed = clock() - start
    meshlm.generate.KVCache = KVCache
    assert all(len(row) == args.new_tokens for row in out)
    return elapsed


def copy_bandwidth(megabytes: int = 256, reps: int = 5) -> float:
    """Bytes/s of the best of `reps` copies between two `megabytes` tensors, both touched first
    (read + write counted; no page faults timed): this core's memory bandwidth."""
    from meshlm import machine

    a, b = torch.ones(megabytes * 2**20 // 4), torch.zeros(megabytes * 2**20 // 4)
    return 2 * a.numel() * 4 / machine.best_seconds(lambda: b.copy_(a), reps)


def versus_transformers(args) -> None:
    """Comparison 4 (module docstring): interleaved rounds, medians, ratios."""
    import copy

    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from meshlm.backbones import BACKBONES
    from meshlm.config import ModelConfig
    from meshlm.generate import Sampling, generate
    from meshlm.interop.families import from_meshlm, hf_config_kwargs
    from meshlm.model import MeshLM
    from meshlm.quant import PARTS, quantize_model
    from meshlm.runtime import precision

    torch.manual_seed(0)
    # one column past the new tokens: --aot's static cache holds the decoded token's own
    cfg = ModelConfig(spec=str(args.layers), d_model=args.d_model, n_heads=args.heads,
                      vocab_size=args.vocab,
                      context_length=args.prompt + args.new_tokens + 1, scheme="vanilla",
                      scale_embeddings=False)
    ours = MeshLM(cfg).eval()
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_kwargs(cfg, BACKBONES["neox"]))).eval()
    hf.load_state_dict(from_meshlm(ours.state_dict(), cfg.layout, BACKBONES["neox"]), strict=False)
    bf16, fp32 = precision.Precision(torch.bfloat16,
                                     "as requested"), precision.Precision(None, "as requested")
    models = {"transformers fp32": hf, "transformers bf16": copy.deepcopy(hf).to(torch.bfloat16),
              "meshlm fp32": decoding_copy(ours, "auto")[0], "meshlm fp32 F.linear": ours,
              "meshlm bf16": decoding_copy(ours, "bf16")[0],
              "meshlm bf16 F.linear": bf16_without_kernel(ours)[0],
              "meshlm int8": decoding_copy(quantize_model(ours, 8, PARTS, activations="bf16")[0],
                                           "auto")[0],
              "meshlm w8a8": decoding_copy(quantize_model(ours, 8, PARTS, activations="int8")[0],
                                           "auto")[0],
              "meshlm int4": decoding_copy(quantize_model(ours, 4, PARTS)[0], "auto")[0],
              "meshlm w4a8": decoding_copy(quantize_model(ours, 4, PARTS, activations="int8")[0],
                                           "auto")[0]}
    models["meshlm w8a8 _int_mm"] = without_row_kernel(models["meshlm w8a8"])
    models["meshlm int8 torch's"] = without_row_kernel(models["meshlm int8"])
    models["meshlm fp32 split bmm"] = split_without_kernel(ours)
    pairs = PAIRS
    if args.aot:  # the same models through the AOT-compiled step (step() below)
        for name in AOT:
            models[f"{name} AOT"] = models[name]
        pairs += tuple((f"{name} AOT", name) for name in AOT) + AOT_PAIRS
    prompt = torch.randint(2, args.vocab, (1, args.prompt),
                           generator=torch.Generator().manual_seed(0))
    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)

    def step(name: str, model):
        def run():
            policy = bf16 if name.startswith("meshlm bf16") else fp32
            with torch.no_grad(), precision.autocast(CPU, policy):
                if name.startswith("transformers"):
                    model.generate(prompt, max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens,
                                   do_sample=False, pad_token_id=0)
                else:
                    generate(model, prompt.tolist(), s,
                             compile="aot" if name.endswith(" AOT") else False)
        return run

    t = interleaved_medians({name: step(name, m) for name, m in models.items()}, args.rounds,
                            clock_of(args))
    rate = {name: args.new_tokens / sec for name, sec in t.items()}
    copying, reading = copy_bandwidth(), read_bandwidth()
    print(f"vanilla {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, batch 1, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds (medians); copy bandwidth {copying / 1e9:.1f} GB/s, read "
          f"bandwidth {reading / 1e9:.1f} GB/s")
    for name, r in rate.items():
        moved = weight_bytes_per_token(models[name]) * r
        print(f"  {name:<20} {r:7.2f} tokens/s  weights {moved / 1e9:5.2f} GB/s = "
              f"{moved / reading:4.0%} of read, {moved / copying:4.0%} of copy bandwidth")
    for a, b in pairs:
        print(f"{a} / {b}: {rate[a] / rate[b]:.2f}x")


# the ratios versus_transformers prints
PAIRS = (("meshlm fp32", "transformers fp32"), ("meshlm fp32", "meshlm fp32 F.linear"),
         ("meshlm fp32", "meshlm fp32 split bmm"),
         ("meshlm fp32 split bmm", "transformers fp32"),
         ("meshlm fp32", "transformers bf16"), ("meshlm bf16", "transformers bf16"),
         ("meshlm bf16", "meshlm bf16 F.linear"),
         ("meshlm bf16", "transformers fp32"), ("meshlm int8", "transformers fp32"),
         ("meshlm int8", "meshlm fp32"), ("meshlm int8", "meshlm int8 torch's"),
         ("meshlm w8a8", "transformers fp32"),
         ("meshlm w8a8", "meshlm fp32"), ("meshlm w8a8", "meshlm int8"),
         ("meshlm w8a8", "meshlm w8a8 _int_mm"), ("meshlm w8a8 _int_mm", "meshlm fp32"),
         ("meshlm int4", "meshlm fp32"), ("meshlm w4a8", "meshlm fp32"),
         ("meshlm w4a8", "meshlm int4"), ("meshlm w4a8", "meshlm w8a8"),
         ("meshlm w4a8", "transformers fp32"), ("meshlm bf16", "meshlm fp32"))
# with --aot: these through `generate --aot` too, each against itself eager, and these ratios
AOT = ("meshlm fp32", "meshlm bf16", "meshlm int8", "meshlm w8a8", "meshlm int4", "meshlm w4a8")
AOT_PAIRS = (("meshlm fp32 AOT", "transformers fp32"), ("meshlm bf16 AOT", "transformers fp32"),
             ("meshlm w8a8 AOT", "meshlm fp32 AOT"), ("meshlm w4a8 AOT", "meshlm int4 AOT"))

CPU = torch.device("cpu")


def split_without_kernel(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` laid out as fp32 decoding is without the kernel meshlm.kernels.fp32_rows
    compiles (one block per thread, torch.bmm at every row count): what that kernel buys."""
    import copy

    from meshlm.runtime.split_linear import split_linears, split_tied_head

    model = copy.deepcopy(model)
    split_linears(model)
    split_tied_head(model)
    return model


def without_row_kernel(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a decoding-ready int8 model whose products go through torch's kernels
    (torch._int_mm for w8a8, torch._weight_int8pack_mm for weight-only), not the kernel meshlm
    compiled (meshlm.quant.row_kernel, .int8_bf16_kernel): what that kernel buys."""
    import copy

    from meshlm.quant import QuantizedLinear

    model = copy.deepcopy(model)
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            layer.row_kernel = None
    return model


def clock_of(args):
    return time.process_time if args.clock == "cpu" else time.perf_counter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    add_timing_arguments(p, rounds=5)
    p.add_argument("--skip-uncached", action="store_true",
                   help="only MeSH vs. base (uncached is slow at size)")
    p.add_argument("--append", action="store_true",
                   help="also MeSH cached with appends by concatenation")
    p.add_argument("--versus-transformers", action="store_true",
                   help="comparison 4 (module docstring) only")
    p.add_argument("--aot", action="store_true",
                   help="with --versus-transformers: each precision through `generate --aot` too")
    p.add_argument("--layers", type=int, default=12,
                   help="with --versus-transformers: the vanilla stack's depth")
    args = p.parse_args()
    timing_setup(args)
    if args.versus_transformers:
        return versus_transformers(args)

    models = {"mesh": build("mesh", args), "base": build("base", args)}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab, (args.batch, args.prompt), generator=g).tolist()
    variants = {"mesh cached": ("mesh", True), "base cached": ("base", True),
                "mesh uncached": ("mesh", False)}
    if args.skip_uncached:
        del variants["mesh uncached"]
    if args.append:
        variants["mesh cat-append"] = ("mesh", "concatenate")
    # warm-up
    decode_seconds(models["mesh"], prompts, argparse.Namespace(**{**vars(args), "new_tokens": 4}),
                   True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (scheme, cache) in variants.items():
            times[name].append(decode_seconds(models[scheme], prompts, args, bool(cache),
                                              cache == "concatenate"))

    tokens = args.batch * args.new_tokens
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"spec {args.spec}, d_model {args.d_model}, vocab {args.vocab}, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{args.clock} clock, {args.rounds} rounds (medians)")
    for name, r in rate.items():
        print(f"  {name:<14} {r:9.1f} tokens/s   ({statistics.median(times[name]):.2f} s)")
    if "mesh uncached" in rate:
        speedup = rate["mesh cached"] / rate["mesh uncached"]
        print(f"cache speed-up (MeSH):      {speedup:6.2f}x   target >= 5x    "
              f"{'ok' if speedup >= 5 else 'MISSED'}")
    if "mesh cat-append" in rate:
        print("in-place / concatenating appends (MeSH cached): "
              f"{rate['mesh cached'] / rate['mesh cat-append']:6.3f}x")
    ratio = rate["mesh cached"] / rate["base cached"]
    print(f"MeSH / base (cached):       {ratio:6.3f}x   target >= 0.95x "
          f"{'ok' if ratio >= 0.95 else 'MISSED'}")


if __name__ == "__main__":
    main()
