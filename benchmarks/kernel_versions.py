"""One of meshlm's C kernels at two code versions, side by side in one process: the source as
committed at --base (a git revision) and as it is in the working tree, each built for this CPU
(meshlm.kernels.build, the flags decoding builds with) and called through the same layers and
Python as eager decoding calls it (the layers' `row_kernel` swapped between the two builds).
Prints each version's ms per pass over the stack's layers at one row, the weights' read rate, the
ratio, and whether the two give the same numbers bit for bit.

    .venv/bin/python benchmarks/kernel_versions.py --kernel int4_rows --threads 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernel_versions.py --kernel int4_bf16_rows \
        --threads 1
    .venv/bin/python benchmarks/kernel_versions.py --kernel int8_row --layers 2 --vocab 768 --hot
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernel_versions.py --kernel int4_rows \
        --threads 1 --aot
    .venv/bin/python benchmarks/kernel_versions.py --kernel int8_bf16_rows --threads 2 --aot

--aot times the versions where decoding spends most of its time: inside the decode step compiled
ahead of time (`meshlm generate --aot`), which calls the kernel through its C++ operator without
Python, so a version's cost per call counts as it does there. A vanilla model of --layers layers at
--d-model with --vocab words, quantized as the kernel's precision decodes (w4a8, int4, int8
weight-only or w8a8), generates --new-tokens tokens after a 32-token prompt with the operator bound
to each version in turn (meshlm.kernels.operators.register rebinds it); a token's time is the
difference of that and a one-token generation, and the weights it reads are given as a share of the
read bandwidth measured in the same rounds.

Cross-process timings of two code versions drift with a shared VM's read bandwidth (it moved
between 22 and 77 GB/s within an hour on a 2-core Zen 5); here both builds run in the same rounds.
By default every pass first reads a 64 MB tensor, so the weights come from memory as a decoded
token's do; --hot leaves them in the caches (a stack smaller than the L3: `--layers 2 --vocab
768`), which times what a call costs beyond streaming its weights (the rounding of the row, the
threads' start, the Python around the C function).
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch
from benchkit import add_timing_arguments, interleaved_medians, stack_shapes, timing_setup

from meshlm.kernels import build
from meshlm.quant import QuantizedLinear
from meshlm.quant.int4_bf16_kernel import KERNEL as INT4_BF16
from meshlm.quant.int4_kernel import KERNEL as INT4
from meshlm.quant.int4_kernel import give as give_int4
from meshlm.quant.int8_bf16_kernel import KERNEL as INT8_BF16
from meshlm.quant.row_kernel import KERNEL as INT8
from meshlm.quant.row_kernel import give_row_kernel


def giving(kernel):
    """A `give` of a weight-only kernel to every layer, whether or not its probe finds it faster
    than torch's here (weight_only.give asks that): the versions are what is compared."""
    def give(layers) -> bool:
        product = kernel.product()
        for m in layers if product else ():
            m.row_kernel = product
        return product is not None
    return give


# kernel name -> (its Kernel, the QuantizedLinear arguments of its layers, how layers are given it)
KERNELS = {"int4_rows": (INT4, {"bits": 4, "group_size": 64, "activations": "int8"}, give_int4),
           "int4_bf16_rows": (INT4_BF16, {"bits": 4, "group_size": 64, "activations": "bf16"},
                              giving(INT4_BF16)),
           "int8_bf16_rows": (INT8_BF16, {"bits": 8, "activations": "bf16"}, giving(INT8_BF16)),
           "int8_row": (INT8, {"bits": 8, "activations": "int8"}, give_row_kernel)}


def file_at(path: Path, revision: str) -> str:
    """The checkout's file `path` as committed at `revision`."""
    relative = path.relative_to(Path(__file__).resolve().parents[1])
    return subprocess.run(["git", "show", f"{revision}:{relative.as_posix()}"],
                          capture_output=True, text=True, check=True).stdout


def function_at(kernel, revision: str | None, folder: Path):
    """The kernel's C function (bound by ctypes) built from its source at `revision` (None: the
    working tree's file)."""
    source = kernel.source
    if revision is not None:
        text = file_at(source, revision)
        if kernel is INT8 and "int64_t m," not in text:  # before 6fc3f37: one row, no m
            raise SystemExit(f"int8_row at {revision} takes one row (no m argument): compare "
                             "builds from 6fc3f37 on")
        todo = build.includes(text)  # the headers it includes (and theirs), at that revision
        while todo:
            header = todo.pop()
            if not (folder / header).exists():
                included = file_at(source.parent / header, revision)
                (folder / header).write_text(included)
                todo += build.includes(included)
        source = folder / source.name
        source.write_text(text)
    library = build.library(source)
    if library is None:
        raise SystemExit(f"{source}: {build.why_not(source)}")
    return kernel.bound(library)


# kernel name -> the precision (compile_decode.variant) whose layers call it
PRECISION = {"int4_rows": "w4a8", "int4_bf16_rows": "int4", "int8_bf16_rows": "int8",
             "int8_row": "w8a8"}


def ahead(kernel, functions: dict, args, clock) -> None:
    """ms a decoded token of the AOT-compiled step with meshlm::<kernel> bound to each version of
    `functions` (name -> C function), and the weights' share of the read bandwidth (--aot)."""
    from compile_decode import read_shares, step_ms, variant

    from meshlm.config import ModelConfig
    from meshlm.generate import Sampling, generate
    from meshlm.kernels import operators
    from meshlm.model import MeshLM
    from meshlm.runtime import precision

    torch.manual_seed(0)
    cfg = ModelConfig(spec=str(args.layers), d_model=args.d_model, n_heads=args.d_model // 64,
                      vocab_size=args.vocab, context_length=256, scheme="vanilla",
                      scale_embeddings=False)
    model, chosen = variant(MeshLM(cfg).eval(), PRECISION[args.kernel])
    if not any(getattr(m, "row_kernel", None) for m in model.modules()):
        raise SystemExit(f"{args.kernel}: decoding does not give it to the layers here (its "
                         "probe found torch's kernel faster)")
    prompts = torch.randint(2, args.vocab, (1, 32),
                            generator=torch.Generator().manual_seed(0)).tolist()
    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)

    def bind(function) -> None:
        if not operators.register(kernel.name, function):
            raise SystemExit(f"meshlm::{kernel.name}: {operators.unavailable()}")

    def tokens_of(function) -> list:
        bind(function)
        with torch.no_grad(), precision.autocast(torch.device("cpu"), chosen):
            return generate(model, prompts, s, compile="aot")

    tokens = {name: tokens_of(f) for name, f in functions.items()}  # the first builds the step
    args.batch, args.exit, args.speculate = 1, None, None  # step_ms decodes plainly, one row
    ms, reading = step_ms({name: (model, chosen, "aot", lambda f=f: bind(f))
                           for name, f in functions.items()}, prompts, s, args, clock)
    shares = read_shares(model, ms, reading, args.batch)
    print(f"{args.kernel} in the AOT step of a {args.layers}-layer d = {args.d_model} "
          f"{PRECISION[args.kernel]} model, {torch.get_num_threads()} threads, {args.rounds} "
          f"rounds, {args.new_tokens} tokens; read bandwidth {reading / 1e9:.1f} GB/s")
    for name, value in ms.items():
        print(f"  {name:8s} {value:6.3f} ms a token, weights read at {shares[name]:.0%} of it")
    base, tree = ms.values()
    print(f"  tree / {args.base}: {base / tree:.3f}x; same greedy tokens: "
          f"{len(set(map(str, tokens.values()))) == 1}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=sorted(KERNELS), default="int4_rows")
    p.add_argument("--base", default="HEAD", help="the git revision to compare the tree with")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--hot", action="store_true", help="no read between passes (module docstring)")
    p.add_argument("--aot", action="store_true",
                   help="inside the AOT-compiled decode step (module docstring)")
    p.add_argument("--new-tokens", type=int, default=64, help="with --aot")
    add_timing_arguments(p, rounds=15)
    args = p.parse_args()
    clock = timing_setup(args)
    kernel, quantized, give = KERNELS[args.kernel]
    with tempfile.TemporaryDirectory() as folder:
        functions = {args.base: function_at(kernel, args.base, Path(folder)),
                     "tree": function_at(kernel, None, Path(folder))}
    if args.aot:  # its own model, laid out as decoding lays it out
        return ahead(kernel, functions, args, clock)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        QuantizedLinear.from_linear(torch.nn.Linear(i, o), **quantized)
        for o, i in stack_shapes(args.d_model, args.layers, args.vocab))
    if not give(layers):
        raise SystemExit(f"{args.kernel}: no kernel here ({kernel.unavailable()})")
    products = {name: kernel.wrap(f) for name, f in functions.items()}
    inputs = {m.in_features: torch.randn(1, m.in_features) for m in layers}
    flush = torch.ones(16 * 2**20)  # 64 MB, more than the L3s meshlm is measured on

    def run(product, out=None):
        def go():
            if not args.hot:
                flush.sum()
            for m in layers:
                m.row_kernel = product
            ys = [m(inputs[m.in_features]) for m in layers]
            if out is not None:
                out.extend(ys)
        return go

    outs = {name: [] for name in products}
    with torch.no_grad():
        for name, product in products.items():
            run(product, outs[name])()
        flushed = {} if args.hot else {"read 64 MB": flush.sum}
        t = interleaved_medians({**{name: run(pr) for name, pr in products.items()}, **flushed},
                                args.rounds, clock)
    size = sum(t.numel() * t.element_size() for t in layers.state_dict().values())  # stored
    same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
    base, tree = (t[name] - t.get("read 64 MB", 0.0) for name in products)
    print(f"{args.kernel}: {len(layers)} layers (d = {args.d_model}, {args.layers} layers, "
          f"vocab {args.vocab}), {torch.get_num_threads()} threads, {args.rounds} rounds, "
          f"{'weights in the caches' if args.hot else 'caches flushed by a 64 MB read'}")
    for name, sec in ((args.base, base), ("tree", tree)):
        print(f"  {name:8s} {sec * 1e3:7.3f} ms a pass, {size / sec / 1e9:5.1f} GB/s")
    print(f"  tree / {args.base}: {base / tree:.3f}x; same numbers: {same}")


if __name__ == "__main__":
    main()
