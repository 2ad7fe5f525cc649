"""Self-speculative decoding vs. plain cached decoding, side by side in one run; prints ratios and
acceptance.

    .venv/bin/python benchmarks/speculative.py runs/mesh-1+2R8+1 --threads 1 --clock cpu
    .venv/bin/python benchmarks/speculative.py runs/mesh-small-mesh --draft-loops 1 \
        --temperature 0.8

Variants, each run once per round in turn (interleaved, the order flipped every round): plain cached
decoding, `--speculate K_d` for every K_d in --draft-loops (γ chosen from the measured acceptance
and cost), and `--speculate auto` (K_d and γ chosen, or plain decoding when it would not pay).
Shown: the median tokens/s, and the median of the round-by-round ratios to plain with their range
(slow drifts of a shared machine cancel within a round; the range shows what is left). Prompts are
the openings of held-out documents of the embedded corpus (validation split), so acceptance is
measured on real text; EOS is ignored, so every run makes exactly --new-tokens tokens per row (the
time includes the prompt's prefill and, for auto, the probing rounds). Greedy by default;
--temperature > 0 samples (same seed per variant; speculation is exact in distribution, not in
tokens, then).

The cost arithmetic: c_d = cost of one draft token (prelude + K_d loops + coda + head) over one
plain token, v = cost of verifying γ+1 tokens (loops K_d+1 … K + coda + head) over one plain token,
α the per-token acceptance. A round costs γ·c_d + (shared part of the last token) + v and yields (1
− α^{γ+1})/(1 −
α) tokens; the printed bound is that ratio at the measured α and at α = 1.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from benchkit import add_timing_arguments, corpus_prompts, timing_setup


def decode(model, prompts, args, speculate, clock):
    from meshlm.generate import Sampling, generate
    from meshlm.generate.speculative import SpeculationStats

    s = Sampling(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                 seed=0,
                 stop_at_eos=False)
    stats = SpeculationStats() if speculate else None
    start = clock()
    out = generate(model, prompts, s, speculate=speculate, stats=stats, loops=args.loops)
    elapsed = clock() - start
    assert all(len(row) == args.new_tokens for row in out)
    return elapsed, out, stats


def cost_arithmetic(model, prompts, args, k_ds) -> None:
    """Per-stage costs measured in one auto run, and the speed-up they bound at the measured
    acceptance."""
    from meshlm.generate import Sampling, speculative
    from meshlm.generate.planner import expected_tokens

    s = Sampling(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                 seed=0,
                 stop_at_eos=False)
    planners = []
    for k_d in k_ds:  # one run per K_d so each gets its own acceptance
        stats = speculative.SpeculationStats()
        list(speculative.stream(model, prompts, s, speculative.Speculation(k_d), stats=stats,
                                loops=args.loops))
        planners.append(stats.planner)
    print("cost arithmetic (per-stage costs measured while decoding; ratios to one plain token):")
    print("  K_d   c_d   α      best γ  v(γ)  predicted   bound at α=1 (γ=8)")
    for k_d, planner in zip(k_ds, planners):
        costs = planner.costs
        plain = costs.plain_token()
        c_d = (costs.front(k_d) + costs.stage("readout", 1)) / plain
        alpha = planner.alpha(k_d)
        gain, gamma = planner.best(k_d, alpha)
        verify = (costs.round(k_d, gamma) - gamma * c_d * plain - costs.front(k_d)) / plain
        bound = expected_tokens(1.0, 8) * plain / costs.round(k_d, 8)
        print(f"  {k_d:<4} {c_d:5.2f}  {alpha:5.1%}  {gamma:<7} {verify:5.2f}  {gain:6.2f}x    "
              f"{bound:6.2f}x")


def agreement(model, tok, k_ds, loops) -> None:
    """Teacher-forced greedy agreement of the K_d-pass exit with the full depth on held-out text (4
    × 200 tokens, or the context length), with the coda reading the loop state itself or
    scheme.early_exit (MeSH: the final read router)."""
    from dataclasses import replace

    length = min(200, model.config.context_length)
    ids = torch.tensor(corpus_prompts(tok, 4, length))
    schedule = model.schedule(loops)
    with torch.no_grad():
        full = model(ids, loops=loops).logits.argmax(-1)
        print("teacher-forced "
              f"greedy agreement with the full depth (4 x {length} held-out tokens):")
        for k_d in k_ds:
            run = model.advance(model.enter(ids), schedule, stop=k_d)
            own = model.readout(run, schedule).argmax(-1)
            early = replace(run, h=model.scheme.early_exit(run.h, run.ctx, len(schedule)))
            final = model.readout(early, schedule).argmax(-1)
            print(f"  K_d={k_d}: loop state {(own == full).float().mean():6.1%}   "
                  f"early_exit {(final == full).float().mean():6.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint",
                   help="a trained looped model: meshlm checkpoint/run dir or HF folder")
    p.add_argument("--draft-loops", default="",
                   help="K_d values to run, comma-separated (default: 1 … K−1)")
    p.add_argument("--settings", default="",
                   help="extra K_d:γ settings to run, comma-separated (e.g. 4:6)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--loops", type=int, default=None,
                   help="run the model at this many loop passes (default: K)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    add_timing_arguments(p, rounds=3)
    args = p.parse_args()
    clock = timing_setup(args)

    from meshlm.generate.speculative import Speculation
    from meshlm.loading import open_model

    opened = open_model(args.checkpoint)
    model, tok = opened.model, opened.tokenizer
    k = len(model.schedule(args.loops))
    k_ds = [int(x) for x in args.draft_loops.split(",")] if args.draft_loops else list(range(1, k))
    prompts = corpus_prompts(tok, args.batch, args.prompt)
    variants = {"plain": None, **{f"K_d={k_d}": Speculation(k_d) for k_d in k_ds},
                **{x: Speculation.parse(x) for x in args.settings.split(",") if x},
                "auto": Speculation()}
    # warm-up
    decode(model, prompts, argparse.Namespace(**{**vars(args), "new_tokens": 4}), None, clock)
    times = {name: [] for name in variants}
    last, auto_loss = {}, []
    for r in range(args.rounds):
        # order flipped every round
        for name, speculate in list(variants.items())[::1 if r % 2 == 0 else -1]:
            seconds, out, stats = decode(model, prompts, args, speculate, clock)
            times[name].append(seconds)
            last[name] = (out, stats)
            if name == "auto":
                auto_loss.append(stats.planner.loss)

    tokens = args.batch * args.new_tokens
    print(f"{args.checkpoint}: spec {model.config.spec} (K={k}), d_model {model.config.d_model}, "
          f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, temperature "
          f"{args.temperature}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"{args.rounds} rounds")
    for name in variants:
        rate = tokens / statistics.median(times[name])
        out, stats = last[name]
        same = ("" if args.temperature
                else ("  same tokens" if out == last["plain"][0] else "  DIFFERENT TOKENS"))
        extra = ("" if stats is None
                 else f"  acceptance {stats.acceptance:6.1%}  setting {stats.setting}")
        # round by round: drift cancels
        paired = sorted(p / t for p, t in zip(times["plain"], times[name]))
        spread = "" if name == "plain" else f"  (rounds {paired[0]:.2f}-{paired[-1]:.2f}x)"
        print(f"  {name:<8} {rate:8.1f} tokens/s  "
              f"{statistics.median(paired):5.2f}x{spread}{extra}{same}")
    from meshlm.generate.planner import LOSS_BUDGET

    plain_seconds = statistics.median(times["plain"])
    print(f"auto's own account: its rounds took {statistics.median(auto_loss) * 1e3:+.1f} ms "
          "(median) beyond what plain steps would have for their tokens, "
          f"{statistics.median(auto_loss) / plain_seconds:+.1%} of the plain decode (its budget: "
          f"{LOSS_BUDGET:.0%}; negative: the rounds gained)")
    cost_arithmetic(model, prompts, args, k_ds)
    agreement(model, tok, list(range(1, k)), args.loops)


if __name__ == "__main__":
    main()
