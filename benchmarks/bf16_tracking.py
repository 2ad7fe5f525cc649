"""How closely a bf16-autocast training run's loss curve tracks the same run in fp32.

    .venv/bin/python benchmarks/bf16_tracking.py
        # tiny model, 40 steps
    .venv/bin/python benchmarks/bf16_tracking.py model.preset=mesh-small steps=300
        # the default job (needs bf16 units)

Both runs use the same seed, data order and schedule (the trainer's own loop); only train.dtype
differs. Prints the per-step train-loss differences (bf16 − fp32) and both final validation losses.
On a CPU without native bf16 the bf16 run is emulated and very slow, hence the tiny default.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

TINY = ["model.preset=tiny", "model.vocab_size=8192", "seq_len=128", "global_batch=8",
        "micro_batch=8", "steps=40",
        "lr=3e-3", "warmup=0.05", "eval_every=0", "save_every=0", "eval_windows=64",
        "progress=false",
        "tensorboard=false", "peak_flops=1e11"]


def main() -> None:
    from meshlm.train.config import load_config
    from meshlm.train.trainer import train

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="train overrides on top of the tiny default")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for dtype in ("fp32", "bf16"):
            cfg = load_config(None, [*TINY, *args.overrides, f"dtype={dtype}", f"out_dir={out}",
                                     f"name={dtype}"])
            start = time.perf_counter()
            results[dtype] = train(cfg, log=lambda message: None)
            print(f"{dtype}: {time.perf_counter() - start:.0f} s, final val loss "
                  f"{results[dtype].val_loss:.4f}",
                  flush=True)
    fp32, bf16 = results["fp32"].losses, results["bf16"].losses
    diffs = [bf16[s] - fp32[s] for s in sorted(fp32)]
    rel = [abs(d) / fp32[s] for d, s in zip(diffs, sorted(fp32))]
    print(f"steps {len(diffs)}: train loss bf16 - fp32: mean {statistics.mean(diffs):+.4f}, "
          f"max |diff| {max(map(abs, diffs)):.4f} ({100 * max(rel):.2f}% of the fp32 loss), "
          f"last 10 steps mean {statistics.mean(diffs[-10:]):+.4f}")
    print(f"final loss fp32 {fp32[max(fp32)]:.4f}, bf16 {bf16[max(bf16)]:.4f}; val loss fp32 "
          f"{results['fp32'].val_loss:.4f}, bf16 {results['bf16'].val_loss:.4f} "
          f"(diff {results['bf16'].val_loss - results['fp32'].val_loss:+.4f})")


if __name__ == "__main__":
    main()
