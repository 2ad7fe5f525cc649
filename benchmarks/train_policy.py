"""`meshlm train` as it ran before the run policy (glibc malloc defaults, fp32, eager) against the
policy it runs with now (tuned malloc, `dtype=auto`, `compile=auto`), side by side.

    .venv/bin/python benchmarks/train_policy.py
        # the default job, 3 rounds x 40 steps
    .venv/bin/python benchmarks/train_policy.py --rounds 5 --steps 60 model.d_model=256
        # any train overrides

The malloc settings belong to a process, so every measurement is a fresh child process running the
trainer's own step (`Trainer.train_step`) on the default corpus, started the way `meshlm train`
starts (malloc tuned before torch is imported, unless MESHLM_MALLOC=default): "before" and "now"
alternate, round by round, and their order flips every round, so the machine's load hits both alike.
After `--warmup` steps each child measures `--steps` steps with getrusage: wall and CPU time, the
kernel's share of the CPU time (system / (user + system)), minor page faults, and MFU per CPU-second
against the trainer's cached peak. Ratios are medians over rounds (now / before). On a machine other
jobs load, trust tokens per CPU-second over tokens per wall-second.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
VARIANTS = {  # name -> (environment, train overrides)
    "before": ({"MESHLM_MALLOC": "default"}, ["dtype=fp32", "compile=false"]),
    "now": ({}, []),
}


def child(args: argparse.Namespace) -> None:
    """One measurement: start like `meshlm train`, warm up, time `--steps` steps, print one JSON
    line."""
    sys.path.insert(0, str(SRC))
    from meshlm.runtime import allocator

    malloc = allocator.tune()  # before torch is imported, as meshlm.cli does
    import resource
    import time

    import torch

    from meshlm.train import parallel
    from meshlm.train.config import load_config
    from meshlm.train.plan import resolve
    from meshlm.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        extra = [f"steps={args.warmup + args.steps}", "save_every=0", "eval_every=0",
                 "progress=false",
                 "tensorboard=false", f"out_dir={out}", f"name={args.child}"]
        plan = resolve(load_config(args.config, args.overrides + VARIANTS[args.child][1] + extra))
        env = parallel.setup(plan)
        trainer = Trainer(plan, env, log=lambda message: None)
        for step in range(args.warmup):
            trainer.train_step(step)
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            trainer.train_step(step)
        r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - w0
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    tokens = args.steps * trainer.tokens_per_step
    print(json.dumps({"variant": args.child, "dtype": env.precision.name,
                      "compile": env.compile.enabled,
                      "malloc": malloc, "threads": torch.get_num_threads(),
                      "tokens_per_s": tokens / wall,
                      "tokens_per_cpu_s": tokens / (user + system),
                      "kernel_share": system / (user + system),
                      "minor_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / args.steps,
                      "cpu_s_per_step": (user + system) / args.steps,
                      "mfu_per_cpu_s": tokens / (user + system) * trainer.flops_per_token
                      / trainer.peak,
                      "peak_flops": trainer.peak, "peak_source": trainer.peak_source}))


def measure(args: argparse.Namespace, variant: str) -> dict:
    env = {k: v
           for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "MESHLM_MALLOC"}
    env.update(VARIANTS[variant][0], PYTHONPATH=str(SRC))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps), "--warmup",
           str(args.warmup),
           *(["--config", args.config] if args.config else []), *args.overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{variant} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="train config overrides, as for `meshlm train`")
    p.add_argument("--config", help="a train config YAML (default: the default job)")
    p.add_argument("--rounds", type=int, default=3, help="child processes per variant")
    p.add_argument("--steps", type=int, default=40, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per child first")
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS for the children (0: torch's default)")
    p.add_argument("--child", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            runs[name].append(measure(args, name))
            r = runs[name][-1]
            print(f"round {round_ + 1} {name:<7} {r['tokens_per_s']:>8,.0f} tokens/s "
                  f"{r['tokens_per_cpu_s']:>8,.0f} tokens/CPU-s  kernel "
                  f"{100 * r['kernel_share']:4.1f}%  {r['minor_faults_per_step']:>9,.0f} minor "
                  "faults/step", flush=True)
    first = runs["now"][0]
    print(f"now: {first['dtype']}, compile {'on' if first['compile'] else 'off'}, "
          f"{first['malloc']}, {first['threads']} threads; before: fp32, compile off, glibc malloc "
          "defaults")
    mfu = {name: statistics.median(r["mfu_per_cpu_s"] for r in rs) for name, rs in runs.items()}
    print(f"MFU per CPU-second: before {100 * mfu['before']:.1f}%, now {100 * mfu['now']:.1f}% of "
          f"{first['peak_flops'] / 1e9:.1f} GFLOP/s ({first['peak_source']})")
    print(f"{'median':<10}{'tokens/s':>10}{'tokens/CPU-s':>14}{'kernel share':>14}"
          f"{'minor faults/step':>19}")
    med = {name: {key: statistics.median(r[key] for r in rs) for key in
                  ("tokens_per_s", "tokens_per_cpu_s", "kernel_share", "minor_faults_per_step")}
           for name, rs in runs.items()}
    for name, m in med.items():
        print(f"{name:<10}{m['tokens_per_s']:>10,.0f}{m['tokens_per_cpu_s']:>14,.0f}"
              f"{100 * m['kernel_share']:>13.1f}%{m['minor_faults_per_step']:>19,.0f}")
    ratios = {key: statistics.median(n[key] / b[key] for n, b in zip(runs["now"], runs["before"]))
              for key in ("tokens_per_s", "tokens_per_cpu_s")}
    print(f"now / before, median of per-round ratios: tokens/s {ratios['tokens_per_s']:.3f}x, "
          f"tokens per CPU-second {ratios['tokens_per_cpu_s']:.3f}x")


if __name__ == "__main__":
    main()
