"""Downstream accuracy through lm-evaluation-harness: the paper's suite, 0- and k-shot, and its
average.

`run_suite` builds the local task group (meshlm.evaluation.tasks), runs `lm_eval.simple_evaluate`
with the MeshLM adapter (meshlm.evaluation.harness) and returns, per task, acc and acc_norm (where
lm-eval defines it), the metric the paper reports, the item count and lm-eval's standard error, plus
the average of the paper metrics over the tasks run, as the fields of a Suite
(meshlm.evaluation.results: how eval.json holds it). Nothing here reaches the network: the package
switches the Hub off before lm-eval (and `datasets`) are imported, and the data are local JSON
files.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from typing import Any

from meshlm.errors import DataError
from meshlm.evaluation.tasks import (
    MMLU_GROUP,
    PAPER_TASKS,
    SUITE_GROUP,
    external,
    partition,
    resolve_tasks,
    task_manager,
    task_specs,
)

# only LAMBADA's perplexity is bootstrapped; accuracies have a closed-form stderr
BOOTSTRAP_ITERS = 1000


def run_suite(lm, task_names: str | list[str] | None = "all", shots: int = 0,
              limit: int | None = None,
              cache_dir: str | os.PathLike | None = None, log_samples: bool = False,
              seed: int = 1234, verbose: bool = False,
              include_path: list[str] | tuple[str, ...] = ()
              ) -> dict[str, Any]:
    """Evaluate `lm` (an lm_eval LM) at `shots` few-shot examples, `limit` items per task: the
    suite's tasks among `task_names`, then any other lm-eval task
    (meshlm.evaluation.tasks.external), each run as lm-eval defines it. Only the suite's tasks enter
    the paper average."""
    ours, others = partition(task_names)
    tasks = resolve_tasks(ours) if ours else []
    start = time.perf_counter()
    common = dict(num_fewshot=shots, limit=limit, bootstrap_iters=BOOTSTRAP_ITERS,
                  log_samples=log_samples,
                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                  fewshot_random_seed=seed)
    summary, samples = summarise([], []), {}
    with contextlib.nullcontext() if verbose else quiet():
        if tasks:
            raw = _evaluate(lm, task_specs(tasks, cache_dir), task_manager(tasks), common)
            summary, samples = summarise(raw, tasks), raw.get("samples", {})
        if others:
            raw = _external(lm, others, include_path, common)
            summary["tasks"].update(external.summarise(raw))
            summary["items"] += sum(t["items"] for t in external.summarise(raw).values())
            samples.update(raw.get("samples", {}))
    summary.update(shots=shots, limit=limit, seconds=time.perf_counter() - start)
    if log_samples:
        summary["samples"] = samples
    return summary


def _external(lm, refs: list[str], include_path, common: dict) -> dict:
    """lm-eval's own tasks; data on the Hub must already be in the local datasets cache (the Hub is
    off)."""
    try:
        return _evaluate(lm, *external.task_configs(refs, include_path), common)
    except ConnectionError as err:
        raise DataError(f"{', '.join(refs)}: {str(err).splitlines()[0][:160]}; meshlm eval keeps "
                        "the Hugging Face Hub off, so a task's Hub data must be in the local "
                        "datasets cache: run datasets.load_dataset(...) for it once where the Hub "
                        "is reachable (or copy that HF_DATASETS_CACHE here), or pass a task YAML "
                        "with local data_files") from None


def _evaluate(lm, tasks: list, manager, common: dict) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, **common)


@contextlib.contextmanager
def quiet():
    """Silence lm-eval's per-task log lines and progress bars (one per MMLU subject): errors still
    raise."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        # tqdm bars resolve sys.stderr when created; the bootstrap announces itself with print();
        # lm-eval runs `git describe`, whose "fatal: not a git repository" outside a repo goes to
        # file descriptor 2
        with contextlib.redirect_stderr(
            io.StringIO()), contextlib.redirect_stdout(io.StringIO()), _null_fd(2):
            yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def _null_fd(fd: int):
    saved = os.dup(fd)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _metric(values: dict, name: str) -> float | None:
    value = values.get(f"{name},none")
    return float(value) if isinstance(value, (int, float)) else None


def summarise(raw: dict, tasks) -> dict[str, Any]:
    """lm-eval's result dict -> {"tasks": {name: {...}}, "average": mean of the paper metrics,
    "items": n, "covered": how many of the paper's nine tasks the average covers, "of": 9}."""
    out: dict[str, dict] = {}
    for task in tasks:
        values = raw["results"][f"{SUITE_GROUP}::{MMLU_GROUP}" if task.name == "mmlu"
                                else task.harness]
        out[task.name] = {
            "acc": _metric(values, "acc"), "acc_norm": _metric(values, "acc_norm"),
            "metric": task.metric, "score": _metric(values, task.metric),
            "stderr": _metric(values, f"{task.metric}_stderr"), "items": int(values["sample_len"]),
        }
        if _metric(values, "perplexity") is not None:
            out[task.name]["perplexity"] = _metric(values, "perplexity")
    scores = [t["score"] for t in out.values() if t["score"] is not None]
    return {"tasks": out, "average": sum(scores) / len(scores) if scores else None,
            "covered": len(scores), "of": PAPER_TASKS,
            "items": sum(t["items"] for t in out.values())}
