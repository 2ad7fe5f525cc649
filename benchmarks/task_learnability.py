"""Does a tiny looped model learn a reasoning task at CPU budget, and do its loops buy accuracy?

    python benchmarks/task_learnability.py --task chain                   # ~2 min on one core
    python benchmarks/task_learnability.py --task dagmod --scheme mesh --train-loops uniform:2-6
    python benchmarks/task_learnability.py --task chase --train-difficulty 1-1   # answer-only

The check to run before sizing a study (docs/reasoning.md): it trains a MeshLM on fresh problems
drawn every step (no prepared data, so no epochs) with the trainer's optimizer and schedule
(meshlm.train.optim), fp32, one thread, and prints accuracy by difficulty × loop count on held-out
problems of the test range (`--per-level` of each). A labelled task (meshlm.reasoning.cells) takes
its loss and accuracy at every labelled position, each position with its own difficulty; an
answer-only task takes its loss at the answer's tokens and is scored per problem, teacher-forced
(every answer token right, EOS included). `--curriculum N` opens the training range one difficulty
every N steps, from its lowest. The last line is JSON. A task is learnable here when depth 1-2 is
above 90% at the trained loop count.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from meshlm.config import ModelConfig
from meshlm.data.tasks import IGNORE, encode_answer, encode_labelled, opened, stack
from meshlm.data.tokenizer import TextTokenizer
from meshlm.model import MeshLM
from meshlm.reasoning import Task, parse_levels, parse_tasks
from meshlm.reasoning.vocab import build_tokenizer
from meshlm.train.config import TrainConfig
from meshlm.train.depth import parse_loops
from meshlm.train.optim import build_optimizer, build_scheduler


def batch(task: Task, tok: TextTokenizer, rng: random.Random, levels: list[int], n: int):
    """(x, y, depth) tensors for n fresh problems, difficulties uniform over `levels`."""
    return tensors([encode(task, tok, task.sample(rng, rng.choice(levels))) for _ in range(n)],
                   tok)


def encode(task: Task, tok: TextTokenizer, problem):
    """A problem's (inputs, targets, difficulties): labelled, or the answer's tokens."""
    return (encode_labelled if getattr(task, "labelled", False) else encode_answer)(tok, problem)


def tensors(rows: list, tok: TextTokenizer) -> tuple[torch.Tensor, ...]:
    return tuple(map(torch.as_tensor, stack(rows, tok.pad_id)))


def train(args, task: Task, tok: TextTokenizer, model: MeshLM) -> float:
    levels = list(parse_levels(args.train_difficulty or task.train_levels, task,
                               "training difficulty"))
    cfg = TrainConfig(lr=args.lr)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, cfg, args.steps)
    loops = parse_loops(args.train_loops)
    rng, start, smooth = random.Random(args.seed), time.time(), None
    for step in range(args.steps):
        # a curriculum opens one difficulty every `curriculum` steps, from the lowest, as
        # train.curriculum does
        drawn = opened(levels, step, args.curriculum) if args.curriculum else levels
        x, y, _ = batch(task, tok, rng, drawn, args.batch)
        loss = model(x, targets=y, loops=loops.draw(args.seed, step)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {smooth:.3f}  {time.time() - start:.0f} s", flush=True)
    return time.time() - start


@torch.no_grad()
def accuracy_by_depth(model: MeshLM, x, y, depth, loops: int,
                      per_problem: bool) -> dict[int, float]:
    """% right by difficulty: per labelled position, or (`per_problem`, answer-only tasks) per
    problem, which is right when every answer token is (its EOS included)."""
    right = (model(x, loops=loops).logits.argmax(-1) == y) | (y == IGNORE)
    if per_problem:
        right, depth = right.all(1), depth.max(1).values
    return {int(d): round(100 * right[depth == d].float().mean().item(), 1)
            for d in depth.unique().tolist() if d >= 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="chain")
    p.add_argument("--task-option", default="", help="generator knobs, e.g. chain.cells=12")
    p.add_argument("--train-difficulty", default="", help="LO-HI (default: the task's range)")
    p.add_argument("--test-difficulty", default="", help="LO-HI (default: the task's range)")
    p.add_argument("--curriculum", type=int, default=0,
                   help="steps per opened training difficulty (0: all at once)")
    p.add_argument("--spec", default="1+1R4+1")
    p.add_argument("--scheme", default="base")
    p.add_argument("--train-loops", default="fixed", help="train.loops, e.g. uniform:2-6")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rotary-pct", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--loops", default="1,2,4,8,16", help="loop counts to evaluate at")
    p.add_argument("--per-level", type=int, default=100, help="test sequences per difficulty")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    task = parse_tasks(args.task, args.task_option)[0]
    tok = TextTokenizer(build_tokenizer(task.alphabet), "suite", "")
    model = MeshLM(ModelConfig(spec=args.spec, scheme=args.scheme, d_model=args.d_model,
                               n_heads=args.heads, rotary_pct=args.rotary_pct,
                               vocab_size=tok.vocab_size, context_length=256,
                               max_loops=parse_loops(args.train_loops).horizon(4)))
    seconds = train(args, task, tok, model)
    model.eval()
    tests = list(parse_levels(args.test_difficulty or task.test_levels, task, "test difficulty"))
    rng = random.Random(f"test:{args.seed}")
    x, y, depth = tensors([encode(task, tok, task.sample(rng, level))
                           for level in tests for _ in range(args.per_level)], tok)
    labelled = getattr(task, "labelled", False)
    table = {k: accuracy_by_depth(model, x, y, depth, k, not labelled)
             for k in map(int, args.loops.split(","))}
    levels = sorted({d for row in table.values() for d in row})
    print(f"accuracy % by difficulty ({args.task}, {args.scheme}, trained {args.train_loops}, "
          f"{args.steps} steps, {seconds:.0f} s)")
    print("difficulty      " + " ".join(f"{lv:5d}" for lv in levels))
    for k, row in table.items():
        print(f"{k:2d} loops        " + " ".join(f"{row.get(lv, float('nan')):5.1f}"
                                                   for lv in levels))
    print(json.dumps({"args": vars(args), "seconds": round(seconds), "accuracy": table}))


if __name__ == "__main__":
    main()
