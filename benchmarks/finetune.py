"""Fine-tuning cost, LoRA against full fine-tuning, each in fresh processes, interleaved; figures
are ratios.

    .venv/bin/python benchmarks/finetune.py                       # Pythia-160M shape, seq 128,
                                                                    batch 1
    .venv/bin/python benchmarks/finetune.py --preset tiny --seq 64 --rounds 1    # a smoke run

Each child builds the model (random weights: cost does not depend on them), applies what `meshlm
finetune` applies (meshlm.adapters: PEFT LoRA on attention + MLP, base frozen; or everything
trainable), builds AdamW over the trainable parameters, then runs `--steps` training steps (forward
+ backward + optimizer step) after one warm-up. It reports the trainable share, the median step time
(CPU time: other jobs' use of the cores is not counted), the peak RSS growth over the process before
the model was built (weights + gradients + optimizer state + activations + allocator slack) and the
live-heap peak of one step (glibc in-use bytes sampled after every aten op, benchmarks/elastic.py's
LiveHeap). Target: trainable parameters ≤ 2% of the model.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch


def child(spec: dict) -> None:
    from elastic import LiveHeap

    from meshlm.adapters import adapt
    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    model = MeshLM(ModelConfig.from_preset(spec["preset"], context_length=spec["seq"])).train()
    trainable = adapt(model, {"lora_rank": spec["rank"], "lora_targets": "attention,mlp"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                  fused=True)
    x = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]))

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=spec["bf16"]):
            loss = model(x, targets=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state exists from here on
    times = []
    for _ in range(spec["steps"]):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    with LiveHeap() as heap:
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    total = sum(p.numel() for p in model.parameters())
    print(json.dumps({"trainable": trainable, "total": total, "step_s": statistics.median(times),
                      "rss_growth_mib": (peak - before) / 1024,
                      "live_step_mib": heap.peak_growth / 2**20}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pythia-160m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast (the run policy's choice on native-bf16 CPUs)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(json.loads(args.child))
    base = dict(preset=args.preset, seq=args.seq, batch=args.batch, steps=args.steps,
                bf16=args.bf16)
    variants = {"full": dict(base, rank=0), f"lora r={args.rank}": dict(base, rank=args.rank)}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved fresh processes: drift hits both alike
        for name, spec in variants.items():
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                 capture_output=True,
                                 text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for name, runs in results.items()}
    full = median["full"]
    print(f"{args.preset}, seq {args.seq}, batch {args.batch}, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, 1 thread, median of {args.rounds} "
          f"processes x {args.steps} steps")
    for name, m in median.items():
        share = 100 * m["trainable"] / m["total"]
        print(f"{name:>10}: trainable {m['trainable']:>12,.0f} of {m['total']:,.0f} "
              f"({share:.2f}%), step {m['step_s']:.2f} s CPU ({m['step_s'] / full['step_s']:.2f}x "
              f"full), peak RSS growth {m['rss_growth_mib']:,.0f} MiB "
              f"({m['rss_growth_mib'] / full['rss_growth_mib']:.2f}x), live heap of a step "
              f"{m['live_step_mib']:,.0f} MiB ({m['live_step_mib'] / full['live_step_mib']:.2f}x)")


if __name__ == "__main__":
    main()
