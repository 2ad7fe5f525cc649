"""The reasoning suite: synthetic tasks where more loops buy accuracy (docs/reasoning.md).

    TASKS["chase"].sample(random.Random(0), 3)   -> Problem(prompt, answer, difficulty)
    parse_tasks("chase,dag")                     -> [Chase(), Dag()]
    parse_levels("1-8", task)                    -> range(1, 9), checked against what the task
                                                 supports

A new task is one Task subclass in meshlm.reasoning.tasks plus its line in TASKS. Nothing here
imports torch: the generators are plain Python, deterministic under a seed (meshlm.data.tasks writes
them as training data, meshlm.evaluation.reasoning scores a model on them).
"""
from __future__ import annotations

import inspect
import re

from meshlm.errors import ConfigError
from meshlm.reasoning.cells import AddMod, Chain, Compose, DagMod, Parity, Sequence
from meshlm.reasoning.tasks import Addition, Chase, Dag, ModSum, Problem, Task

TASKS: dict[str, Task] = {task.name: task for task in (Chain(), Parity(), Compose(), AddMod(),
                                                       DagMod(), Chase(), ModSum(), Addition(),
                                                       Dag())}

__all__ = ["TASKS", "Problem", "Sequence", "Task", "parse_levels", "parse_tasks", "range_text"]


def parse_tasks(text: str, options: str = "") -> list[Task]:
    """"chase" or "chase,dag" -> the tasks, in that order, each built with its `options`
    ("chase.statements=8, chase.distractors=3": a generator's size knobs); ConfigError naming what
    is valid otherwise."""
    names = [n.strip().lower() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ConfigError(f"unknown reasoning task {', '.join(unknown) or repr(text)}; use one or "
                          f"more of {', '.join(TASKS)}, comma-separated (e.g. task:chase or "
                          "task:chase,dag)")
    if len(set(names)) != len(names):
        raise ConfigError(f"reasoning tasks {text!r} name a task twice; list each once")
    given = parse_options(options, names)
    return [_build(name, given.get(name, {})) for name in names]


def parse_options(text: str, names: list[str]) -> dict[str, dict[str, int]]:
    """"chase.statements=8,chase.distractors=3" -> {"chase": {"statements": 8, "distractors":
    3}}."""
    out: dict[str, dict[str, int]] = {}
    for item in (i.strip() for i in str(text or "").split(",") if i.strip()):
        m = re.fullmatch(r"([a-z]+)\.([a-z_]+)=(\d+)", item)
        if not m or m.group(1) not in names:
            raise ConfigError(f"task option {item!r} is not TASK.KNOB=N for a task given "
                              f"({', '.join(names)}), e.g. chase.statements=8")
        out.setdefault(m.group(1), {})[m.group(2)] = int(m.group(3))
    return out


def _build(name: str, knobs: dict[str, int]) -> Task:
    if not knobs:
        return TASKS[name]
    cls = type(TASKS[name])
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    wrong = sorted(set(knobs) - set(accepted))
    if wrong:
        raise ConfigError(f"task {name} has no option {', '.join(wrong)}; its options: "
                          f"{', '.join(accepted) or 'none'}")
    try:
        return cls(**knobs)
    except ValueError as err:
        raise ConfigError(f"task {name} with {knobs}: {err}") from None


def range_text(levels: range) -> str:
    return f"{levels.start}-{levels.stop - 1}"


def parse_levels(text: str | range, task: Task, what: str = "difficulty") -> range:
    """"3" or "1-8" -> range(1, 9), inside the task's supported levels (one-line ConfigError
    otherwise)."""
    if isinstance(text, range):
        levels = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(text))
        if not m:
            raise ConfigError(f"{what} {text!r} is not N or LO-HI (e.g. 1-8)")
        low, high = int(m.group(1)), int(m.group(2) or m.group(1))
        levels = range(low, high + 1)
    if not levels or levels.start < task.levels.start or levels.stop > task.levels.stop:
        raise ConfigError(f"{what} {range_text(levels) if levels else text!r} is outside what task "
                          f"{task.name} makes ({range_text(task.levels)}); pass a range inside it")
    return levels
