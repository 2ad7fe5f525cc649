"""What `train.compile` costs and what it saves: the break-even step count of torch.compile for a
train config.

    .venv/bin/python benchmarks/compile_speed.py
        # the default job's model
    .venv/bin/python benchmarks/compile_speed.py model.d_model=512 model.n_heads=8 # a d = 512 model
    .venv/bin/python benchmarks/compile_speed.py --device cuda
        # the same on a GPU

Two copies of the model with the same weights run the trainer's optimizer step (forward + backward
per micro-batch, clip, fused AdamW) on the same real batches: one eager, one with every layer
compiled the way the trainer compiles it (meshlm.train.parallel.compile_layers). The compile
overhead is the compiled copy's first step minus the eager copy's first step (with `--clock cpu`:
CPU time of this process, which compiles in-process, plus the C++ compiler processes it waits for),
measured twice: with an empty Inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR: a user's first run)
and again after `torch._dynamo.reset()` with the cache now warm (every later run on this machine).
Steady-state step times are medians of interleaved rounds. break-even steps = compile overhead /
(eager step − compiled step): a run shorter than that is slower with compile. Everything is timed
with `--clock`; step times are also given in wall time.
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import tempfile
import time

# cold cache
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="meshlm-inductor-"))
# compile in this process: its CPU clock sees it
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
from benchkit import add_timing_arguments, timing_setup  # noqa: E402
from train_throughput import make_step  # noqa: E402


def cpu_with_children() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler Inductor runs)."""
    own, children = (resource.getrusage(resource.RUSAGE_SELF),
                     resource.getrusage(resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def first_step_seconds(step, clock) -> float:
    start = clock()
    step()
    return clock() - start


def main() -> None:
    from meshlm.data.prepare import PreparedData, prepare_default
    from meshlm.model import MeshLM
    from meshlm.train.batches import get_batch
    from meshlm.train.config import load_config
    from meshlm.train.parallel import compile_layers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="train config overrides, as for `meshlm train`")
    p.add_argument("--config", help="a train config YAML (default: the default job)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_timing_arguments(p, rounds=8, rounds_help="timed interleaved steps per copy")
    args = p.parse_args()
    clock = timing_setup(args)
    overhead_clock = cpu_with_children if args.clock == "cpu" else time.perf_counter
    device = torch.device(args.device)

    cfg = load_config(args.config, args.overrides)
    model_cfg = cfg.derive_model()
    seq_len = cfg.sequence_length(model_cfg)
    data = PreparedData(prepare_default(tokenizer=cfg.tokenizer), "train")
    batches = [(x.to(device), y.to(device)) for x, y in get_batch(
        data, 0, cfg.global_batch, seq_len, cfg.seed,
        micro_batches=cfg.global_batch // cfg.micro_batch)]
    print(f"config: {model_cfg.spec} {model_cfg.scheme} d={model_cfg.d_model} "
          f"heads={model_cfg.n_heads} vocab={model_cfg.vocab_size}; step = {cfg.global_batch} x "
          f"{seq_len} tokens in micro-batches of {cfg.micro_batch}; {args.device}, torch "
          f"{torch.__version__}, threads {torch.get_num_threads()}")

    torch.manual_seed(0)
    eager = MeshLM(model_cfg).to(device)
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    eager_step = make_step("meshlm", eager, batches, clock)
    compiled_step = make_step("meshlm", compiled, batches, clock)
    eager_first = first_step_seconds(eager_step, overhead_clock)
    cold = first_step_seconds(compiled_step, overhead_clock) - eager_first

    times = {"eager": [], "compiled": []}
    wall = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, step in (("eager", eager_step), ("compiled", compiled_step)):
            start = time.perf_counter()
            times[name].append(step())
            wall[name].append(time.perf_counter() - start)

    torch._dynamo.reset()  # forget the compiled graphs; Inductor's on-disk cache stays
    again = copy.deepcopy(eager)
    compile_layers(again)
    warm = first_step_seconds(make_step("meshlm", again, batches, clock),
                              overhead_clock) - statistics.median(
        times["eager"])

    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    ew, cw = statistics.median(wall["eager"]), statistics.median(wall["compiled"])
    print(f"step ({args.clock} clock): eager {1e3 * e:.1f} ms, compiled {1e3 * c:.1f} ms -> "
          f"{e / c:.3f}x")
    print(f"step (wall clock): eager {1e3 * ew:.1f} ms, compiled {1e3 * cw:.1f} ms -> "
          f"{ew / cw:.3f}x")
    saved = e - c
    for label, overhead in (("cold Inductor cache", cold), ("warm Inductor cache", warm)):
        even = (f"{overhead / saved:,.0f} steps" if saved > 0
                else "never (compiled steps are not faster)")
        print(f"compile overhead, {label}: {overhead:.1f} s ({args.clock} clock); break-even after "
              f"{even}")


if __name__ == "__main__":
    main()
