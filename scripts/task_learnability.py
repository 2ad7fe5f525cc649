"""How many problems does a reasoning task need before a model of this size learns it?

    python scripts/task_learnability.py --task chase --train-difficulty 1-1 --steps 1500
    python scripts/task_learnability.py --task chase \
        --task-option chase.statements=6,chase.distractors=1 \
        --train-difficulty 1-3 --curriculum 200

A quick check before sizing a study (docs/reasoning.md): it trains a MeshLM on fresh problems drawn
every step (no prepared data, so no epochs), with the answer-only loss that task data turns on
(meshlm.data.tasks: the answer's tokens and its EOS), and prints answer accuracy per test difficulty
× loop count, teacher-forced (every answer token's argmax right, EOS included). `--curriculum N`
opens the training range one difficulty every N steps, starting from its lowest. The optimizer and
schedule are the trainer's (meshlm.train.optim), one thread, fp32.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from meshlm.config import ModelConfig
from meshlm.model import MeshLM
from meshlm.reasoning import Task, parse_levels, parse_tasks
from meshlm.reasoning.vocab import build_tokenizer
from meshlm.train.config import TrainConfig
from meshlm.train.optim import build_optimizer, build_scheduler

IGNORE = -100


def encode_batch(tok, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) inputs `prompt answer EOS` right-padded, and targets that are IGNORE except at the
    answer."""
    eos, pad = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|padding|>")
    rows = [(tok.encode(p.prompt).ids, tok.encode(p.answer).ids + [eos]) for p in problems]
    width = max(len(q) + len(a) for q, a in rows)
    x = torch.full((len(rows), width), pad)
    y = torch.full((len(rows), width), IGNORE)
    for i, (q, a) in enumerate(rows):
        x[i, :len(q) + len(a)] = torch.tensor(q + a)
        y[i, len(q) - 1:len(q) + len(a) - 1] = torch.tensor(a)  # position t predicts token t + 1
    return x, y


def train(args, task: Task, tok, model: MeshLM) -> None:
    levels = parse_levels(args.train_difficulty or task.train_levels, task, "training difficulty")
    cfg = TrainConfig(lr=args.lr)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, cfg, args.steps)
    rng, start, smooth = random.Random(args.seed), time.time(), None
    for step in range(args.steps):
        top = (min(levels[-1], levels[0] + step // args.curriculum) if args.curriculum
               else levels[-1])
        x, y = encode_batch(tok, [task.sample(rng, rng.randint(levels[0], top))
                                  for _ in range(args.batch)])
        loss = model(x, targets=y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  difficulty <= {top}  answer loss {smooth:.3f}  "
                  f"{time.time() - start:.0f} s",
                  flush=True)


@torch.no_grad()
def accuracy(task: Task, tok, model: MeshLM, level: int, loops: int, n: int) -> float:
    rng = random.Random(f"test:{level}")  # the same problems at every loop count
    x, y = encode_batch(tok, [task.sample(rng, level) for _ in range(n)])
    right = (model(x, loops=loops).logits.argmax(-1) == y) | (y == IGNORE)
    return right.all(1).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="chase")
    p.add_argument("--task-option", default="", help="generator knobs, e.g. chase.statements=8")
    p.add_argument("--train-difficulty", default="",
                   help="LO-HI (default: the task's training range)")
    p.add_argument("--curriculum", type=int, default=0,
                   help="steps per opened difficulty (0: all at once)")
    p.add_argument("--spec", default="1+1R4+1")
    p.add_argument("--scheme", default="base")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rotary-pct", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--loops", default="1,2,4,8,12", help="loop counts to evaluate at")
    p.add_argument("--per-level", type=int, default=200, help="test problems per difficulty")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    task = parse_tasks(args.task, args.task_option)[0]
    tok = build_tokenizer(task.alphabet)
    model = MeshLM(ModelConfig(spec=args.spec, scheme=args.scheme, d_model=args.d_model,
                               n_heads=args.heads,
                               rotary_pct=args.rotary_pct, vocab_size=tok.get_vocab_size(),
                               context_length=256))
    train(args, task, tok, model)
    model.eval()
    levels = list(task.test_levels)
    table = {loops: [round(100 * accuracy(task, tok, model, lv, loops, args.per_level), 1)
                     for lv in levels]
             for loops in map(int, args.loops.split(","))}
    print("difficulty      " + " ".join(f"{lv:5d}" for lv in levels))
    for loops, row in table.items():
        print(f"{loops:2d} loops, acc %" + " ".join(f"{a:5.1f}" for a in row))
    print(json.dumps({"args": vars(args), "levels": levels, "accuracy": table}))


if __name__ == "__main__":
    main()
