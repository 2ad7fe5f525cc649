"""The batcher alone (meshlm.serve.batcher: no HTTP, no load generator on the same cores):
tokens/s of continuous batching with `meshlm serve --compile`'s step against the eager one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batcher_speed.py --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batcher_speed.py --threads 1 \
        --preset pythia-160m --spec 2+4R2+2 --requests 48

A closed loop at --concurrency C: --requests greedy requests (EOS ignored, so each decodes exactly
--tokens tokens) with prompts of 12-24 random ids (seeded), the first C submitted at once and a
new one as one finishes, so C stay in flight and rows join and leave as in a server. Two batchers
over one model (the --preset's shape with random weights: the speed does not depend on them):
eager, and compiled (its warm-up first, as `meshlm serve --compile` does before it listens: the
compile's seconds and the step times its probe compared are printed; a batcher whose probe found
compiling slower decodes eagerly, and the line says so). The two alternate for --rounds rounds,
the order flipped each round; tokens/s of each round in wall-clock and in this process's CPU time,
medians, and compiled over eager. The HTTP figure (serve_load.py --compile) adds the server's and
the client's work on the same cores; this is the part compiling changes.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from meshlm.config import ModelConfig
from meshlm.generate import Sampling
from meshlm.model import MeshLM
from meshlm.serve.batcher import Batcher, Request


def closed_loop(batcher: Batcher, prompts: list[list[int]], tokens: int,
                concurrency: int) -> tuple[int, float, float]:
    """Every prompt through `batcher`, `concurrency` in flight: (tokens decoded, wall s, CPU s)."""
    pending, decoded = list(prompts), 0
    s = Sampling(max_new_tokens=tokens, temperature=0, stop_at_eos=False)

    def submit() -> None:
        if pending:
            batcher.submit(Request(pending.pop(), s, on_done=done))

    def done(r: Request) -> None:
        nonlocal decoded
        decoded += len(r.tokens)
        submit()

    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(concurrency):
        submit()
    while batcher.step():
        pass
    return decoded, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mesh-small")
    p.add_argument("--spec", default=None, help="the preset's layout unless given")
    p.add_argument("--scheme", default="mesh")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {"spec": args.spec} if args.spec else {}
    torch.manual_seed(0)
    model = MeshLM(ModelConfig.from_preset(args.preset, scheme=args.scheme, **extra)).eval()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(12, 24))]
               for _ in range(args.requests)]
    batchers = {name: Batcher(model, eos_id=0, pad_id=1, max_batch=args.concurrency,
                              max_queue=args.requests, compile=name == "compiled")
                for name in ("eager", "compiled")}
    print(f"{args.preset} {model.config.spec} {args.scheme}, d_model {model.config.d_model}, "
          f"{torch.get_num_threads()} threads; {args.requests} requests of {args.tokens} tokens, "
          f"{args.concurrency} in flight, {args.rounds} rounds")
    print(f"compiled batcher's warm-up: {batchers['compiled'].warm()}")
    rates: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in batchers}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):  # the first round warms both, uncounted
            order = list(batchers) if round_ % 2 else list(reversed(batchers))
            for name in order:
                decoded, wall, cpu = closed_loop(batchers[name], prompts, args.tokens,
                                                 args.concurrency)
                assert decoded == args.requests * args.tokens, decoded
                if round_:
                    rates[name]["wall"].append(decoded / wall)
                    rates[name]["cpu"].append(decoded / cpu)
    for clock in ("wall", "cpu"):
        eager, compiled = (statistics.median(rates[n][clock]) for n in ("eager", "compiled"))
        print(f"tokens/s ({clock} clock): eager {eager:8.1f}, compiled {compiled:8.1f}: "
              f"{compiled / eager:.2f}x (rounds: eager "
              f"{', '.join(f'{r:.0f}' for r in rates['eager'][clock])}; compiled "
              f"{', '.join(f'{r:.0f}' for r in rates['compiled'][clock])})")


if __name__ == "__main__":
    main()
