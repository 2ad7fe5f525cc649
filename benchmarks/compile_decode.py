"""Decoding through the compiled step (meshlm generate --compile; meshlm.generate.compiled) against
the eager decoder, side by side in one run, at every precision `meshlm generate` decodes in: fp32
under the default policy (its weight layout and kernel as this machine's probes chose), bf16 (its
kernel where it pays; "bf16 F.linear" without it, what bf16 decoding was before), int8 weight-only
(int8), int8 with int8 activations (w8a8), int4 and int4 with int8 activations (w4a8). Prints
tokens/s, the ratio, the first compiled call's seconds (the compile, with whatever Inductor had
cached on disk), the weights read eager and compiled as a share of this machine's read bandwidth (a
step's weight bytes times steps/s; the bandwidth measured in the same rounds, step_ms) and whether
the greedy tokens are the eager ones.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_decode.py --threads 1
    .venv/bin/python benchmarks/compile_decode.py --spec 2+4R2+2 --scheme mesh --threads 2
    .venv/bin/python benchmarks/compile_decode.py --no-matmul --threads 2   # the per-token split
    .venv/bin/python benchmarks/compile_decode.py --operators --threads 2   # C++ against Python
    .venv/bin/python benchmarks/compile_decode.py --aot --threads 2   # AOTInductor against jit
    .venv/bin/python benchmarks/compile_decode.py --spec 1+2R4+1 --scheme mesh --exit state:0.4 \
        --precisions fp32,int4 --threads 2   # per-token exit, eager and compiled
    .venv/bin/python benchmarks/compile_decode.py --spec 1+2R4+1 --scheme mesh --speculate 2:3 \
        --precisions fp32,int4 --threads 2   # self-speculation, eager and compiled stages
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_decode.py --spec 2+2R4+2 --scheme mesh \
        --stages --threads 1 --context 512   # a plain token through speculation's compiled stages
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_decode.py --aot --threads 1 \
        --precisions int4,w4a8   # --precisions: those alone (with --aot)

--no-matmul splits a token's time: the fp32 model as decoded, and the same model with every weight
product (each linear and the output layer) replaced by a slice of its input (a view the compiler
fuses); what is left (norms, rotary, attention over the cache, the scheme's own math, sampling over
the vocabulary, the Python and dispatch around them) is the non-matmul time per token, eager,
compiled by torch.compile and compiled ahead of time (AOTInductor, no guards or generated Python
around it; plain decoding only).

--stages bounds what compiling speculation over a static cache could buy: a plain token (fp32 as
decoded) through the static compiled step (`--compile`), through the compiled stages that
`--compile --speculate` runs its rounds on (steps.CompiledStages, timed for the planner, one call a
stage and loop step, over the growing cache), through the symbolic step serving runs
(PlainDecoder(compiled=True)) and eagerly; a round's forwards are such stage calls.

A model of --spec at d = 768, 12 heads, a 50,304-word vocabulary (random weights), greedy, batch
--batch, a 32-token prompt, --new-tokens new ones with EOS ignored; each round runs eager and
compiled once per precision (interleaved), medians of --rounds; a token's time is the difference
of a --new-tokens and a one-token generation over the tokens between, so the prompt's prefill
(eager in both) is not in it.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from benchkit import (
    add_timing_arguments,
    bf16_without_kernel,
    decoding_copy,
    interleaved_medians,
    read_sum,
    timing_setup,
    weight_bytes_per_token,
)

PRECISIONS = ("fp32", "bf16", "bf16 F.linear", "int8", "w8a8", "int4", "w4a8")


def variant(model, name: str, huge: bool = False) -> tuple:
    """(`model` laid out as meshlm generate decodes it at precision `name`, its Precision);
    `huge`: its weights on 2 MB pages where Linux can (decoding.prepare)."""
    from meshlm.quant import PARTS, quantize_model

    if name == "bf16 F.linear":
        return bf16_without_kernel(model)
    if name in ("fp32", "bf16"):
        return decoding_copy(model, "auto" if name == "fp32" else "bf16", huge)
    bits, activations = {"int8": (8, "bf16"), "w8a8": (8, "int8"), "int4": (4, "bf16"),
                          "w4a8": (4, "int8")}[name]
    quantized = quantize_model(copy.deepcopy(model), bits, PARTS, activations=activations)[0]
    return decoding_copy(quantized, "auto", huge)


def precisions(text: str) -> tuple[str, ...]:
    """A --precisions argument's names (comma-separated), each one of PRECISIONS."""
    names = tuple(text.split(","))
    unknown = set(names) - set(PRECISIONS)
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(sorted(unknown))} not among "
                                         f"{', '.join(PRECISIONS)}")
    return names


def variants(model, names: tuple[str, ...] = PRECISIONS) -> dict:
    """precision -> (model laid out as meshlm generate decodes it, its Precision), for `names`."""
    return {name: variant(model, name) for name in names}


class NoProduct(torch.nn.Module):
    """A weight product's stand-in: (…, in) -> (…, out) by slicing (or tiling) the input, a view
    or one small copy that the compiler fuses with its neighbours, so nothing of the product's cost
    (its dispatch included) is left in the time of what surrounds it."""

    def __init__(self, out: int):
        super().__init__()
        self.out = out

    def forward(self, x):
        tiles = -(-self.out // x.shape[-1])
        return (x if tiles == 1 else x.repeat(*([1] * (x.dim() - 1)), tiles))[..., :self.out]


def without_products(model) -> torch.nn.Module:
    """A copy of `model` whose every linear and output layer is a NoProduct."""
    model = copy.deepcopy(model)
    for m in list(model.modules()):
        for child, sub in list(m.named_children()):
            if type(sub) is torch.nn.Linear:  # MeSH's routers (small) keep theirs
                setattr(m, child, NoProduct(sub.out_features))
    model.embed_out = NoProduct(model.config.vocab_size)
    return model


BENCH = torch.library.Library("meshlm_bench", "DEF")  # --operators' Python-implemented copies


def python_operators(model) -> torch.nn.Module:
    """A copy of `model` whose C kernels a compiled step reaches through copies of their operators
    implemented in Python (meshlm_bench::<name>, the product by ctypes), as meshlm::<name> was
    before its C++ implementation."""
    from meshlm.kernels.kernel import KERNELS

    swap = {}
    for kernel in KERNELS:
        product = kernel.product()
        if product is not None and not hasattr(torch.ops.meshlm_bench, kernel.name):
            BENCH.define(kernel.schema)
            BENCH.impl(kernel.name, product, "CPU")  # outside a trace: the ctypes call
            torch.library.register_fake(f"meshlm_bench::{kernel.name}", kernel.fake, lib=BENCH)
        if product is not None:
            op = getattr(torch.ops.meshlm_bench, kernel.name)
            swap[id(product)] = (lambda *a, op=op, product=product:
                                 op(*a) if torch.compiler.is_compiling() else product(*a))
    model = copy.deepcopy(model)
    for m in model.modules():
        for attr in ("kernel", "row_kernel"):
            if id(getattr(m, attr, None)) in swap:
                setattr(m, attr, swap[id(getattr(m, attr))])
    return model


def operators(model, prompts, s, args, clock) -> None:
    """ms a decoded token (step_ms) of the compiled step, the kernels' operators implemented in C++
    against in Python, per precision with a kernel here."""
    from meshlm.kernels.kernel import KERNELS, compiled_operators

    print("ms a compiled step, the kernels' operators in C++ / in Python (meshlm_bench copies)")
    laid_out_variants = variants(model)
    compiled_operators()
    print("  implemented:", {k.name: k.implemented for k in KERNELS})
    for name, (laid_out, chosen) in laid_out_variants.items():
        if name == "bf16 F.linear":  # no meshlm kernel in it
            continue
        runs = {"C++": (laid_out, chosen, True),
                "Python": (python_operators(laid_out), chosen, True)}
        ms, reading = step_ms(runs, prompts, s, args, clock)
        share = read_shares(laid_out, ms, reading, args.batch)
        cpp, py = ms["C++"], ms["Python"]
        print(f"  {name:5s} C++ {cpp:6.2f} ms ({share['C++']:.0%} of {reading / 1e9:.1f} GB/s), "
              f"Python {py:6.2f} ms ({share['Python']:.0%}): {py / cpp:.2f}x", flush=True)


def ahead(model, prompts, s, args, clock) -> None:
    """ms a decoded token (step_ms) of the step compiled ahead of time (AOTInductor,
    meshlm.generate.ahead) against torch.compile's, per precision; whether the greedy tokens are
    the same, and the first AOT generation's seconds (export, then compile or load)."""
    from meshlm.generate import generate
    from meshlm.runtime import precision

    print("ms a compiled step, AOTInductor / torch.compile")
    names = tuple(n for n in args.precisions if n != "bf16 F.linear")
    for name, (laid_out, chosen) in variants(model, names).items():
        with torch.no_grad(), precision.autocast(torch.device("cpu"), chosen):
            start = time.perf_counter()
            tokens = generate(laid_out, prompts, s, compile="aot")
            first = time.perf_counter() - start
            same = tokens == generate(laid_out, prompts, s, compile=True)
        runs = {"aot": (laid_out, chosen, "aot"), "jit": (laid_out, chosen, True)}
        ms, reading = step_ms(runs, prompts, s, args, clock)
        share = read_shares(laid_out, ms, reading, args.batch)
        print(f"  {name:5s} AOT {ms['aot']:6.2f} ms ({share['aot']:.0%} of {reading / 1e9:.1f} "
              f"GB/s), torch.compile {ms['jit']:6.2f} ms ({share['jit']:.0%}): "
              f"{ms['jit'] / ms['aot']:.2f}x; same greedy tokens: {same}; first AOT "
              f"generation {first:.0f} s", flush=True)


def read_shares(laid_out, ms: dict, reading: float, batch: int) -> dict:
    """Per key of `ms` (ms a decoded token, step_ms): the weights a step reads (one step decodes
    `batch` tokens) over its time, as a share of the read bandwidth `reading` (bytes/s)."""
    return {k: weight_bytes_per_token(laid_out) * 1e3 / (v * batch) / reading
            for k, v in ms.items()}


def step_ms(runs: dict, prompts, s, args, clock) -> tuple[dict, float]:
    """(ms a decoded token, prefill excluded (a generation of --new-tokens against one of a single
    token, the difference over the tokens between), per key of `runs` (key -> (the model as
    decoded, its Precision, compile or not[, a callable run before each of its generations]));
    the read bandwidth in bytes/s, from
    benchkit.read_sum), all timed in the same interleaved rounds, so that the
    bandwidth a step is compared with is the machine's at that time (on a shared VM it moved
    between 45 and 77 GB/s within the hour)."""
    import dataclasses

    from meshlm.generate import generate
    from meshlm.runtime import precision

    one = dataclasses.replace(s, max_new_tokens=1)

    def run(sampling, m, chosen, compile, before=None):
        if before is not None:
            before()
        with torch.no_grad(), precision.autocast(torch.device("cpu"), chosen):
            return generate(m, prompts, sampling, compile=compile, exit=args.exit,
                            speculate=args.speculate)

    cases = {(key, n): (lambda r=r, sm=sm: run(sm, *r))
             for key, r in runs.items() for n, sm in ((1, one), (args.new_tokens, s))}
    cases["read"], size = read_sum()
    t = interleaved_medians(cases, args.rounds, clock)
    return ({key: 1e3 * (t[key, args.new_tokens] - t[key, 1]) / ((args.new_tokens - 1) * args.batch)
             for key in runs}, size / t["read"])


def split(model, prompts, s, args, clock) -> None:
    """ms a decoded token (step_ms) of the fp32 model as decoded and of its copy without weight
    products, eager, compiled by torch.compile and (plain decoding only) ahead of time."""
    full, chosen = decoding_copy(model, "auto")
    bare = without_products(model)
    modes = {"eager": False, "compiled": True}
    if args.exit is None and args.speculate is None:  # the AOT step decodes plainly only
        modes["ahead"] = "aot"
    runs = {(what, mode): (m, chosen, c) for what, m in (("whole", full), ("no-matmul", bare))
            for mode, c in modes.items()}
    ms, _ = step_ms(runs, prompts, s, args, clock)
    for mode in modes:
        whole, bare_ms = ms["whole", mode], ms["no-matmul", mode]
        print(f"  {mode:9s} {whole:6.2f} ms a token; without weight products {bare_ms:5.2f} ms "
              f"(the products {whole - bare_ms:.2f} ms)", flush=True)


def stages(model, prompts, args, clock) -> None:
    """ms a plain decoded token (fp32 as decoded; `steps` steps a round after an eager prefill)
    through the static compiled step, the compiled stages (timed, as speculation's rounds run them),
    the symbolic compiled step and eagerly, in interleaved rounds after `warm` steps each."""
    from meshlm.generate import PlainDecoder, left_pad
    from meshlm.generate.compiled import CompiledDecoder
    from meshlm.generate.planner import Costs
    from meshlm.generate.steps import CompiledStages
    from meshlm.generate.timing import Timed

    laid_out, steps, warm = decoding_copy(model, "fp32")[0], 32, 48
    # the prefill's token, the warm-up steps, interleaved_medians' untimed call and its rounds
    new_tokens = 1 + warm + steps * (args.rounds + 1)
    if len(prompts[0]) + new_tokens > args.context:
        raise SystemExit(f"--stages decodes {len(prompts[0]) + new_tokens} positions: pass "
                         f"--context {len(prompts[0]) + new_tokens} or more")
    schedule, ids = laid_out.schedule(), left_pad(prompts, 1, torch.device("cpu"))

    def greedy(logits):
        return logits.argmax(-1)
    decoders = {
        "static compiled step": CompiledDecoder(laid_out, schedule, greedy, new_tokens),
        "compiled stages": PlainDecoder(Timed(CompiledStages(laid_out), Costs(schedule)),
                                        schedule, greedy),
        "symbolic compiled step": PlainDecoder(laid_out, schedule, greedy, compiled=True),
        "eager": PlainDecoder(laid_out, schedule, greedy)}
    runs = {}
    with torch.no_grad():
        for name, decoder in decoders.items():
            # every prefill is eager; the stages' own would run through them, so theirs is a
            # plain decoder's, as speculation's rounds prefill
            staged = name == "compiled stages"
            batch = (PlainDecoder(laid_out, schedule, greedy) if staged else decoder).prefill(*ids)

            def run(decoder=decoder, batch=batch, n=steps, grow=staged):
                for _ in range(n):
                    if grow:  # the cache grows outside the stages, as speculation grows it
                        batch.kv.reserve(2)
                    decoder.step(batch)
            run(n=warm)
            runs[name] = run
        ms = {k: 1e3 * v / steps for k, v in interleaved_medians(runs, args.rounds, clock).items()}
    for name, value in ms.items():
        print(f"  {name:23s} {value:6.2f} ms a token "
              f"({value / ms['static compiled step']:.2f}x the static step's)", flush=True)


def main() -> None:
    from meshlm.config import ModelConfig
    from meshlm.generate import Sampling, generate
    from meshlm.generate.speculative import Speculation
    from meshlm.model import MeshLM
    from meshlm.model.exit import ExitRule
    from meshlm.runtime import precision

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="12")
    p.add_argument("--scheme", default="vanilla")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="the model's context length")
    p.add_argument("--operators", action="store_true",
                   help="the compiled step with the kernels' operators in C++ against in Python")
    p.add_argument("--aot", action="store_true",
                   help="the step compiled ahead of time (AOTInductor) against torch.compile's")
    p.add_argument("--no-matmul", action="store_true",
                   help="fp32 only: the per-token time without weight products, eager, "
                        "jit- and AOT-compiled")
    p.add_argument("--stages", action="store_true",
                   help="fp32 only: a plain token through the static compiled step, "
                        "speculation's compiled stages, the symbolic step and eagerly")
    p.add_argument("--precisions", type=precisions, default=PRECISIONS,
                   help="these precisions only (comma-separated)")
    p.add_argument("--exit", type=ExitRule.parse, default=None, metavar="RULE",
                   help="decode with per-token exit (e.g. state:0.05), eager and compiled")
    p.add_argument("--speculate", type=Speculation.parse, default=None, metavar="K_d:γ",
                   help="decode by self-speculation (e.g. 1:3), eager and compiled stages")
    add_timing_arguments(p, rounds=3)
    args = p.parse_args()
    if (args.exit or args.speculate) is not None and (args.aot or args.operators):
        p.error("--exit and --speculate compare eager and torch.compile's steps; drop --aot and "
                "--operators")
    clock = timing_setup(args)
    torch.manual_seed(0)
    cfg = ModelConfig(spec=args.spec, d_model=768, n_heads=12, vocab_size=50304,
                      context_length=args.context, scheme=args.scheme, scale_embeddings=False)
    model = MeshLM(cfg).eval()
    prompts = torch.randint(2, 50304, (args.batch, 32),
                            generator=torch.Generator().manual_seed(0)).tolist()
    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)
    print(f"{args.spec} {args.scheme}, d_model 768, batch {args.batch}, {args.new_tokens} new "
          f"tokens, {torch.get_num_threads()} threads, {args.rounds} rounds (medians)")
    if args.no_matmul:
        return split(model, prompts, s, args, clock)
    if args.stages:
        return stages(model, prompts, args, clock)
    if args.operators:
        return operators(model, prompts, s, args, clock)
    if args.aot:
        return ahead(model, prompts, s, args, clock)
    rates = {}
    print("tokens/s of the decode steps (prefill excluded); weights read: a step's weight bytes "
          "times steps/s, as a share of the read bandwidth measured in the same rounds")
    for name, (laid_out, chosen) in variants(model, args.precisions).items():
        def run(compile: bool, laid_out=laid_out, chosen=chosen):
            with torch.no_grad(), precision.autocast(torch.device("cpu"), chosen):
                return generate(laid_out, prompts, s, compile=compile, exit=args.exit,
                                speculate=args.speculate)
        start = time.perf_counter()
        same = run(True) == run(False)
        first = time.perf_counter() - start
        modes = {mode: (laid_out, chosen, mode == "compiled") for mode in ("eager", "compiled")}
        ms, reading = step_ms(modes, prompts, s, args, clock)
        rate = rates[name] = {k: 1e3 / v for k, v in ms.items()}
        share = read_shares(laid_out, ms, reading, args.batch)
        print(f"  {name:13s} eager {rate['eager']:6.1f} tokens/s, compiled {rate['compiled']:6.1f} "
              f"({rate['compiled'] / rate['eager']:.2f}x); weights read {share['eager']:.0%} / "
              f"{share['compiled']:.0%} of {reading / 1e9:.1f} GB/s; first compiled call "
              f"{first:.0f} s; same greedy tokens: {same}", flush=True)
    if {"bf16", "bf16 F.linear"} <= rates.keys():
        print(f"bf16 compiled, through its kernel / bf16 eager through F.linear: "
              f"{rates['bf16']['compiled'] / rates['bf16 F.linear']['eager']:.2f}x")


if __name__ == "__main__":
    main()
