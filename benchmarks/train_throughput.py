"""Training throughput and MFU of the default `meshlm train` config, next to transformers' GPT-NeoX.

    .venv/bin/python benchmarks/train_throughput.py
        # the default config, 6 timed steps each
    .venv/bin/python benchmarks/train_throughput.py --rounds 10 model.d_model=256
        # any train overrides
    .venv/bin/python benchmarks/train_throughput.py --clock cpu --threads 1
        # on a busy machine

Every model runs the same optimizer step on the same real batches (the default corpus, the default
config's global batch, micro-batches and sequence length): forward + backward per micro-batch, grad
clip 1.0, fused AdamW (as the trainer). Models:
  meshlm        the default config (MeSH)
  meshlm-plain  meshlm with the same layout as a vanilla stack of the unrolled depth (same FLOPs)
  hf-neox       transformers' GPTNeoXForCausalLM of that vanilla shape (SDPA attention)

MFU = tokens/s × train FLOPs per token (meshlm.model.accounting; the same figure for all three,
since they do the same matmuls) / the fp32 matmul peak the trainer uses (meshlm.runtime.peaks:
measured once per machine and thread count, cached with its date and method; printed with its
source). The best 2048³ GEMM of this run (before and after) is printed beside it, and MFU against it
too, as a check on the cached figure. Timing interleaves the models round by round so machine noise
hits all alike, and reports medians. `--clock cpu --threads 1` times with this process's CPU time
(peak included), so other processes on a shared machine distort the figures much less; MFU is then
per core. Targets (issue 3): meshlm MFU >= 50%, tokens/s >= 1.0× hf-neox.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from benchkit import add_timing_arguments, timing_setup


def build_models(model_cfg):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from meshlm.backbones import BACKBONES
    from meshlm.interop.families import hf_config_kwargs
    from meshlm.model import MeshLM

    plain_cfg = model_cfg.replace(spec=str(model_cfg.layout.unrolled_depth), scheme="vanilla",
                                  scheme_options={})
    torch.manual_seed(0)
    hf_config = GPTNeoXConfig(**hf_config_kwargs(plain_cfg, BACKBONES["neox"]))
    hf_config._attn_implementation = "sdpa"
    return {"meshlm": MeshLM(model_cfg), "meshlm-plain": MeshLM(plain_cfg),
            "hf-neox": GPTNeoXForCausalLM(hf_config)}


def make_step(name, model, batches, clock):
    # the trainer's optimizer (fused AdamW: meshlm.train.optim), for all three
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                  fused=True)

    def step() -> float:
        start = clock()
        for x, y in batches:  # x, y: (micro_batch, seq_len)
            loss = model(input_ids=x, labels=x).loss if name == "hf-neox" else model(x, y).loss
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock() - start

    return step


def main() -> None:
    from meshlm.data.prepare import PreparedData, prepare_default
    from meshlm.model.accounting import describe
    from meshlm.runtime.peaks import device_peak, measure_matmul_peak
    from meshlm.train.batches import get_batch
    from meshlm.train.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="train config overrides, as for `meshlm train`")
    p.add_argument("--config", help="a train config YAML (default: the default job)")
    add_timing_arguments(p, rounds=6, rounds_help="timed steps per model (after one warm-up step)")
    args = p.parse_args()
    clock = timing_setup(args)

    cfg = load_config(args.config, args.overrides)
    model_cfg = cfg.derive_model()
    seq_len = cfg.sequence_length(model_cfg)
    data = PreparedData(prepare_default(tokenizer=cfg.tokenizer), "train")
    batches = get_batch(data, 0, cfg.global_batch, seq_len, cfg.seed,
                        micro_batches=cfg.global_batch // cfg.micro_batch)
    flops = describe(model_cfg, seq_len).train_flops_per_token
    tokens = cfg.global_batch * seq_len
    print(f"config: {model_cfg.spec} {model_cfg.scheme} d={model_cfg.d_model} "
          f"heads={model_cfg.n_heads} vocab={model_cfg.vocab_size}; step = {cfg.global_batch} x "
          f"{seq_len} tokens in micro-batches of {cfg.micro_batch}; {flops / 1e6:.1f} MFLOP/token; "
          f"torch threads {torch.get_num_threads()}")

    peak = measure_matmul_peak(torch.device("cpu"), torch.float32, n=2048, seconds=1.0, clock=clock)
    steps = {name: make_step(name, m, batches, clock)
             for name, m in build_models(model_cfg).items()}
    times = {name: [] for name in steps}
    for round_ in range(args.rounds + 1):
        for name, step in steps.items():
            elapsed = step()
            if round_ > 0:  # round 0 warms up allocators and caches
                times[name].append(elapsed)
    peak = max(peak, measure_matmul_peak(torch.device("cpu"), torch.float32, n=2048, seconds=1.0,
                                         clock=clock))

    cached, source = device_peak(torch.device("cpu"), None)
    print(f"MFU peak: {cached / 1e9:.1f} GFLOP/s ({source}); this run's best 2048^3 GEMM "
          f"({args.clock} clock): {peak / 1e9:.1f} GFLOP/s")
    print(
        f"{'model':<14}{'s/step':>9}{'tokens/s':>11}{'MFU':>8}{'MFU (run)':>11}{'vs hf-neox':>12}")
    hf_rate = tokens / statistics.median(times["hf-neox"])
    for name, ts in times.items():
        rate = tokens / statistics.median(ts)
        print(f"{name:<14}{statistics.median(ts):>9.3f}{rate:>11,.0f}"
              f"{100 * rate * flops / cached:>7.1f}%{100 * rate * flops / peak:>10.1f}"
              f"%{rate / hf_rate:>11.2f}x")


if __name__ == "__main__":
    main()
