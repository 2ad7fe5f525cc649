"""The reasoning study's tiny training step (docs/reasoning.md: `1+1R4+1`, 4 heads, full rotary, a
48-word vocabulary, 64 sequences of 32 tokens, fp32, AdamW): where its time goes, op by op, and what
torch.compile of the whole forward (Inductor fusing every elementwise op between the products, and
AOTAutograd the backward) buys over eager, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tiny_train.py --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tiny_train.py --threads 1 --d-model 128

One step: forward at --loops loops, cross-entropy over every position, backward, AdamW. The op table
is torch.profiler's self CPU time over 20 eager steps; the ratio is the median of --rounds
interleaved steps each (after a warm-up step each; the first compiled step's seconds are the
compile). A whole `meshlm train` run adds the data, the sampled loop counts and logging around the
step (about 1% of it at this size).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from benchkit import add_timing_arguments, interleaved_medians, timing_setup

PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def stepper(cfg, x, y, compiled: bool):
    """A training step of a fresh model (seed 0) on (x, y), its forward compiled or eager."""
    from meshlm.model import MeshLM

    torch.manual_seed(0)
    model = MeshLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(x, y, loops):
        logits = model(x, loops=loops).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss_fn = torch.compile(loss_of) if compiled else loss_of

    def step(loops: int) -> None:
        loss_fn(x, y, loops).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def op_split(step, loops: int, top: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step(loops)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    products = sum(e.self_cpu_time_total for e in events if e.key in PRODUCTS)
    print(f"eager step, self CPU time by op (20 steps): {total / 20e3:.1f} ms a step, "
          f"matrix products {products / total:.0%}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.key:58s} {e.self_cpu_time_total / total:6.1%}")


def main() -> None:
    from meshlm.config import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--scheme", default="base")
    p.add_argument("--loops", type=int, default=6, help="K of the step (the study samples 4-8)")
    p.add_argument("--seq-len", type=int, default=32, help="32: chain; 24: parity and compose")
    p.add_argument("--eager-steps", type=int, default=0,
                   help="only run this many eager steps and print their time: one side of a "
                        "whole-command comparison of two checkouts (../shared/tools/pinned-pair)")
    add_timing_arguments(p, rounds=15)
    args = p.parse_args()
    clock = timing_setup(args)
    cfg = ModelConfig.from_preset("tiny", spec="1+1R4+1", d_model=args.d_model, n_heads=4,
                                  vocab_size=48, context_length=32, rotary_pct=1.0,
                                  scheme=args.scheme)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 48, (64, args.seq_len), generator=g) for _ in range(2))
    if args.eager_steps:
        step, start = stepper(cfg, x, y, False), time.perf_counter()
        for _ in range(args.eager_steps):
            step(args.loops)
        print(f"{args.eager_steps} eager steps: {time.perf_counter() - start:.2f} s")
        return
    print(f"1+1R4+1 {args.scheme}, d_model {args.d_model}, K = {args.loops}, 64 x 32 tokens, "
          f"{torch.get_num_threads()} threads")
    eager, compiled = stepper(cfg, x, y, False), stepper(cfg, x, y, True)
    start = time.perf_counter()
    compiled(args.loops)
    print(f"first compiled step: {time.perf_counter() - start:.1f} s")
    op_split(eager, args.loops)
    t = interleaved_medians({"eager": lambda: eager(args.loops),
                             "compiled": lambda: compiled(args.loops)}, args.rounds, clock)
    e, c = t["eager"], t["compiled"]
    tokens = 64 * 32
    print(f"eager {e * 1e3:.1f} ms ({tokens / e:,.0f} tokens/s), whole forward compiled "
          f"{c * 1e3:.1f} ms ({tokens / c:,.0f} tokens/s): {e / c:.2f}x")


if __name__ == "__main__":
    main()
