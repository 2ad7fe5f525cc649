"""The linear layers of a decode step in every decoding format, at each row count a decode call can
have: fp32 in its decoding layout (SplitLinear, what `--dtype auto` decodes with on CPU: in
128-column blocks multiplied by meshlm.kernels.fp32_rows' compiled kernel where it pays here, else
a block per thread), int8
weight-only, int8 weights with int8 activations (w8a8: as decoding runs them, one row through the
kernel meshlm.quant.row_kernel compiles for this CPU; "w8a8 _int_mm": every row through
torch._int_mm), int4 weight-only and int4 weights with int8 activations (w4a8: through the kernel
meshlm.quant.int4_kernel compiles, at every row count) (meshlm.quant), on the weights of a
decoder stack too large for the caches (default: 12 layers of d = 768 and a 50,304-word head).
Prints each format's time per call and its speed against fp32's.

    .venv/bin/python benchmarks/quant_rows.py                        # torch's threads
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_rows.py --threads 1

Each round runs every format once (interleaved); medians of --rounds. Rows: 1 is a decode step, a
handful is speculation's verify or a served batch, hundreds is a prefill.
"""
from __future__ import annotations

import argparse
import copy

import torch
from benchkit import (
    add_stack_arguments,
    add_timing_arguments,
    interleaved_medians,
    stack_shapes,
    timing_setup,
)

from meshlm.quant import QuantizedLinear
from meshlm.quant.int4_kernel import give as give_int4_kernel
from meshlm.quant.row_kernel import give_row_kernel
from meshlm.runtime.split_linear import SplitLinear, parts_for, paying_kernel


def formats(linears: list[torch.nn.Linear], threads: int) -> dict[str, list[torch.nn.Module]]:
    """{format: the stack's layers in it}."""
    w8a8 = torch.nn.ModuleList(QuantizedLinear.from_linear(m, 8, activations="int8")
                               for m in linears)
    plain_w8a8 = copy.deepcopy(w8a8)
    give_row_kernel(w8a8)
    w4a8 = torch.nn.ModuleList(QuantizedLinear.from_linear(m, 4, group_size=64, activations="int8")
                               for m in linears)
    if not give_int4_kernel(w4a8):
        raise SystemExit("w4a8: no compiled kernel here (meshlm.quant.int4_kernel.unavailable)")
    kernel = paying_kernel()
    return {"fp32": [SplitLinear.for_kernel(m, kernel) if kernel else
                     SplitLinear.of(m, parts_for(m.out_features, threads)) for m in linears],
            "int8": [QuantizedLinear.from_linear(m, 8) for m in linears],
            "w8a8": list(w8a8), "w8a8 _int_mm": list(plain_w8a8),
            "int4": [QuantizedLinear.from_linear(m, 4, group_size=64) for m in linears],
            "w4a8": list(w4a8)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stack_arguments(p)
    add_timing_arguments(p, rounds=5)
    args = p.parse_args()
    clock = timing_setup(args)
    torch.manual_seed(0)
    linears = [torch.nn.Linear(i, o) for o, i in stack_shapes(args.d_model, args.layers,
                                                               args.vocab)]
    stacks = formats(linears, torch.get_num_threads())
    print(f"{len(linears)} layers of a {args.layers}-layer d = {args.d_model} stack and its head, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (medians)")
    for rows in map(int, args.rows.split(",")):
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}

        def run(layers, inputs=inputs):
            return lambda: [m(inputs[m.in_features]) for m in layers]

        with torch.no_grad():
            t = interleaved_medians({name: run(layers) for name, layers in stacks.items()},
                                    args.rounds, clock)
        print(f"  {rows:4d} rows: " + ", ".join(
            f"{name} {sec * 1e3:6.1f} ms ({t['fp32'] / sec:.2f}x)" for name, sec in t.items()))


if __name__ == "__main__":
    main()
