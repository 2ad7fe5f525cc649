"""Retrofit a trained Llama into a looped MeSH model and measure how close it starts; prints a
table.

    .venv/bin/python benchmarks/retrofit_llama.py --out /tmp/retrofit-llama
        # ~15 min on 2 CPU cores
    .venv/bin/python benchmarks/retrofit_llama.py --out /tmp/r --steps 100 --continue-steps 20 \
        --windows 16

1. Train a vanilla 8-layer Llama-backbone model (`llama-small`) with `meshlm train` on the embedded
   corpus, and export it as a Hugging Face Llama folder (`meshlm convert RUN OUT --to llama`).
2. Perplexity on the corpus's validation split of the original (transformers' LlamaForCausalLM,
   loaded from the folder) and of retrofits `2+2R2+2` (8 unrolled layers, the source's compute)
   before any training: MeSH with routers started as plain recursion (`base`, the default) or
   near-uniform (`fresh`), the core taken from the first block (`block`) or averaged (`average`),
   and the plain looped model (`base` scheme).
3. Continue training the retrofitted MeSH and base models the same few steps (AdamW, the trainer's
   defaults, linear warmup then constant) and report their perplexity again.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

SPEC = "2+2R2+2"
VARIANTS = {  # name: retrofit options
    "mesh, routers base, core block": dict(scheme="mesh", router_start="base", core_init="block"),
    "mesh, routers base, core average": dict(scheme="mesh", router_start="base",
                                             core_init="average"),
    "mesh, routers fresh, core block": dict(scheme="mesh", router_start="fresh", core_init="block"),
    "base (looped, no MeSH), core block": dict(scheme="base", core_init="block"),
}
CONTINUED = ("mesh, routers base, core block", "base (looped, no MeSH), core block")


@torch.no_grad()
def perplexity(logits_of, data, seq_len: int, windows: int) -> float:
    """exp(mean next-token loss) over `windows` evenly spread validation windows."""
    n = data.num_sequences(seq_len)
    total, count = 0.0, 0
    for i in [j * n // windows for j in range(windows)]:
        batch = torch.from_numpy(data.sequence(i, seq_len)[None])  # (1, seq_len + 1)
        logits = logits_of(batch[:, :-1])
        total += torch.nn.functional.cross_entropy(logits[0].float(), batch[0, 1:],
                                                   reduction="sum").item()
        count += seq_len
    return math.exp(total / count)


def train_source(out: Path, steps: int) -> Path:
    from meshlm.train.config import load_config
    from meshlm.train.trainer import train

    cfg = load_config(None, ["model.preset=llama-small", f"steps={steps}", f"out_dir={out}",
                             "name=llama-source",
                             "progress=false", "tensorboard=false", "eval_every=0", "save_every=0"])
    result = train(cfg, log=lambda message: None)
    print(f"trained the source: {steps} steps, val ppl {result.val_ppl:.1f} (trainer's eval), "
          f"{result.wall_s:.0f} s")
    return result.run_dir


def continue_training(model, data, steps: int, seq_len: int, lr: float) -> None:
    from meshlm.train.batches import get_batch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        ((x, y),) = get_batch(data, step, 8, seq_len, seed=1)
        model(x, targets=y).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True,
                   help="work folder (must not hold an earlier run)")
    p.add_argument("--steps", type=int, default=600, help="training steps of the source Llama")
    p.add_argument("--continue-steps", type=int, default=100,
                   help="training steps after the retrofit")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate after the retrofit")
    p.add_argument("--windows", type=int, default=64, help="validation windows of 256 tokens")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    from meshlm.data.prepare import PreparedData, prepare_default
    from meshlm.interop.convert import convert
    from meshlm.interop.retrofit import retrofit
    from meshlm.loading import read_family

    start = time.perf_counter()
    folder = convert(train_source(args.out, args.steps), args.out / "llama-hf", to="llama")
    data_dir = prepare_default()
    val, train_split = PreparedData(data_dir, "val"), PreparedData(data_dir, "train")
    seq = 256
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    rows = [("original Llama (transformers)",
             perplexity(lambda x: hf(x).logits, val, seq, args.windows), None)]
    cfg, state = read_family(folder)
    models = {}
    for name, options in VARIANTS.items():
        models[name], _ = retrofit(cfg, state, SPEC, **options)
        rows.append((f"retrofit {SPEC}: {name}",
                     perplexity(lambda x, m=models[name]: m(x).logits, val, seq,
                                args.windows), None))
    for name in CONTINUED:
        continue_training(models[name], train_split, args.continue_steps, seq, args.lr)
        after = perplexity(lambda x, m=models[name]: m(x).logits, val, seq, args.windows)
        rows = [(r, before, after if r.endswith(name) else a) for r, before, a in rows]
    print(f"\nvalidation perplexity ({args.windows} windows of {seq} tokens; source {args.steps} "
          f"steps; {args.continue_steps} steps after the retrofit at lr {args.lr}):")
    for row, before, after in rows:
        print(f"  {row:<58} {before:8.1f}"
              + (f"   after {args.continue_steps} steps: {after:8.1f}" if after else ""))
    print(f"({time.perf_counter() - start:.0f} s; numpy {np.__version__}, torch "
          f"{torch.__version__})")


if __name__ == "__main__":
    main()
