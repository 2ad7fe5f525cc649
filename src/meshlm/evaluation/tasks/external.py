"""Any lm-eval task beside the paper's suite, run as lm-eval defines it: a task or group name that
lm-eval's TaskManager knows (its ~15k registered YAMLs, meshlm's shipped tasks such as
`meshlm_recite` (meshlm.evaluation.tasks.recite), and the folders given with --include-path), or a
task YAML file. Generative (`generate_until`) tasks are decoded by meshlm's cached decoding
(meshlm.evaluation.harness).

    meshlm eval CKPT --tasks gsm8k,piqa                       # a registered lm-eval task beside a
                                                                suite task
    meshlm eval CKPT --tasks my_task.yaml                     # a task file (its `include:` resolved
                                                                by lm-eval)
    meshlm eval CKPT --tasks my_task --include-path tasks/    # a folder of task YAMLs, as lm_eval
                                                                --include_path

Names are checked against the TaskManager's index before the model is loaded (indexing all of
lm-eval's tasks takes 10-20 s, so it happens only when a name outside the suite is asked for); an
unknown one is a one-line error with the nearest names. Scores are lm-eval's own metrics, each with
its standard error; they do not enter the paper's average.
"""
from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any

from meshlm.errors import ConfigError
from meshlm.evaluation.tasks import SUITE, recite

YAML_SUFFIXES = (".yaml", ".yml")


def is_task_file(ref: str) -> bool:
    return Path(ref).suffix in YAML_SUFFIXES


@functools.lru_cache(maxsize=4)
def task_manager(include_path: tuple[str, ...] = (), defaults: bool = True):
    """lm-eval's TaskManager over its own tasks (`defaults`) and the `include_path` folders
    (cached)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=defaults, include_path=list(include_path) or None)


def task_configs(refs: list[str], include_path: list[str] | tuple[str, ...] = ()) -> tuple[list,
                                                                                           Any]:
    """(the tasks for lm_eval.simple_evaluate: names and loaded YAML configs, the TaskManager that
    knows them); ConfigError for a missing file, a missing --include-path folder or an unknown
    name."""
    from lm_eval.tasks._yaml_loader import load_yaml  # what lm_eval run --tasks FILE.yaml uses

    for folder in include_path:
        if not Path(folder).expanduser().is_dir():
            raise ConfigError(f"--include-path {folder} is not a folder; pass a folder of lm-eval "
                              "task YAMLs")
    tasks: list = []
    for ref in refs:
        if is_task_file(ref):
            path = Path(ref).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"task file {ref} does not exist; pass an lm-eval task YAML or a "
                                  "task name")
            tasks.append(load_yaml(path, resolve_func=True))
        else:
            tasks.append(ref)
    names = [t for t in tasks if isinstance(t, str)]
    folders = (str(recite.FOLDER), *(str(Path(p).expanduser().resolve()) for p in include_path))
    # meshlm's own tasks: no need to index lm-eval's
    shipped = {p.stem for p in recite.FOLDER.glob("*.yaml")}
    manager = task_manager(folders, defaults=bool(set(names) - shipped))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        known = ["all", *SUITE, *manager.all_tasks]
        near = list(dict.fromkeys(m for n in unknown
                                  for m in difflib.get_close_matches(n, known, n=3)))
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ConfigError(f"unknown task(s) {unknown}{hint}; choose from meshlm's suite (all, "
                          f"{', '.join(SUITE)}) or lm-eval's {len(manager.all_tasks):,} "
                          f"tasks{' and --include-path' if include_path else ''} (`lm_eval ls "
                          "tasks` lists them), or pass a task YAML")
    return tasks, manager


def _primary(values: dict[str, Any], config: dict[str, Any]) -> tuple[str, str]:
    """(metric, filter) that the task lists first: its first metric under its first filter with a
    value."""
    listed = [m["metric"] for m in config.get("metric_list")
              or [] if isinstance(m.get("metric"), str)]
    found = [key.split(",", 1) for key in values if "," in key and "_stderr" not in key]
    for metric in listed + [m for m, _ in found]:
        for name, flt in found:
            if name == metric:
                return name, flt
    raise ConfigError(f"lm-eval reported no metric for task {config.get('task')!r}")


def summarise(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task lm-eval ran (groups excluded): its first listed metric as `score` with `stderr`,
    the item count, and every metric it reported ("metric,filter" -> value)."""
    out = {}
    for name, config in raw["configs"].items():
        values = raw["results"].get(name)
        if values is None:
            continue
        metric, flt = _primary(values, config)
        stderr = values.get(f"{metric}_stderr,{flt}")
        score = float(values[f"{metric},{flt}"])
        out[name] = {"metric": metric if flt == "none" else f"{metric} ({flt})", "score": score,
                     "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                     "items": int(raw.get("n-samples", {}).get(name, {}).get("effective", 0)),
                     "output_type": config.get("output_type"), "external": True,
                     "metrics": {k: float(v) for k, v in values.items()
                                 if "," in k and isinstance(v, (int, float))}}
    return out
