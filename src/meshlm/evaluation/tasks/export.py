"""The suite as lm-eval task YAMLs, so lm-eval's own CLI runs it offline on an exported Hugging Face
folder:

    meshlm tasks export DIR            # or `meshlm fetch`, which writes <cache>/lm-eval-tasks
    lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True --include_path DIR \
        --tasks meshlm_suite --num_fewshot 0 --seed 1234

Each YAML is one task of meshlm's suite exactly as `meshlm eval` builds it
(meshlm.evaluation.tasks.task_specs): lm-eval's own YAML for the task, its includes merged in
(prompt, choices, metrics), with only the data source, `dataset_path: json` with absolute
`data_files`, and the splits overridden. Its `!function` helpers are named as modules of the
installed lm-eval (`!function lm_eval.tasks.hellaswag.utils.process_docs`), so the file names no
path inside the environment that wrote it: removing that venv, or running lm_eval from another one,
leaves it working. Names get a `meshlm_` prefix so they never shadow lm-eval's Hub-backed tasks; the
tag lm-eval's YAML carries is replaced for the same reason. Groups: `meshlm_mmlu` (the 57 cloze
subjects, size-weighted like `meshlm eval`'s MMLU) and `meshlm_suite` (every task; no aggregate,
since the paper's average mixes acc and acc_norm: `meshlm eval` computes it).

Data paths are absolute because lm-eval resolves relative `data_files` against the working
directory; moving the folder (or upgrading lm-eval, whose task definitions are copied) means
exporting again.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from meshlm import atomic
from meshlm.data.cache_dir import cache_dir as resolve_cache
from meshlm.evaluation.tasks import MMLU_GROUP, SUITE_GROUP, Task, member_specs, task_manager

PREFIX = "meshlm_"
TAG = "meshlm_tasks"


def exported_name(harness: str) -> str:
    """lm-eval task name -> the exported one: piqa -> meshlm_piqa, mmlu_anatomy_continuation ->
    meshlm_mmlu_anatomy."""
    return PREFIX + harness.removesuffix("_continuation")


def _copy_data(spec: dict, data_dir: Path) -> dict:
    """Copy a member's data files under data_dir/<task>/ and point the member at the copies."""
    # lm-eval's own data (LAMBADA-standard from the HF datasets cache)
    if "dataset_kwargs" not in spec:
        return spec
    files = spec["dataset_kwargs"]["data_files"]
    target = data_dir / exported_name(spec["task"])
    target.mkdir(parents=True, exist_ok=True)
    copies = {}
    for split, path in files.items():
        copies[split] = str((target / Path(path).name).resolve())
        shutil.copyfile(path, copies[split])
    return {**spec, "dataset_kwargs": {**spec["dataset_kwargs"], "data_files": copies}}


class _Function(str):
    """A `!function` reference by importable name, written back with its tag."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Function,
                        lambda dumper, ref: dumper.represent_scalar("!function", str(ref)))


def _importable(value, root: Path):
    """Every `!function` of a loaded lm-eval YAML (a path under lm-eval's task folder `root`, as
    lm-eval's loader leaves it unresolved) as the dotted name of the installed module:
    lm_eval.tasks.<folder>.<module>.<fn>."""
    if isinstance(value, dict):
        return {key: _importable(v, root) for key, v in value.items()}
    if isinstance(value, list):
        return [_importable(v, root) for v in value]
    if isinstance(value, str) and value.startswith(f"{root}{os.sep}"):
        module, _, function = value.rpartition(".")
        return _Function(".".join(("lm_eval", "tasks", *Path(module).relative_to(root).parts,
                                   function)))
    return value


def _task_yaml(spec: dict, source: Path) -> dict:
    """lm-eval's YAML for the task (includes merged) with meshlm's overrides on top, as `include:`
    would."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    root = Path(lm_eval.tasks.__file__).resolve().parent
    own = _importable(load_yaml(Path(source).resolve(), resolve_func=False, recursive=True), root)
    return {**own, **spec, "task": exported_name(spec["task"]), "tag": [TAG]}


def _write(path: Path, config: dict) -> None:
    atomic.write_text(path, yaml.dump(config, Dumper=_Dumper, sort_keys=False, allow_unicode=True))


def export_tasks(out: str | Path, tasks: list[Task], cache_dir: str | os.PathLike | None = None,
                 copy_data: bool = True) -> list[str]:
    """Write one YAML per task (and the two groups) into `out`; with copy_data, the data go to
    out/data/.

    Returns the names of the top-level entries (tasks and the MMLU group) that `meshlm_suite`
    holds."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    index = task_manager(tasks).task_index  # lm-eval's own YAMLs: name -> Entry(yaml_path, …)
    top: list[str] = []
    for task, members in member_specs(tasks, cache_dir):
        names = []
        for spec in members:
            if copy_data:
                spec = _copy_data(spec, out / "data")
            config = _task_yaml(spec, index[spec["task"]].yaml_path)
            _write(out / f"{config['task']}.yaml", config)
            names.append(config["task"])
        if task.name == "mmlu":
            group = PREFIX + MMLU_GROUP
            _write(out / f"{group}.yaml",
                   {"group": group, "task": names, "metadata": {"version": 1.0},
                    "aggregate_metric_list": [{"metric": "acc",
                                               "weight_by_size": True}]})
            names = [group]
        top += names
    _write(out / f"{SUITE_GROUP}.yaml",
           {"group": SUITE_GROUP, "task": top, "metadata": {"version": 1.0}})
    return top


def usage(out: str | Path, names: list[str]) -> str:
    """What was written and the lm_eval command that uses it."""
    return (f"lm-eval tasks: {len(names)} in {Path(out).resolve()} (group {SUITE_GROUP}: "
            f"{', '.join(names)})\n  lm_eval --model hf --model_args "
            f"pretrained=HF_FOLDER,trust_remote_code=True --include_path {Path(out).resolve()} "
            f"--tasks {SUITE_GROUP} --num_fewshot 0 --seed 1234 --device cpu")


def cache_tasks_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return resolve_cache(cache_dir) / "lm-eval-tasks"
