"""Forward+backward time and memory, side by side in one run; prints ratios.

    .venv/bin/python benchmarks/model_speed.py                 # defaults: d=256, spec 2+4R2+2,
                                                                 4×256 tokens
    .venv/bin/python benchmarks/model_speed.py --d-model 512 --spec 4+8R2+4 --batch 2 --seq 512

Comparisons (targets from the model-core issue, and issue 12's in brackets):
  1. MeSH vs. base at the same spec: time ≤ 1.03× [≤ 1.02×], peak memory ≤ 1.05×.
  2. meshlm vanilla vs. transformers' GPTNeoXForCausalLM at the same config and precision (fp32
     eager, one process): time ≤ 1.0× [speed ≥ 1.05×].
  3. `--policy`: meshlm vanilla as meshlm runs it (malloc tuned, `dtype=auto`: bf16 autocast on CPUs
     with native bf16, else fp32) vs. GPTNeoXForCausalLM as a user runs it (fp32, eager, malloc
     defaults) [speed ≥ 1.5×]. Malloc settings belong to a process, so each side runs in its own
     child processes, alternating (`--policy-rounds` children each, `--rounds` timed steps per
     child); the ratio is the median over rounds.

Comparisons 1 and 2 run in this process with malloc tuned as `meshlm train` tunes it at start-up
(meshlm.runtime.allocator; `--malloc default` for glibc's defaults): both models of each pair share
it. Under glibc's defaults MeSH's few extra live tensors cost page faults that show as step time
(MeSH / base 1.036× with default malloc, 1.005× tuned, 2026-12-01, quiet machine, one thread, CPU
clock).

Timing interleaves the models round by round (so machine noise hits all alike) and reports medians.
`--clock cpu --threads 1` measures this process's CPU time: on a shared machine it ignores the time
other jobs hold the cores. Memory is measured two ways:
  - saved: bytes of tensors autograd keeps for backward (deduplicated by storage) + parameters +
    gradients, measured in this process with saved-tensor hooks; deterministic.
  - rss: peak resident memory growth during one training step, each model in a fresh subprocess.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

import torch
from benchkit import add_shape_arguments, add_timing_arguments, interleaved_medians, timing_setup


def build(kind: str, args) -> torch.nn.Module:
    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    torch.manual_seed(0)
    if kind == "hf-neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        from meshlm.backbones import BACKBONES
        from meshlm.interop.families import hf_config_kwargs

        return GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_kwargs(_vanilla_cfg(args),
                                                                   BACKBONES["neox"])))
    if kind == "vanilla":
        return MeshLM(_vanilla_cfg(args))
    return MeshLM(ModelConfig(spec=args.spec, d_model=args.d_model, n_heads=args.heads,
                              vocab_size=args.vocab,
                              context_length=args.seq, scheme=kind))


def _vanilla_cfg(args):
    from meshlm.config import ModelConfig, parse_spec

    depth = parse_spec(args.spec).unrolled_depth  # compute-matched plain stack
    return ModelConfig(spec=str(depth), d_model=args.d_model, n_heads=args.heads,
                       vocab_size=args.vocab,
                       context_length=args.seq, scheme="vanilla", scale_embeddings=False)


def train_step(model, x) -> None:
    out = model(x, labels=x) if not hasattr(model, "scheme") else model(x, targets=x)
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def saved_bytes(model, x) -> int:
    """Tensors saved for backward (unique storages) + parameters + gradients, in bytes."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, labels=x) if not hasattr(model, "scheme") else model(x, targets=x)
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    act = sum(v for k, v in seen.items() if k not in params)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return act + 2 * sum(params.values())


def rss_growth(kind: str, args) -> int:
    """Peak RSS growth (bytes) of one training step, measured in a fresh process."""
    code = (f"import sys; sys.argv=['x']+{sys.argv[1:]!r}; sys.path.insert(0, {sys.path[0]!r});"
            f"import model_speed as m; m._rss_child({kind!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _rss_child(kind: str) -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(kind, args)
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    train_step(model, x[:, :8])  # warm up allocator and kernels on a tiny input
    before = _peak_rss()
    train_step(model, x)
    print(_peak_rss() - before)


def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM), bytes. Unlike ru_maxrss it does not inherit the
    parent's peak across fork+exec."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    add_timing_arguments(p, rounds=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                   help="comparisons 1-2: glibc malloc tuned as meshlm train tunes it (default), "
                        "or its defaults")
    p.add_argument("--policy", action="store_true",
                   help="also compare under each side's own run policy (3.)")
    p.add_argument("--policy-rounds", type=int, default=3,
                   help="child processes per side for --policy")
    p.add_argument("--policy-child", choices=("meshlm", "hf-neox"), help=argparse.SUPPRESS)
    return p.parse_args()


def _policy_child(kind: str) -> None:
    """Time `--rounds` steps of meshlm vanilla under meshlm's run policy, or of transformers as
    is."""
    args = parse_args()
    clock = timing_setup(args)
    x = torch.randint(0, args.vocab, (args.batch, args.seq),
                      generator=torch.Generator().manual_seed(0))
    if kind == "meshlm":
        from meshlm.runtime import precision

        model, chosen = build("vanilla", args), precision.choose("auto", torch.device("cpu"))
        context = lambda: precision.autocast(torch.device("cpu"), chosen)  # noqa: E731
    else:
        model, chosen, context = build("hf-neox", args), None, contextlib.nullcontext

    def step():
        with context():
            out = model(x, targets=x) if kind == "meshlm" else model(x, labels=x)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    secs = interleaved_medians({kind: step}, args.rounds, clock)[kind]
    print(json.dumps({"seconds": secs, "dtype": chosen.describe() if chosen else "fp32 eager"}))


def policy_comparison(args) -> dict:
    """Median over alternating child processes of (transformers step time / meshlm step time)."""
    argv = [a for a in sys.argv[1:] if a not in ("--policy", "--json")]
    env = {k: v
           for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "MESHLM_MALLOC"}
    runs = {"meshlm": [], "hf-neox": []}
    for round_ in range(args.policy_rounds):
        for kind in (("meshlm", "hf-neox") if round_ % 2 == 0 else ("hf-neox", "meshlm")):
            code = (f"import sys; sys.argv=['x']+{argv + ['--policy-child', kind]!r}; "
                    f"sys.path.insert(0, {sys.path[0]!r}); import model_speed as m; "
                    f"m._policy_start({kind!r})")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True, env=env)
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    speedups = [h["seconds"] / m["seconds"] for m, h in zip(runs["meshlm"], runs["hf-neox"])]
    return {"meshlm": runs["meshlm"], "hf-neox": runs["hf-neox"],
            "speedup": statistics.median(speedups)}


def _policy_start(kind: str) -> None:
    if kind == "meshlm":  # as `meshlm train` starts: malloc tuned before anything allocates much
        from meshlm.runtime import allocator

        allocator.tune()
    _policy_child(kind)


def main() -> None:
    args = parse_args()
    if args.malloc == "tuned" and not args.policy_child:
        from meshlm.runtime import allocator

        # before the models allocate; children (RSS, --policy's meshlm side) inherit MALLOC_*
        allocator.tune()
    clock = timing_setup(args)
    kinds = ["mesh", "base", "vanilla", "hf-neox"]
    models = {k: build(k, args) for k in kinds}
    x = torch.randint(0, args.vocab, (args.batch, args.seq),
                      generator=torch.Generator().manual_seed(0))
    secs = interleaved_medians({k: (lambda m=m: train_step(m, x)) for k, m in models.items()},
                               args.rounds, clock)
    saved = {k: saved_bytes(m, x) for k, m in models.items()}
    rss = {k: rss_growth(k, args) for k in kinds}
    result = {
        "setup": vars(args) | {"threads": torch.get_num_threads()},
        "seconds_per_step": secs, "saved_bytes": saved, "rss_growth_bytes": rss,
        "ratios": {
            "mesh/base time": secs["mesh"] / secs["base"],
            "mesh/base saved memory": saved["mesh"] / saved["base"],
            "mesh/base rss growth": rss["mesh"] / rss["base"],
            "meshlm vanilla/transformers GPT-NeoX time": secs["vanilla"] / secs["hf-neox"],
            "meshlm vanilla/transformers GPT-NeoX saved memory": saved["vanilla"]
            / saved["hf-neox"],
            "meshlm vanilla speed / transformers GPT-NeoX speed, same precision": secs["hf-neox"]
            / secs["vanilla"],
        },
    }
    if args.policy:
        policy = policy_comparison(args)
        result["policy"] = policy
        result["ratios"]["meshlm vanilla (its "
                         "policy) speed / transformers (fp32 eager) speed"] = policy["speedup"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"setup: {result['setup']}")
    for k in kinds:
        print(f"{k:>8}: {secs[k] * 1000:8.1f} ms/step  saved {saved[k] / 2**20:8.1f} MiB  "
              f"rss +{rss[k] / 2**20:8.1f} MiB")
    if args.policy:
        m, h = result["policy"]["meshlm"], result["policy"]["hf-neox"]
        ms = {kind: ", ".join(f"{1000 * r['seconds']:.1f}" for r in rs)
              for kind, rs in (("m", m), ("h", h))}
        print(f"policy: meshlm vanilla in {m[0]['dtype']}, malloc tuned: {ms['m']} ms/step; "
              f"transformers {h[0]['dtype']}: {ms['h']} ms/step")
    for name, ratio in result["ratios"].items():
        print(f"{name:<70} {ratio:.3f}×")


if __name__ == "__main__":
    main()
