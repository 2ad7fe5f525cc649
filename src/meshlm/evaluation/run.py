"""`meshlm eval` as a function: perplexity, loss vs. loop count and the downstream suite for one checkpoint.

The result (also written as eval.json in the run folder) is plain JSON:

    {"checkpoint", "step", "model": ModelConfig, "accounting": {...},
     "perplexity": {"loss", "ppl", "tokens", "sequences", "data", "seq_len"},
     "loops": [{"loops", "trained", "loss", "ppl", ...}],
     "exit": [{"exit", "max_loops", "loss", "ppl", "avg_loops", "avg_probes", "flops_ratio", ...}],
     "downstream": {"0": {"tasks": {name: {"acc", "acc_norm", "metric", "score", "stderr", "items"}},
                          "average", "items", "seconds", "limit"}, "5": {...}},
     "reasoning": {...}  (task data only: meshlm.evaluation.reasoning),
     "seconds"}
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlm import atomic
from meshlm.data.tasks import data_folder, holds_tasks, read_test, task_info, window_length
from meshlm.errors import ConfigError, MeshlmError
from meshlm.evaluation.downstream import run_suite
from meshlm.evaluation.perplexity import default_loop_counts, exit_frontier, is_looped, loss_vs_loops, mean_loss
from meshlm.evaluation.reasoning import evaluate_reasoning
from meshlm.evaluation.tasks import PAPER_TASKS
from meshlm.loading import Opened
from meshlm.model.accounting import account


@dataclass
class EvalOptions:
    data: str | None = None  # prepared-data folder; None = the checkpoint's training data
    loops: list[int] | None = None  # None = 1 … 2K for weight-shared models; [] = skip
    exits: list[str] = field(default_factory=list)  # adaptive-exit rules, e.g. ["state:0.05", "kl:1e-4"]
    exit_loops: int | None = None  # the most loop steps under exit (default: the trained K)
    tasks: str | list[str] | None = "all"  # None / [] = skip downstream
    shots: list[int] = field(default_factory=lambda: [0, 5])
    limit: int | None = None  # items per task, and validation windows
    batch_size: int = 8  # validation windows per forward
    batch_tokens: int = 8192  # padded tokens per forward when scoring tasks
    samples_dir: Path | None = None  # write each scored item (requests, loglikelihoods, metrics) here
    verbose: bool = False
    suite: str = "auto"  # "text", "reasoning" (task data's test set) or "auto": reasoning for task data
    include_path: list[str] = field(default_factory=list)  # folders of lm-eval task YAMLs (--include-path)
    task_loops: int | None = None  # loop steps while scoring and decoding lm-eval tasks (None: trained K)
    task_exit: str | None = None  # per-token adaptive exit while scoring and decoding them
    speculate: str | None = None  # self-speculative decoding for generate_until tasks ("auto", "K_d[:γ]")
    dtype: str = ""  # the precision scores are computed in (recorded beside them)


def evaluate(loaded: Opened, options: EvalOptions, log: Callable[[str], None] = print,
             save: Callable[[dict], Any] | None = None) -> dict[str, Any]:
    """Every stage in turn; `save(result)` after each one ("complete": false until the last), so a failure
    or an interrupt later keeps what finished."""
    start = time.perf_counter()
    model = loaded.model
    result: dict[str, Any] = {"checkpoint": str(loaded.path), "step": loaded.meta.get("step"),
                              "model": model.config.to_dict(), "accounting": account(model).to_dict(),
                              "complete": False}
    save = save or (lambda partial: None)
    check_task_data(loaded.folder.data_source(), options.data, options.suite)
    data = loaded.held_out(options.data)
    suite = suite_for(options.suite, options.data or loaded.folder.data_source())
    seq_len = window_length(data.manifest, 0) or loaded.seq_len  # task data: one example per window
    common = dict(batch_size=options.batch_size, max_sequences=options.limit)
    result["perplexity"] = {**mean_loss(model, data, seq_len, **common), "data": str(data.dir),
                            "split": data.split, "seq_len": seq_len}
    log(f"validation perplexity {result['perplexity']['ppl']:.3f} (loss {result['perplexity']['loss']:.4f}, "
        f"{result['perplexity']['tokens']:,} tokens{' (answers only)' if data.masks is not None else ''})")
    save(result)
    looped = is_looped(model)  # a study's --loops and --exit pass over vanilla runs: they have one depth
    counts = default_loop_counts(model) if options.loops is None or not looped else options.loops
    result["loops"] = loss_vs_loops(model, data, seq_len, counts, **common)
    for row in result["loops"]:
        log(f"  loops={row['loops']}{' (trained)' if row['trained'] else ''}: loss {row['loss']:.4f}, "
            f"ppl {row['ppl']:.3f}")
    result["exit"] = exit_frontier(model, data, seq_len, options.exits if looped else [], options.exit_loops,
                                   **common)
    for row in result["exit"]:
        log(f"  exit {row['exit']} (at most {row['max_loops']} loops): loss {row['loss']:.4f}, avg loops/token "
            f"{row['avg_loops']:.3f}, coda probes/token {row['avg_probes']:.3f}, FLOPs x{row['flops_ratio']:.3f}")
    result["downstream"] = {}
    save(result)
    if suite == "reasoning":
        log("reasoning suite (exact match, greedy cached decoding):")
        result["reasoning"] = evaluate_reasoning(
            model, loaded.tokenizer, read_test(data.dir), data.manifest["task"]["levels"],
            None if options.loops is None else [k for k in options.loops if k >= 1], options.exits,
            options.exit_loops, options.limit, log=log)
        result["reasoning"]["train_loops"] = loaded.train.get("loops", "fixed")  # how depth was trained
        save(result)
    elif options.tasks:
        downstream(loaded, options, log, into=result["downstream"], save=lambda: save(result))
    result["seconds"] = time.perf_counter() - start
    result["complete"] = True
    save(result)
    return result


def suite_for(suite: str, data: str) -> str:
    """--suite resolved for the data evaluated on (a folder or a train.data value): "reasoning" when asked, or
    under "auto" for task data; else "text"."""
    return "reasoning" if suite == "reasoning" or (suite == "auto" and holds_tasks(data)) else "text"


def check_task_data(trained_on: str, override: str | None, suite: str) -> None:
    """Before any compute (ConfigError): the reasoning suite asked of text data, or a checkpoint trained on task
    data evaluated on data of tasks it was not trained on. `trained_on` is the run's train.data."""
    data = override or trained_on
    if suite == "reasoning" and not holds_tasks(data):
        raise ConfigError(f"--suite reasoning needs task data, and {data} holds text; pass --data with a folder "
                          f"written by `meshlm prepare task:NAME`")
    learned, given = task_names(trained_on), task_names(data)
    if learned and given and not set(given) <= set(learned):
        raise ConfigError(f"this checkpoint was trained on task(s) {', '.join(learned)}, and --data {override} holds "
                          f"{', '.join(given)}; evaluate on data of the tasks it learned (or train one)")


def task_names(data: str) -> list[str]:
    """The tasks of task data (a train.data value or a folder); [] for text or unreadable data."""
    if not holds_tasks(data):
        return []
    try:
        info = task_info(data_folder(str(data)))
    except MeshlmError:
        return []
    return list(info["levels"]) if info else []


def downstream(loaded: Opened, options: EvalOptions, log: Callable[[str], None] = print,
               into: dict[str, Any] | None = None, save: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """{shots: suite summary}, filled into `into` one few-shot setting at a time (`save()` after each)."""
    from meshlm.evaluation.harness import MeshLMEval  # imports lm-eval: only when downstream tasks run

    lm = MeshLMEval(loaded.model, loaded.tokenizer, batch_tokens=options.batch_tokens, loops=options.task_loops,
                    exit=options.task_exit, speculate=options.speculate, log=log)
    out = {} if into is None else into
    for shots in options.shots:
        log(f"{shots}-shot: running {options.tasks} ...")
        summary = run_suite(lm, options.tasks, shots=shots, limit=options.limit, verbose=options.verbose,
                            log_samples=options.samples_dir is not None, include_path=options.include_path)
        summary["dtype"] = options.dtype
        if options.samples_dir is not None:
            write_samples(summary.pop("samples"), Path(options.samples_dir) / f"{shots}-shot.jsonl")
        out[str(shots)] = summary
        save()
        log(format_suite(summary))
    return out


SAMPLE_FIELDS = ("doc_id", "target", "arguments", "resps", "acc", "acc_norm", "perplexity")


def write_samples(samples: dict[str, list[dict]], path: Path) -> Path:
    """One JSON line per scored item: its lm-eval task, requests, (loglikelihood, greedy) answers, metrics."""
    lines = (json.dumps({"task": task, **{k: item[k] for k in SAMPLE_FIELDS if k in item}}, ensure_ascii=False,
                        default=str) + "\n" for task, items in samples.items() for item in items)
    return atomic.write_text(path, "".join(lines))


def format_suite(summary: dict) -> str:
    """A few lines: each task's paper metric (and the other), then the average and the speed."""
    precision = f", {summary['dtype']}" if summary.get("dtype") else ""
    lines = [f"{summary['shots']}-shot ({summary['items']:,} items, {summary['seconds']:.0f} s, "
             f"{1000 * summary['seconds'] / max(summary['items'], 1):.1f} s per 1,000 items{precision}):"]
    for name, t in summary["tasks"].items():
        value = "{:.4f}".format if t.get("external") else "{:6.2f}".format  # lm-eval's own metrics: as it prints
        scale = 1 if t.get("external") else 100
        error = f" ± {value(scale * t['stderr']).strip()}" if t.get("stderr") is not None else ""
        other = "acc_norm" if t["metric"] == "acc" else "acc"
        extra = f", {other} {100 * t[other]:.2f}" if t.get(other) is not None else ""
        lines.append(f"  {name:<15} {t['metric']:<8} {value(scale * t['score'])}{error}{extra}  (n={t['items']})")
    if summary["average"] is not None:
        lines.append(f"  {'average':<15} {'':<8} {100 * summary['average']:6.2f}  "
                     f"({coverage(summary)})")
    return "\n".join(lines)


def coverage(summary: dict) -> str:
    """"8 of the paper's 9 tasks" (older eval.json files lack the counts: they averaged the eight)."""
    covered = summary.get("covered", sum(t.get("score") is not None for t in summary["tasks"].values()))
    return f"{covered} of the paper's {summary.get('of', PAPER_TASKS)} tasks"


def write_json(result: dict, path: str | Path) -> Path:
    """Atomically (meshlm.atomic): the previous result stays whole until this one is."""
    return atomic.write_text(path, json.dumps(result, indent=1, default=float) + "\n")
