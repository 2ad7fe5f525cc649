"""MoE training-step time, side by side in one run; prints ratios.

    .venv/bin/python benchmarks/moe_speed.py                       # d 256, 2+4R2+2, 8 experts
                                                                     top-2, 4×256 tokens
    .venv/bin/python benchmarks/moe_speed.py --threads 1 --clock cpu --rounds 15

Models (same spec, d, heads and attention — OLMoE's, with QK-norm — so only the feed-forward
differs):
  moe-base    olmoe backbone, scheme base: E experts of width I, top-k routed
  moe-mesh    the same with MeSH
  dense-base  llama backbone with QK-norm, one SwiGLU of width k·I: the same *active* parameters as
              moe-base (less the d·E router), i.e. the dense model a token's compute matches

Comparisons (targets from the backbones issue):
  1. moe-base / dense-base training step ≤ 1.5× on CPU (the price of routing, dispatch and E/k× the
     optimizer state);
  2. moe-mesh / moe-base ≤ 1.03×.

A training step is forward + backward + a fused AdamW step (the optimizer is where MoE's E/k× larger
parameter count shows); forward + backward alone is reported too. Timing interleaves the models
round by round (machine noise hits all alike) and reports medians. `--clock cpu --threads 1`
measures this process's CPU time, ignoring the time other jobs hold the cores.
"""
from __future__ import annotations

import argparse
import json

import torch
from benchkit import add_shape_arguments, add_timing_arguments, interleaved_medians, timing_setup


def build(kind: str, args) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    common = dict(spec=args.spec, d_model=args.d_model, n_heads=args.heads, vocab_size=args.vocab,
                  context_length=args.seq, qk_norm=True)
    if kind.startswith("moe"):
        cfg = ModelConfig(**common, backbone="olmoe", n_experts=args.experts, top_k=args.top_k,
                          mlp_hidden=args.expert_width, scheme=kind.split("-")[1])
    else:
        cfg = ModelConfig(**common, backbone="llama", mlp_hidden=args.top_k * args.expert_width,
                          scheme="base")
    torch.manual_seed(0)
    model = MeshLM(cfg).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def step(model, optimizer, x, with_optimizer: bool) -> None:
    model(x, targets=x).loss.backward()
    if with_optimizer:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=256,
                   help="I; the dense model's MLP width is k·I")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    add_timing_arguments(p, rounds=10)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def main() -> None:
    from meshlm.model.accounting import account

    args = parse_args()
    clock = timing_setup(args)
    models = {k: build(k, args) for k in ("moe-mesh", "moe-base", "dense-base")}
    x = torch.randint(0, args.vocab, (args.batch, args.seq),
                      generator=torch.Generator().manual_seed(0))
    full = interleaved_medians({k: (lambda m=m, o=o: step(m, o, x, True))
                                for k, (m, o) in models.items()},
                               args.rounds, clock)
    fwd_bwd = interleaved_medians({k: (lambda m=m, o=o: step(m, o, x, False))
                                   for k, (m, o) in models.items()},
                                  args.rounds, clock)
    acc = {k: account(m) for k, (m, _) in models.items()}
    result = {
        "setup": vars(args) | {"threads": torch.get_num_threads()},
        "params": {k: {"total": a.total_params, "active": a.active_params,
                       "forward_flops_per_token": a.forward_flops_per_token}
                   for k, a in acc.items()},
        "seconds_per_step": full, "seconds_forward_backward": fwd_bwd,
        "ratios": {
            "moe-base/dense-base training step": full["moe-base"] / full["dense-base"],
            "moe-base/dense-base forward+backward": fwd_bwd["moe-base"] / fwd_bwd["dense-base"],
            "moe-mesh/moe-base training step": full["moe-mesh"] / full["moe-base"],
            "moe-mesh/moe-base forward+backward": fwd_bwd["moe-mesh"] / fwd_bwd["moe-base"],
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"setup: {result['setup']}")
    for k, a in acc.items():
        print(f"{k:>10}: {full[k] * 1000:8.1f} ms/step ({fwd_bwd[k] * 1000:8.1f} fwd+bwd)  params "
              f"{a.total_params:,} total / {a.active_params:,} active  "
              f"{a.forward_flops_per_token:,} FLOPs/token")
    for name, ratio in result["ratios"].items():
        print(f"{name:<40} {ratio:.3f}×")


if __name__ == "__main__":
    main()
