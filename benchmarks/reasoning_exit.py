"""Speed of adaptive exit against fixed depth on the reasoning suite, at the accuracy each reaches.

    python benchmarks/reasoning_exit.py RUN --exit state:0.1,state:0.3 --threads 1 --clock cpu \
        --rounds 7
    python benchmarks/reasoning_exit.py RUN --loops 16 --exit kl:0.001 --gather-below 0.5,0.9,1.01

For a run trained on task data: its test problems (--limit per task and difficulty, the trained
difficulties by default) are answered by greedy cached decoding at fixed depth (the trained K, or
--loops) and under each exit rule (at most as many loops). Every round times each setting once, in
an order that flips every round, so machine drift hits them alike; the ratios are the medians of the
round-by-round ratios of tokens/s (prompt and answer tokens processed) to fixed depth. Each
setting's accuracy and loops per answer token print beside its ratio: the issue's target reads "at
<= 1 point below fixed depth, >= 1.3x the tokens/s".

On labelled task data (meshlm.reasoning.cells) a setting is one full-sequence forward per batch of
test sequences (every position scored, none decoded), so the ratio is forward throughput with exit
against fixed depth; accuracy is per labelled position and "answer" loops are per labelled
position.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from benchkit import timing_setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import meshlm.model.exit as exit_module  # noqa: E402
from meshlm.data.tasks import read_test  # noqa: E402
from meshlm.evaluation.reasoning import (  # noqa: E402
    Positions,
    decode,
    loop_means,
    run_positions,
)
from meshlm.loading import open_model  # noqa: E402
from meshlm.model.exit import ExitRule  # noqa: E402
from meshlm.reasoning import (
    TASKS,  # noqa: E402
    parse_levels,  # noqa: E402
)


def chosen_problems(loaded, limit: int, beyond: bool) -> list[dict]:
    data = loaded.data_dir()
    levels = loaded.held_out().manifest["task"]["levels"]
    taken: dict = {}
    out = []
    for p in read_test(data):
        train = parse_levels(levels[p["task"]]["train"], TASKS[p["task"]])
        if (p["difficulty"] in train) == beyond:
            continue
        key = (p["task"], p["difficulty"])
        if taken.setdefault(key, 0) < limit:
            taken[key] += 1
            out.append(p)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--exit", default="state:0.1", help="comma-separated exit rules")
    p.add_argument("--loops", type=int, default=None,
                   help="fixed depth to compare with (default: trained K)")
    p.add_argument("--limit", type=int, default=50, help="problems per task and difficulty")
    p.add_argument("--beyond", action="store_true",
                   help="the difficulties beyond the training range instead")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gather-below", default="",
                   help="comma-separated values of meshlm.model.exit.GATHER_BELOW to run each "
                        "exit rule at (gather below that fraction of tokens active; > 1: always)")
    args = p.parse_args()
    clock = timing_setup(args)
    loaded = open_model(args.run)
    model, tok = loaded.model, loaded.tokenizer
    problems = chosen_problems(loaded, args.limit, args.beyond)
    k = args.loops or model.config.layout.n_steps
    thresholds = [float(g) for g in args.gather_below.split(",") if g] or [exit_module.GATHER_BELOW]
    settings = {"fixed": (None, exit_module.GATHER_BELOW),
                **{rule + (f"@{g:g}" if args.gather_below else ""): (ExitRule.parse(rule), g)
                   for rule in args.exit.split(",") if rule for g in thresholds}}
    labelled = "text" in problems[0]
    if labelled:
        positions = Positions.of(tok, problems)
        tokens = positions.x.numel()
    else:
        tokens = sum(len(tok.encode(q["prompt"])) + len(tok.encode(q["answer"])) + 1
                     for q in problems)

    def measure(setting) -> tuple[float, float, float]:
        """accuracy, loops per token, loops per answer token (labelled: per labelled position)."""
        rule, exit_module.GATHER_BELOW = setting
        if labelled:
            right, steps = run_positions(model, positions, k, rule, args.batch_size)
            scored = positions.scored
            return (right[scored].float().mean().item(),
                    *((float(steps.float().mean()), float(steps[scored].float().mean()))
                      if steps is not None else (k, k)))
        answers = decode(model, tok, problems, loops=k, exit=rule, batch_size=args.batch_size)
        means = loop_means(problems, list(range(len(problems))), answers)
        return (sum(a.correct for a in answers) / len(answers),
                *((means["avg_loops"], means["answer_loops"]) if rule else (k, k)))

    times: dict[str, list[float]] = {name: [] for name in settings}
    accuracy, loops = {}, {}
    with torch.no_grad():
        for r in range(args.rounds + 1):  # round 0 warms up and measures accuracy
            names = list(settings) if r % 2 else list(reversed(settings))
            for name in names:
                start = clock()
                acc, every, answer = measure(settings[name])
                elapsed = clock() - start
                if r == 0:
                    accuracy[name], loops[name] = acc, (every, answer)
                else:
                    times[name].append(elapsed)
    print(f"{args.run}: {len(problems)} problems ({'beyond' if args.beyond else 'inside'} the "
          f"training range), {tokens:,} tokens, fixed depth {k}, batch {args.batch_size}, "
          f"{args.rounds} rounds, {args.clock} clock")
    for name in settings:
        ratios = [f / t for f, t in zip(times["fixed"], times[name])]
        every, answer = loops[name]
        print(f"  {name:<18} acc {100 * accuracy[name]:5.1f}%  loops/token {every:.2f} "
              f"({100 * every / k:.0f}% of {k}; answer tokens {answer:.2f})  tokens/s "
              f"{tokens / statistics.median(times[name]):7.0f}  x{statistics.median(ratios):.3f} "
              f"vs fixed (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
