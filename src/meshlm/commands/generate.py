"""`meshlm generate CKPT "prompt"`: sample text from any model folder, streamed.

CKPT is anything meshlm.loading opens: a run dir (its latest checkpoint), a checkpoint dir, a
converted or retrofitted folder, a folder written by `meshlm convert --to hf`, or a GPT-NeoX / Llama
/ OLMoE folder. Decoding uses the looped KV cache (one entry per unrolled layer). With several
prompts they run as one left-padded batch and are printed when done; a single prompt streams token
by token. `--speculate` decodes by lossless self-speculation (meshlm.generate.speculative) and
prints its acceptance rate and tokens/s on stderr.
"""
from __future__ import annotations

import argparse
import sys

from meshlm.runtime.options import add_dtype_argument, add_tokenizer_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run or checkpoint dir, converted/retrofitted folder, or "
                                      "Hugging Face folder")
    p.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="text to continue (several: one batch)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64,
                   help="tokens to generate (default 64)")
    p.add_argument("-t", "--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling mass (1 = off; default 0.95)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--loops", type=int, default=None,
                   help="run the core this many times (single-core specs; at most --max-loops)")
    p.add_argument("--max-loops", type=int, default=None, metavar="N",
                   help="the cap on --loops (default: 4x the trained count)")
    p.add_argument("--exit", default=None,
                   help="per-token adaptive exit, e.g. state:0.05 or kl:1e-4 (a token stops "
                        "looping once converged)")
    add_tokenizer_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_dtype_argument(p, decoding=True)
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence each step (slow)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past <|endoftext|>")
    p.add_argument("--speculate", default=None, metavar="auto|K_d[:γ]",
                   help="lossless self-speculative decoding: draft with K_d loop passes, γ tokens "
                        "per round (auto: chosen from measured acceptance and cost, plain "
                        "decoding when "
                        "it would not pay); prints acceptance and tokens/s on stderr")
    p.add_argument("--compile", action="store_true",
                   help="decode through one step compiled by torch.compile over a static KV cache "
                        "where a race against the eager step finds it faster (at the full depth "
                        "or with --exit; with --speculate its rounds through compiled stages; the "
                        "first call compiles for seconds, minutes with --speculate at d = 768; "
                        "Inductor keeps its kernels on disk)")
    p.add_argument("--aot", action="store_true",
                   help="--compile with the step compiled ahead of time by AOTInductor: no "
                        "per-token guards or Python (~20 s the first time a model's shape is "
                        "seen, then kept on disk)")
    p.hints = {"required": 'pass the text to continue, e.g. meshlm generate runs/small-mesh "To '
                           'be, or not to be"',
               "argument": 'a prompt that starts with "-" goes after --, e.g. meshlm generate RUN '
                           '-- "-5 degrees"'}


def run(args: argparse.Namespace) -> int:
    from meshlm.decoding import HUGE_PAGES_STEPS, for_decoding
    from meshlm.generate import check_loops, check_room, compiled
    from meshlm.loading import open_model
    from meshlm.runtime import precision

    s, texts = check_inputs(args)
    opened = open_model(args.checkpoint, args.device, tokenizer=args.tokenizer,
                        force_tokenizer=args.force_tokenizer)
    model, tok = opened.model, opened.tokenizer
    prompts = [tok.encode(text) for text in texts]
    check_room(model, prompts, s)  # before anything is written to stdout
    if args.compile and args.speculate is None:  # the static cache's extra column (speculation
        # compiles its stages over the growing cache instead)
        compiled.check_room(model, prompts, s.max_new_tokens)
    check_loops(model, args.loops, args.max_loops)
    # the weights on 2 MB pages where a generation is long enough to pay for it
    device, chosen = for_decoding(args.dtype, model,
                                  huge=s.max_new_tokens >= HUGE_PAGES_STEPS)
    with precision.autocast(device, chosen):
        # with --speculate the planner times the compiled stages as it plans (not raced)
        raced = _race(args, model, tok.pad_id, prompts, s.max_new_tokens) \
            if args.compile and args.speculate is None else None
        code = _generate(args, model, tok, s, texts, prompts)
    # after the text, on stderr: stdout holds only the text, and an error stays the only line on
    # stderr
    print(f"generated in {chosen.describe()}{_raced_note(raced, bool(args.compile))}"
          f"{_operators_note(args)}",
          file=sys.stderr, flush=True)
    return code


def _race(args: argparse.Namespace, model, pad_id: int, prompts: list[list[int]],
          new_tokens: int) -> dict | None:
    """--compile/--aot: the compiled step raced against the eager one for this generation's
    shapes (meshlm.generate.compiled.race); where it is not faster, args.compile turns off and
    the generation decodes eagerly. The race's figures, or None where it did not run."""
    from meshlm.generate import compiled, left_pad

    ids, mask = left_pad(prompts, pad_id, next(model.parameters()).device)
    raced = compiled.race(model, model.schedule(args.loops), ids, mask, new_tokens,
                          ahead=args.compile == "aot", exit=args.exit)
    if raced is not None and raced["compiled_ms"] >= raced["eager_ms"]:
        args.compile = False
    return raced


def _raced_note(raced: dict | None, kept: bool) -> str:
    """What the race found and whether the compiled step was `kept` (_race), for the precision
    line."""
    if raced is None:
        return ""
    return (f"; decode step compiled in {raced['seconds']:.0f} s: {raced['compiled_ms']:.2f} ms "
            f"a step against {raced['eager_ms']:.2f} eager, so decoded "
            + ("compiled" if kept else "eagerly (compiling does not pay here)"))


def _operators_note(args: argparse.Namespace) -> str:
    """Where a compiled step reached its C kernels through their Python operators (no C++ ones
    here, meshlm.kernels.operators): that, and why; else nothing."""
    from meshlm.kernels import operators

    why = operators.unavailable() if args.compile else None
    return f"; the compiled step calls its kernels through Python operators ({why})" if why else ""


def _generate(args: argparse.Namespace, model, tok, s, texts: list[str],
              prompts: list[list[int]]) -> int:
    from meshlm.generate import generate, stream
    from meshlm.generate.speculative import SpeculationStats

    stats = SpeculationStats() if args.speculate is not None else None
    common = dict(eos_id=tok.eos_id, pad_id=tok.pad_id, cache=not args.no_cache, loops=args.loops,
                  exit=args.exit,
                  speculate=args.speculate, stats=stats, compile=args.compile)
    if len(prompts) > 1:
        for text, new in zip(texts, generate(model, prompts, s, **common)):
            print(text + tok.decode(t for t in new if t != tok.eos_id))
            print("-" * 40)
        _report(stats)
        return 0
    sys.stdout.write(texts[0])
    new, shown = [], ""
    for token in stream(model, prompts, s, **common):
        if int(token[0]) == tok.eos_id and s.stop_at_eos:
            break
        new.append(int(token[0]))
        text = tok.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tok.decode(new)[len(shown):] + "\n")
    _report(stats)
    return 0


def _report(stats) -> None:
    """Speculation's acceptance rate and speed, on stderr so stdout stays the generated text
    alone."""
    if stats is not None:
        sys.stdout.flush()
        print(stats.summary(), file=sys.stderr)


def shell_text(text: str) -> str:
    """A prompt as the shell passed it: bytes that are not UTF-8 (surrogate-escaped by Python)
    become U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def check_inputs(args: argparse.Namespace):
    """Sampling settings, loops, exit rule, device, the model folder and the prompts, all checked
    before loading anything (every problem in one error). Returns (Sampling, prompts as text)."""
    from pathlib import Path

    from meshlm.errors import Problems
    from meshlm.folders import hub
    from meshlm.generate import Sampling
    from meshlm.generate.compiled import AHEAD_PLAIN
    from meshlm.generate.speculative import Speculation
    from meshlm.model.exit import ExitRule
    from meshlm.runtime.devices import resolve_device

    p = Problems()
    s = p.check(Sampling, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, stop_at_eos=not args.ignore_eos)
    p.need(args.loops is None or args.loops >= 1,
           f"--loops {args.loops} must be >= 1 (omit it for the trained count)")
    p.need(args.max_loops is None or args.max_loops >= 1,
           f"--max-loops {args.max_loops} must be >= 1 (omit it for 4x the trained count)")
    # parsed once, here: the settings travel typed from now on
    if args.exit is not None:
        args.exit = p.check(ExitRule.parse, args.exit)
    if args.speculate is not None:
        args.speculate = p.check(Speculation.parse, args.speculate)
    args.compile = "aot" if args.aot else args.compile  # --aot is --compile, ahead of time
    p.need(not args.compile or not args.no_cache,
           "--compile decodes with the KV cache; drop --no-cache (or --compile)")
    p.need(args.compile != "aot" or (args.exit is None and args.speculate is None), AHEAD_PLAIN)
    p.check(resolve_device, args.device)
    p.need(Path(args.checkpoint).is_dir() or hub.is_hub_name(args.checkpoint),
           f"{args.checkpoint} is not a folder; pass a meshlm run or step-NNNNNN folder, a Hugging "
           "Face folder (e.g. written by `meshlm convert --to hf`) or a Hub name "
           "org/name[@revision]")
    texts = [shell_text(t) for t in args.prompts]
    empty = [i for i, t in enumerate(texts, 1) if not t]
    p.need(not empty,
           f"prompt {', '.join(map(str, empty))} is empty; pass the text to continue, e.g. "
           f'meshlm generate {args.checkpoint} "Once upon a time"')
    p.raise_if_any()
    return s, texts
