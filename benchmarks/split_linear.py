"""fp32 linear layers for decoding: F.linear over the (out, in) weight against SplitLinear
(meshlm.runtime.split_linear: transposed, one block of output columns per thread, one bmm), on the
weights of a decoder stack too large for the caches (default: 12 layers of d = 768 and a 50,304-word
head, 0.5 GB), at each row count a decode call can have. Prints the speed ratio per row count.

    .venv/bin/python benchmarks/split_linear.py                      # torch's threads
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/split_linear.py --threads 1

Each round runs both variants once (interleaved); medians of --rounds. Rows: 1 is a decode step, a
handful is speculation's verify or a served batch, hundreds is a prefill.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from benchkit import add_timing_arguments, interleaved_medians, timing_setup

from meshlm.runtime.split_linear import SplitLinear, parts_for


def stack_shapes(d: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    """(out, in) of every matmul a GPT-NeoX layer stack and its head run per token."""
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers + [(vocab, d)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rows", default="1,2,4,8,16,64,256")
    add_timing_arguments(p, rounds=5)
    args = p.parse_args()
    clock = timing_setup(args)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    linears = [torch.nn.Linear(i, o, bias=False) for o, i in stack_shapes(args.d_model, args.layers,
                                                                           args.vocab)]
    split = [SplitLinear.of(m, parts_for(m.out_features, threads)) for m in linears]
    megabytes = sum(m.weight.numel() for m in linears) * 4 / 1e6
    print(f"{len(linears)} fp32 weights, {megabytes:.0f} MB, {threads} threads, {args.rounds} "
          "rounds (medians)")
    for rows in map(int, args.rows.split(",")):
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}

        def plain(inputs=inputs):
            for m in linears:
                F.linear(inputs[m.in_features], m.weight)

        def blocks(inputs=inputs):
            for m in split:
                m(inputs[m.in_features])

        with torch.no_grad():
            t = interleaved_medians({"F.linear": plain, "split": blocks}, args.rounds, clock)
        print(f"  {rows:4d} rows: F.linear {t['F.linear'] * 1e3:7.1f} ms, split "
              f"{t['split'] * 1e3:7.1f} ms ({megabytes / 1e3 / t['split']:5.1f} GB/s): "
              f"split / F.linear speed {t['F.linear'] / t['split']:.2f}x")


if __name__ == "__main__":
    main()
