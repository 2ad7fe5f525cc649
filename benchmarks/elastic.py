"""Elastic depth, side by side in one run; every figure is a ratio of interleaved medians.

    .venv/bin/python benchmarks/elastic.py decode CKPT --exit state:0.2 --threads 1 --clock cpu
    .venv/bin/python benchmarks/elastic.py gather CKPT --exit state:0.1,state:0.2,state:0.3 \
        --threads 1 --clock cpu
    .venv/bin/python benchmarks/elastic.py memory                  # truncated backprop: peak memory
                                                                     vs. fixed K = k
    .venv/bin/python benchmarks/elastic.py throughput --baseline-src /path/to/older/src
        # fixed-K training speed
    .venv/bin/python benchmarks/elastic.py horizon CKPT --horizons 16,8,6,4
        # MeSH router pairs beyond a horizon

decode      cached greedy decoding at batch 1: fixed depth vs. per-token adaptive exit (target:
            tokens/s ≥ 1.3×); also the average loop steps per generated token.
gather      full-sequence forward under exit: gathering the active tokens vs. masking (computing
            every token), at the active fractions the given rules produce (how
            meshlm.model.exit.GATHER_BELOW was chosen).
memory      one training step (forward + backward) per fresh process: the peak of live heap memory
            (glibc's in-use bytes, sampled after every aten op: what a GPU allocator's
            max_memory_allocated measures) and the peak RSS growth (which also counts allocator
            fragmentation), for a fixed K = k run, for sampled counts n > k with backprop_loops = k,
            and for n with full backprop (target: truncated within 10% of fixed K = k).
throughput  training steps (forward + backward + AdamW) of a fixed-K model in two source trees,
            alternating processes (target: this tree ≤ 2% slower than the baseline tree).
horizon     validation loss at 4 … 16 loops of one MeSH checkpoint with the router pairs beyond each
            horizon H replaced by pair H (what `max_loops` = H does): how much the rarely trained
            deep pairs of a sampled-depth model cost at depth (how train/depth.py's 95th-percentile
            horizon was chosen).

On a shared machine use --threads 1 --clock cpu (CPU time ignores the time other jobs hold the
cores).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from benchkit import add_timing_arguments, interleaved_medians, timing_setup
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent


def exit_rule(text: str):
    """An exit rule as the model takes it: parsed from the command line's text."""
    from meshlm.model.exit import ExitRule

    return ExitRule.parse(text)


def load(path: str):
    from meshlm.loading import open_model

    return open_model(path, "cpu").model


# -- decode ----------------------------------------------------------------------------------------
@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int, loops: int | None,
           exit) -> list[int]:
    """Batch-1 cached greedy decoding; returns the loop steps each generated token ran."""
    from meshlm.model.kv_cache import KVCache

    kv, step_input, steps = KVCache(), prompt, []
    for _ in range(new_tokens):
        out = model(step_input, cache=kv, loops=loops, exit=exit)
        step_input = out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(loops
                     or model.config.layout.n_steps if exit is None else int(out.exit_loops[0, -1]))
    return steps


def decode(args) -> None:
    clock = timing_setup(args)
    model = load(args.checkpoint)
    k = args.loops or model.config.layout.n_steps
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt),
                           generator=torch.Generator().manual_seed(0))
    runs = {"fixed": None, **{text: exit_rule(text) for text in args.exit.split(",")}}
    steps = {name: greedy(model, prompt, args.new_tokens, k, rule) for name, rule in runs.items()}
    medians = interleaved_medians({name: (lambda r=rule: greedy(model, prompt, args.new_tokens, k,
                                                                r))
                                   for name, rule in runs.items()}, args.rounds, clock)
    print(f"cached greedy decoding, batch 1, {args.prompt}-token prompt + {args.new_tokens} "
          f"tokens, at most {k} loops ({args.clock} clock, medians of {args.rounds} interleaved "
          "rounds)")
    print(f"{'run':<16} {'tokens/s':>9} {'vs fixed':>9} {'avg loops/token':>16}")
    for name, seconds in medians.items():
        print(f"{name:<16} {args.new_tokens / seconds:>9.1f} {medians['fixed'] / seconds:>8.2f}x "
              f"{statistics.mean(steps[name]):>16.2f}")


# -- gather vs. mask -------------------------------------------------------------------------------
def gather(args) -> None:
    from meshlm.model import exit as exit_module

    clock = timing_setup(args)
    model = load(args.checkpoint)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                      generator=torch.Generator().manual_seed(0))
    print(f"full-sequence forward under exit, batch {args.batch} x {args.seq} tokens ({args.clock} "
          "clock)")
    print(f"{'rule':<14} {'avg loops':>9} {'gather/mask time':>17}")
    for rule in args.exit.split(","):
        parsed = exit_rule(rule)

        def run(below: float, r=parsed):
            exit_module.GATHER_BELOW = below
            with torch.no_grad():
                return model(x, exit=r)
        loops = run(0.0).exit_loops.float().mean().item()
        medians = interleaved_medians({"mask": lambda: run(0.0), "gather": lambda: run(1.01)},
                                      args.rounds, clock)
        print(f"{rule:<14} {loops:>9.2f} {medians['gather'] / medians['mask']:>16.2f}x")


# -- router horizon --------------------------------------------------------------------------------
def horizon(args) -> None:
    from meshlm.evaluation.perplexity import mean_loss
    from meshlm.loading import open_model

    torch.set_num_threads(args.threads)
    opened = open_model(args.checkpoint, "cpu")
    model, data = opened.model, opened.held_out()
    routers = list(model.scheme.routers)
    counts = [int(v) for v in args.loops.split(",")]
    print(f"{args.checkpoint}: validation loss ({args.limit} windows of {opened.seq_len} tokens) "
          f"with the router pairs beyond H replaced by pair H ({len(routers)} pairs in the "
          "checkpoint)")
    print(f"{'H':>4} " + " ".join(f"{f'{k} loops':>9}" for k in counts) + f" {'rise':>8}")
    for h in [int(v) for v in args.horizons.split(",")]:
        model.scheme.routers = torch.nn.ModuleList(routers[:h + 1])
        losses = [mean_loss(model, data, opened.seq_len, max_sequences=args.limit, loops=k)["loss"]
                  for k in counts]
        print(f"{h:>4} " + " ".join(f"{v:>9.4f}" for v in losses)
              + f" {max(losses[1:]) - losses[0]:>+8.4f}")


# -- peak memory -----------------------------------------------------------------------------------
def memory_child(spec: str) -> None:
    """One forward + backward in this fresh process; prints JSON with peak RSS growth and saved
    activations."""
    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    cfg = json.loads(spec)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MeshLM(ModelConfig(spec=cfg["spec"], d_model=cfg["d"], n_heads=cfg["d"] // 64,
                               vocab_size=8192,
                               context_length=cfg["seq"], max_loops=cfg["cap"])).train()
    x = torch.randint(0, 8192, (cfg["batch"], cfg["seq"]))
    tracker = LiveHeap()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with tracker:
        out = model(x, targets=x, loops=cfg["loops"], backprop_loops=cfg["backprop"])
        out.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rss_growth_mib": (peak - before) / 1024,
                      "live_mib": tracker.peak_growth / 2 ** 20}))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                                                     "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks",
                                                     "keepcost")]


class LiveHeap(TorchDispatchMode):
    """Peak growth of glibc's in-use heap bytes (uordblks + mmapped hblkhd), sampled after every
    aten op."""

    def __enter__(self):
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = _MallInfo2
        self.start = self.peak = self.in_use()
        return super().__enter__()

    def in_use(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out

    @property
    def peak_growth(self) -> int:
        return self.peak - self.start


def memory(args) -> None:
    k = args.k
    base = dict(spec=args.spec, d=args.d_model, seq=args.seq, batch=args.batch,
                cap=max(args.counts + [k]))
    configs = {f"fixed K={k}": dict(base, loops=k, backprop=None),
               **{f"n={n}, backprop {k}": dict(base, loops=n, backprop=k) for n in args.counts},
               **{f"n={n}, full backprop": dict(base, loops=n, backprop=None)
                  for n in args.counts[-1:]}}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):  # interleaved: one fresh process per config per round
        for name, cfg in configs.items():
            out = subprocess.run([sys.executable, __file__, "memory-child", json.dumps(cfg)],
                                 capture_output=True,
                                 text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[name].append(json.loads(out.stdout))
    keys = ("live_mib", "rss_growth_mib")
    ref = {key: statistics.median(r[key] for r in results[f"fixed K={k}"]) for key in keys}
    print(f"one training step of {args.spec} d={args.d_model}, batch {args.batch} x {args.seq}, "
          f"medians of {args.rounds} fresh processes per config")
    print(f"{'run':<24} {'peak live MiB':>14} {'vs fixed':>9} {'peak RSS growth MiB':>20} "
          f"{'vs fixed':>9}")
    for name, rows in results.items():
        live, rss = (statistics.median(r[key] for r in rows) for key in keys)
        print(f"{name:<24} {live:>14.1f} {live / ref['live_mib']:>8.3f}x {rss:>20.1f} "
              f"{rss / ref['rss_growth_mib']:>8.3f}x")


# -- training throughput across two source trees ---------------------------------------------------
def throughput_child(spec: str) -> None:
    """Time `steps` training steps of the default fixed-K path; prints tokens per CPU-second."""
    import time

    from meshlm.config import ModelConfig
    from meshlm.model import MeshLM

    cfg = json.loads(spec)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MeshLM(ModelConfig(spec=cfg["spec"], d_model=cfg["d"], n_heads=cfg["d"] // 32,
                               vocab_size=8192,
                               context_length=cfg["seq"])).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 8192, (cfg["batch"], cfg["seq"]))
    times = []
    for i in range(cfg["steps"] + 1):
        start = time.process_time()
        model(x, targets=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up
            times.append(time.process_time() - start)
    print(json.dumps({"tokens_per_s": x.numel() / statistics.median(times)}))


def throughput(args) -> None:
    cfg = dict(spec=args.spec, d=args.d_model, seq=args.seq, batch=args.batch, steps=args.steps)
    trees = {"baseline": args.baseline_src, "this tree": str(HERE.parent / "src")}
    rates: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, src in trees.items():
            env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, __file__, "throughput-child", json.dumps(cfg)],
                                 capture_output=True,
                                 text=True, check=True, env=env)
            rates[name].append(json.loads(out.stdout)["tokens_per_s"])
    base, this = (statistics.median(rates[n]) for n in trees)
    print(f"fixed-K training steps of {args.spec} d={args.d_model}, batch {args.batch} x "
          f"{args.seq}, CPU time, {args.rounds} alternating process pairs x {args.steps} steps")
    print(f"baseline ({args.baseline_src}): {base:,.0f} tokens/s; this tree: {this:,.0f} tokens/s; "
          f"ratio {this / base:.3f} (per-round ratios "
          f"{[round(b / a, 3) for a, b in zip(*rates.values())]})")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("memory-child", "throughput-child"):
        return (memory_child if sys.argv[1] == "memory-child" else throughput_child)(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("decode", "gather"):
        q = sub.add_parser(name)
        q.add_argument("checkpoint", help="a trained checkpoint (run dir or step dir)")
        q.add_argument("--exit", default="state:0.2", help="comma-separated exit rules")
        add_timing_arguments(q, rounds=5)
        if name == "decode":
            q.add_argument("--loops", type=int, default=None,
                           help="most loop steps (default: the trained K)")
            q.add_argument("--prompt", type=int, default=32)
            q.add_argument("--new-tokens", type=int, default=64)
        else:
            q.add_argument("--batch", type=int, default=8)
            q.add_argument("--seq", type=int, default=128)
    q = sub.add_parser("horizon")
    q.add_argument("checkpoint", help="a MeSH checkpoint trained with sampled depth")
    q.add_argument("--horizons", default="16,8,6,4", help="comma-separated H (pairs 0 … H kept)")
    q.add_argument("--loops", default="4,8,12,16",
                   help="loop counts to evaluate; the first is the reference")
    q.add_argument("--limit", type=int, default=64, help="validation windows")
    q.add_argument("--threads", type=int, default=1)
    q = sub.add_parser("memory")
    q.add_argument("--spec", default="2+2R4+2")
    q.add_argument("--d-model", type=int, default=256)
    q.add_argument("--seq", type=int, default=256)
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--k", type=int, default=4, help="backprop_loops, and the fixed run's K")
    q.add_argument("--counts", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16],
                   help="sampled counts n > k to compare")
    q.add_argument("--rounds", type=int, default=3)
    q = sub.add_parser("throughput")
    q.add_argument("--baseline-src", required=True,
                   help="the src/ folder of the tree to compare against")
    q.add_argument("--spec", default="2+2R2+2")
    q.add_argument("--d-model", type=int, default=128)
    q.add_argument("--seq", type=int, default=128)
    q.add_argument("--batch", type=int, default=16)
    q.add_argument("--steps", type=int, default=10)
    q.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    {"decode": decode, "gather": gather, "memory": memory, "throughput": throughput,
     "horizon": horizon}[args.command](args)


if __name__ == "__main__":
    main()
