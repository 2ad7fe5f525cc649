"""A small op right after the weights stream past, against the same op again: what eager decoding's
ops between the weight products cost cold.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/cold_ops.py --threads 1

A decoded token streams its weights (hundreds of MB) through the caches between its small ops
(norms, GELU, rotary, attention over the cache), so each op after a product finds its code and its
data evicted. This times a few such ops at decode shapes (d = 768, one token) the first time after
reading --megabytes of memory (torch's sum, as a product streams its weights) and right after that
first call (warm), in interleaved rounds; medians in µs, and their ratio. `compile_decode.py
--no-matmul` replaces the products by slices, so its eager split runs these ops warm.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from benchkit import read_sum


def ops(d: int) -> dict:
    """name -> a call at one decoded token's shapes."""
    g = torch.Generator().manual_seed(0)
    x, wide = torch.randn(1, 1, d, generator=g), torch.randn(1, 1, 4 * d, generator=g)
    weight, bias = torch.ones(d), torch.zeros(d)
    q = torch.randn(1, 12, 1, d // 12, generator=g)
    k, v = (torch.randn(1, 12, 96, d // 12, generator=g) for _ in range(2))
    return {"gelu (4d)": lambda: F.gelu(wide),
            "layer_norm (d)": lambda: F.layer_norm(x, (d,), weight, bias),
            "add (d)": lambda: x + x,
            "sdpa (1 query, 96 keys)": lambda: F.scaled_dot_product_attention(q, k, v)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megabytes", type=int, default=256)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--d-model", type=int, default=768)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    stream, _ = read_sum(args.megabytes)  # the weights' stream
    calls = ops(args.d_model)
    times = {(name, when): [] for name in calls for when in ("cold", "warm")}
    for _ in range(args.rounds):
        for name, op in calls.items():
            stream()
            for when in ("cold", "warm"):
                start = time.perf_counter()
                op()
                times[name, when].append(time.perf_counter() - start)
    print(f"{args.threads} thread(s), after reading {args.megabytes} MB; medians of "
          f"{args.rounds} rounds")
    for name in calls:
        cold, warm = (1e6 * statistics.median(times[name, w]) for w in ("cold", "warm"))
        print(f"  {name:24s} cold {cold:7.1f} us, warm {warm:6.1f} us ({cold / warm:.1f}x)")


if __name__ == "__main__":
    main()
