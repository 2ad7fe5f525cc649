"""fp32 linear layers for decoding: F.linear over the (out, in) weight against SplitLinear
(meshlm.runtime.split_linear: transposed, one block of output columns per thread, one bmm) and
against SplitLinear in column blocks (fp32_rows.WIDTH wide) multiplied by the kernel
meshlm.kernels.fp32_rows compiles (where this machine builds it), on the weights of a decoder stack
too large for the caches (default: 12 layers of d = 768 and a 50,304-word head, 0.5 GB), at each row
count a decode call can have. Prints the speed ratios per row count.

    .venv/bin/python benchmarks/split_linear.py                      # torch's threads
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/split_linear.py --threads 1
    .venv/bin/python benchmarks/split_linear.py --tied-decode        # greedy decoding, tied head

--bf16 instead times bf16 decoding's products over the same shapes in bf16: F.linear (oneDNN)
against the kernel meshlm.kernels.bf16_rows compiles, at every row count (Bf16Linear takes it up to
meshlm.runtime.bf16_linear.KERNEL_ROWS rows: where it stops paying here):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/split_linear.py --bf16 --threads 1

--tied-decode instead decodes 32 greedy tokens with a vanilla stack of that shape whose head is its
embedding table, three ways: through F.linear, with the layers split, and with the tied head split
too (SharedSplitLinear, views of the table); it checks the tokens agree and prints speed ratios.

Each round runs every variant once (interleaved); medians of --rounds. Rows: 1 is a decode step, a
handful is speculation's verify or a served batch, hundreds is a prefill.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from benchkit import (
    add_stack_arguments,
    add_timing_arguments,
    interleaved_medians,
    stack_shapes,
    timing_setup,
)

from meshlm.kernels import fp32_rows
from meshlm.runtime.split_linear import (
    KERNEL_ROWS,
    SplitLinear,
    parts_for,
    split_linears,
    split_tied_head,
)


def tied_decode(args, clock) -> None:
    """--tied-decode (module docstring)."""
    import copy

    from meshlm.config import ModelConfig
    from meshlm.generate import Sampling, generate
    from meshlm.model import MeshLM

    cfg = ModelConfig(spec=str(args.layers), d_model=args.d_model, n_heads=args.d_model // 64,
                      vocab_size=args.vocab, context_length=128, scheme="vanilla",
                      scale_embeddings=False, tie_embeddings=True)
    plain = MeshLM(cfg).eval()
    layers = copy.deepcopy(plain)
    split_linears(layers)
    head = copy.deepcopy(layers)
    assert split_tied_head(head)
    models = {"F.linear": plain, "split layers": layers, "split layers and tied head": head}
    s = Sampling(max_new_tokens=32, temperature=0, stop_at_eos=False)
    prompt = torch.randint(2, args.vocab, (1, 32), generator=torch.Generator().manual_seed(0))

    def decode(model):
        return lambda: generate(model, prompt.tolist(), s)
    with torch.no_grad():
        tokens = {name: decode(m)() for name, m in models.items()}
        t = interleaved_medians({name: decode(m) for name, m in models.items()}, args.rounds, clock)
    same = len({str(t) for t in tokens.values()}) == 1
    print(f"tied vanilla {args.layers} x d {args.d_model}, vocab {args.vocab}, 32 tokens, "
          f"{torch.get_num_threads()} threads, same tokens: {same}")
    for name in models:
        print(f"  {name:<27} {t['F.linear'] / t[name]:.2f}x F.linear's speed")


def bf16_products(args, clock) -> None:
    """--bf16 (module docstring)."""
    from meshlm.kernels import bf16_rows

    kernel = bf16_rows.bf16_rows_kernel()
    if kernel is None:
        raise SystemExit(f"no bf16 kernel here: {bf16_rows.unavailable()}")
    torch.manual_seed(0)
    weights = [torch.randn(o, i).bfloat16() for o, i in stack_shapes(args.d_model, args.layers,
                                                                     args.vocab)]
    megabytes = sum(w.numel() for w in weights) * 2 / 1e6
    print(f"{len(weights)} bf16 weights, {megabytes:.0f} MB, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds (medians)")
    for rows in map(int, args.rows.split(",")):
        x = {w.shape[1]: torch.randn(rows, w.shape[1]).bfloat16() for w in weights}
        with torch.no_grad():
            t = interleaved_medians({
                "F.linear": lambda x=x: [F.linear(x[w.shape[1]], w) for w in weights],
                "kernel": lambda x=x: [kernel(x[w.shape[1]], w, None) for w in weights]},
                args.rounds, clock)
        print(f"  {rows:4d} rows: F.linear {t['F.linear'] * 1e3:7.1f} ms "
              f"({megabytes / 1e3 / t['F.linear']:5.1f} GB/s), kernel {t['kernel'] * 1e3:7.1f} ms "
              f"({megabytes / 1e3 / t['kernel']:5.1f} GB/s): {t['F.linear'] / t['kernel']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stack_arguments(p)
    p.add_argument("--tied-decode", action="store_true", help="decode with a tied head instead")
    p.add_argument("--bf16", action="store_true", help="bf16 products: F.linear vs the kernel")
    add_timing_arguments(p, rounds=5)
    args = p.parse_args()
    clock = timing_setup(args)
    if args.tied_decode:
        return tied_decode(args, clock)
    if args.bf16:
        return bf16_products(args, clock)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    linears = [torch.nn.Linear(i, o, bias=False) for o, i in stack_shapes(args.d_model, args.layers,
                                                                           args.vocab)]
    layouts = {"F.linear": linears,
               "split": [SplitLinear.of(m, parts_for(m.out_features, threads)) for m in linears]}
    kernel = fp32_rows.fp32_rows_kernel()  # None: no compiler here (or MESHLM_NATIVE=0)
    if kernel:  # multiplies at up to KERNEL_ROWS rows, bmm over the same blocks beyond
        layouts["kernel"] = [SplitLinear.for_kernel(m, kernel) for m in linears]
    megabytes = sum(m.weight.numel() for m in linears) * 4 / 1e6
    print(f"{len(linears)} fp32 weights, {megabytes:.0f} MB, {threads} threads, {args.rounds} "
          f"rounds (medians); split: a block per thread, torch.bmm; kernel: "
          f"{fp32_rows.WIDTH}-column blocks, meshlm.kernels.fp32_rows up to {KERNEL_ROWS} rows"
          f"{'' if kernel else ' (not built)'}")
    for rows in map(int, args.rows.split(",")):
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}

        def passes(layers, inputs=inputs):
            return lambda: [m(inputs[m.in_features]) for m in layers]

        with torch.no_grad():
            t = interleaved_medians({name: passes(layers) for name, layers in layouts.items()},
                                    args.rounds, clock)
        print(f"  {rows:4d} rows: " + ", ".join(
            f"{name} {t[name] * 1e3:7.1f} ms ({megabytes / 1e3 / t[name]:5.1f} GB/s, "
            f"{t['F.linear'] / t[name]:.2f}x F.linear)" for name in layouts) +
            (f"; kernel / split {t['split'] / t['kernel']:.2f}x" if kernel else ""))


if __name__ == "__main__":
    main()
