"""Exact-match accuracy on the reasoning suite (meshlm.reasoning), by difficulty × loop count and
under exit.

Every answer comes from greedy cached decoding (meshlm.generate), prompts batched with left padding
(each row decodes as it would alone). A problem counts as solved when the generated tokens are
exactly the answer's followed by EOS: a missing EOS, an early EOS or an extra token is wrong.
Accuracy per difficulty comes with its binomial standard error sqrt(p(1 − p)/n).

Under adaptive exit (meshlm.model.exit) each problem also records the loop steps its tokens ran:
`avg_loops` over every token processed (prompt and answer), `answer_loops` over the positions that
produced an answer token (the last prompt position, then each generated one up to EOS): where the
depth is spent on the answer. The Spearman rank correlation of a problem's answer loops with its
difficulty says whether exit spends more depth on harder problems.

The result is eval.json's "reasoning" section; its schema is meshlm.evaluation.results.Reasoning
(tasks by name, each with a row per loop count and per exit rule, accuracy by difficulty in each).
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from meshlm.data.tasks import encode_labelled, stack
from meshlm.data.tokenizer import TextTokenizer
from meshlm.errors import ConfigError
from meshlm.evaluation.perplexity import is_looped
from meshlm.generate import Sampling, generate
from meshlm.model.exit import ExitRule
from meshlm.reasoning import Sequence


@dataclass
class Answer:
    """One decoded problem: solved or not, and (under exit) the loop steps its tokens ran."""

    correct: bool
    prompt_loops: int = 0  # summed over the prompt's tokens
    answer_loops: list[int] = field(default_factory=list)  # per position that produced an answer
    # token


def binomial(correct: list[bool]) -> dict:
    """Exact-match rate, its binomial standard error sqrt(p(1 − p)/n), and n (never empty: levels
    come from the problems)."""
    n = len(correct)
    p = sum(correct) / n
    return {"acc": p, "stderr": math.sqrt(p * (1 - p) / n), "n": n}


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when either side is constant."""
    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # ties share their mean rank
            r[v == value] = r[v == value].mean()
        return r

    if len(x) < 2:
        return None
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


class LoopRecorder:
    """`observe` for meshlm.generate: per row, the exit loop steps of the prompt and of each decode
    step."""

    def __init__(self):
        self.prompt: torch.Tensor | None = None  # (B,) loops summed over real prompt positions
        # (B,) loops of the position that produced answer token j
        self.steps: list[torch.Tensor] = []

    def __call__(self, out, mask: torch.Tensor) -> None:
        if out.exit_loops is None:
            return
        if self.prompt is None:  # the prefill: padding positions count nothing
            self.prompt = (out.exit_loops * mask).sum(-1)
        self.steps.append(out.exit_loops[:, -1])  # the position that predicts the next answer token


def decode(model, tok: TextTokenizer, problems: list[dict], loops: int | None = None,
           exit: str | None = None,
           batch_size: int = 64) -> list[Answer]:
    """Greedy answers to `problems` ({"prompt", "answer"}), in order."""
    # similar lengths together
    order = sorted(range(len(problems)), key=lambda i: len(problems[i]["prompt"]))
    result: dict[int, Answer] = {}
    for start in range(0, len(order), batch_size):
        chunk = [problems[i] for i in order[start:start + batch_size]]
        prompts = [tok.encode(p["prompt"]) for p in chunk]
        wanted = [tok.encode(p["answer"]) + [tok.eos_id] for p in chunk]
        recorder = LoopRecorder()
        s = Sampling(max_new_tokens=max(map(len, wanted)), temperature=0)
        outs = generate(model, prompts, s, tok.eos_id, tok.pad_id, loops=loops, exit=exit,
                        observe=recorder)
        for row, (i, got, want) in enumerate(zip(order[start:start + batch_size], outs, wanted)):
            answer = Answer(got == want)
            if recorder.prompt is not None:
                answer.prompt_loops = int(recorder.prompt[row])
                answer.answer_loops = [int(step[row]) for step in recorder.steps[:len(got)]]
            result[i] = answer
    return [result[i] for i in range(len(problems))]


def check_fits(model, tok: TextTokenizer, problems: list[dict]) -> None:
    longest = max(len(tok.encode(p["text"])) if "text" in p else
                  len(tok.encode(p["prompt"])) + len(tok.encode(p["answer"])) + 1
                  for p in problems)
    if longest > model.config.context_length:
        raise ConfigError(f"the longest test problem needs {longest} tokens but the model's "
                          f"context_length is {model.config.context_length}; evaluate on --data "
                          "prepared with a lower --test-difficulty, or train with "
                          f"model.context_length={longest}")


def depth_sweep(trained: int) -> list[int]:
    """1 … 4× the trained loop count K: every count up to 2K, then 3K and 4K."""
    return sorted({*range(1, 2 * trained + 1), 3 * trained, 4 * trained})


def by_level(problems: list[dict], answers: list[Answer], with_loops: bool) -> dict[str, dict]:
    """{difficulty: accuracy (and, with_loops, the loop means)} over the problems of each
    difficulty."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(problems):
        groups[p["difficulty"]].append(i)
    out = {}
    for level in sorted(groups):
        chosen = [answers[i] for i in groups[level]]
        row = binomial([a.correct for a in chosen])
        if with_loops:
            row.update(loop_means(problems, groups[level], chosen))
        out[str(level)] = row
    return out


def loop_means(problems: list[dict], indices: list[int], chosen: list[Answer]) -> dict:
    """Loop steps per token over prompts and answers (one character is one token), and per answer
    token."""
    # positions processed: the prompt's (prefill), then each fed answer token; answer_loops[0] is
    # the last prompt position's (it predicts answer token 0), already in prompt_loops
    tokens = sum(len(problems[i]["prompt"]) + len(a.answer_loops[1:])
                 for i, a in zip(indices, chosen))
    loops = sum(a.prompt_loops + sum(a.answer_loops[1:]) for a in chosen)
    answer_steps = [step for a in chosen for step in a.answer_loops]
    return {"avg_loops": loops / max(tokens, 1),
            "answer_loops": float(np.mean(answer_steps)) if answer_steps
            else None}


@dataclass
class Positions:
    """Labelled sequences (test.jsonl records with "text", "labels", "depths") as tensors: inputs
    (B, T), the target of each position and its difficulty (-1 / IGNORE where there is none)."""

    x: torch.Tensor
    y: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def of(cls, tok: TextTokenizer, records: list[dict]) -> Positions:
        rows = [encode_labelled(tok, Sequence(r["text"], tuple(r["labels"]), tuple(r["depths"]),
                                              r["difficulty"])) for r in records]
        return cls(*map(torch.as_tensor, stack(rows, tok.pad_id)))

    @property
    def scored(self) -> torch.Tensor:
        return self.depth >= 0


def run_positions(model, data: Positions, loops: int | None, exit: ExitRule | None,
                  batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every position's argmax == its target (B, T), and under exit the loop steps each position
    ran (B, T), from full-sequence forwards in batches (one forward a batch: labels are never
    fed back)."""
    right, steps = [], []
    for start in range(0, len(data.x), batch_size):
        x = data.x[start:start + batch_size]
        out = model(x, loops=loops, exit=exit)
        right.append(out.logits.argmax(-1) == data.y[start:start + batch_size])
        if out.exit_loops is not None:
            steps.append(out.exit_loops)
    return torch.cat(right), (torch.cat(steps) if steps else None)


def position_levels(data: Positions, right: torch.Tensor,
                    steps: torch.Tensor | None = None) -> dict[str, dict]:
    """{difficulty: accuracy over the positions of that difficulty (and, with `steps`, their mean
    loop steps)}."""
    out = {}
    for level in sorted(data.depth[data.scored].unique().tolist()):
        chosen = data.depth == level
        row = binomial(right[chosen].tolist())
        if steps is not None:
            row["avg_loops"] = row["answer_loops"] = float(steps[chosen].float().mean())
        out[str(level)] = row
    return out


def evaluate_positions(model, tok: TextTokenizer, records: list[dict], loop_counts: list[int],
                       exits: list[ExitRule], exit_loops: int | None, train_levels: str | None,
                       batch_size: int = 64, log: Callable[[str], None] = print) -> dict:
    """One labelled task's table: accuracy per position by its difficulty at each loop count; the
    stability of the positions within the trained depth when run past it; and under each exit rule
    the accuracy, the loop steps per position (all positions, and by difficulty) and the Spearman
    correlation of a labelled position's loop steps with its difficulty."""
    check_fits(model, tok, records)
    data = Positions.of(tok, records)
    trained, looped = model.config.layout.n_steps, is_looped(model)
    if not looped:
        loop_counts, exits = [trained], []
    out: dict = {"trained_loops": trained, "unit": "position", "loops": [], "exit": []}
    shallow = data.scored & (data.depth <= min(trained, _top(train_levels) or trained))
    stability = {}
    for k in loop_counts:
        right, _ = run_positions(model, data, k if looped else None, None, batch_size)
        row = {"loops": k, **binomial(right[data.scored].tolist()),
               "levels": position_levels(data, right)}
        out["loops"].append(row)
        if shallow.any():
            stability[str(k)] = binomial(right[shallow].tolist())
        log(f"    loops={k}: acc {100 * row['acc']:.1f}%  " + " ".join(
            f"{d}:{100 * v['acc']:.0f}" for d, v in row["levels"].items()))
    if looped:
        out["stability"] = stability
    max_loops = exit_loops or trained
    for rule in exits:
        right, steps = run_positions(model, data, max_loops, rule, batch_size)
        scored = steps[data.scored].float()
        row = {"exit": str(rule), "max_loops": max_loops, **binomial(right[data.scored].tolist()),
               "avg_loops": float(steps.float().mean()), "answer_loops": float(scored.mean()),
               "spearman": spearman(data.depth[data.scored].tolist(), scored.tolist()),
               "levels": position_levels(data, right, steps)}
        out["exit"].append(row)
        rho = "undefined (constant loops)" if row["spearman"] is None else f"{row['spearman']:.2f}"
        log(f"    exit {rule} (<= {max_loops} loops): acc {100 * row['acc']:.1f}%, loops per "
            f"position {row['answer_loops']:.2f}, Spearman vs difficulty {rho}")
    return out


def _top(levels: str | None) -> int | None:
    """"1-4" -> 4."""
    return int(str(levels).rpartition("-")[2]) if levels else None


def evaluate_task(model, tok: TextTokenizer, problems: list[dict], loop_counts: list[int],
                  exits: list[ExitRule],
                  exit_loops: int | None, batch_size: int = 64,
                  log: Callable[[str], None] = print) -> dict:
    """One task's accuracy table: by difficulty at each loop count, and under each exit rule."""
    check_fits(model, tok, problems)
    trained, looped = model.config.layout.n_steps, is_looped(model)
    if not looped:  # vanilla: its one depth, no exit (there is no loop to leave)
        loop_counts, exits = [trained], []
    out: dict = {"trained_loops": trained, "loops": [], "exit": []}
    for k in loop_counts:
        answers = decode(model, tok, problems, loops=k if looped else None, batch_size=batch_size)
        row = {"loops": k, **binomial([a.correct for a in answers]),
               "levels": by_level(problems, answers, False)}
        out["loops"].append(row)
        log(f"    loops={k}: acc {100 * row['acc']:.1f}%  " + " ".join(
            f"{d}:{100 * v['acc']:.0f}" for d, v in row["levels"].items()))
    max_loops = exit_loops or trained
    for rule in exits:
        answers = decode(model, tok, problems, loops=max_loops, exit=rule, batch_size=batch_size)
        row = {"exit": str(rule), "max_loops": max_loops,
               **binomial([a.correct for a in answers]),
               **loop_means(problems, list(range(len(problems))), answers),
               "spearman": spearman([p["difficulty"] for p in problems],
                                    [float(np.mean(a.answer_loops)) for a in answers]),
               "levels": by_level(problems, answers, True)}
        out["exit"].append(row)
        rho = "undefined (constant loops)" if row["spearman"] is None else f"{row['spearman']:.2f}"
        log(f"    exit {rule} (<= {max_loops} loops): acc {100 * row['acc']:.1f}%, loops/token "
            f"{row['avg_loops']:.2f}, answer loops {row['answer_loops']:.2f}, Spearman vs "
            f"difficulty {rho}")
    return out


@torch.no_grad()
def evaluate_reasoning(model, tok: TextTokenizer, problems: list[dict],
                       task_levels: dict[str, dict],
                       loop_counts: list[int] | None = None, exits: list[ExitRule] = (),
                       exit_loops: int | None = None,
                       limit: int | None = None, batch_size: int = 64,
                       log: Callable[[str], None] = print) -> dict:
    """Every task in `problems` (test.jsonl records), at most `limit` problems per task and
    difficulty."""
    start = time.perf_counter()
    counts = loop_counts if loop_counts is not None else depth_sweep(model.config.layout.n_steps)
    tasks: dict[str, list[dict]] = defaultdict(list)
    taken: dict[tuple[str, int], int] = defaultdict(int)
    for p in problems:
        key = (p["task"], p["difficulty"])
        if limit is None or taken[key] < limit:
            taken[key] += 1
            tasks[p["task"]].append(p)
    result = {"tasks": {}}
    for name, chosen in tasks.items():
        log(f"  {name}: {len(chosen)} problems")
        levels = task_levels.get(name, {})
        if "text" in chosen[0]:  # labelled: every position scored
            table = evaluate_positions(model, tok, chosen, counts,
                                       list(exits), exit_loops,
                                       levels.get("train"), batch_size, log)
        else:
            table = evaluate_task(model, tok, chosen, counts, list(exits), exit_loops,
                                  batch_size, log)
        result["tasks"][name] = {"train_levels": levels.get("train"),
                                 "test_levels": levels.get("test"), **table}
    result["seconds"] = time.perf_counter() - start
    return result
