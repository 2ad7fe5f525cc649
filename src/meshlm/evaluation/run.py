"""`meshlm eval` as a function: perplexity, loss vs. loop count and the downstream suite for one
checkpoint.

The result is an EvalResult (meshlm.evaluation.results: the schema of eval.json and its one reader).
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
from meshlm.evaluation.perplexity import (
    default_loop_counts,
    exit_frontier,
    is_looped,
    loss_vs_loops,
    mean_loss,
)
from meshlm.evaluation.reasoning import evaluate_reasoning
from meshlm.evaluation.results import DepthRow, EvalResult, ExitRow, Perplexity, Reasoning, Suite
from meshlm.generate.speculative import Speculation
from meshlm.loading import Opened
from meshlm.model.accounting import account
from meshlm.model.exit import ExitRule


@dataclass
class EvalOptions:
    data: str | None = None  # prepared-data folder; None = the checkpoint's training data
    loops: list[int] | None = None  # None = 1 … 2K for weight-shared models; [] = skip
    exits: list[ExitRule] = field(default_factory=list)  # adaptive-exit rules, e.g. state:0.05,
    # "kl:1e-4"]
    exit_loops: int | None = None  # the most loop steps under exit (default: the trained K)
    tasks: str | list[str] | None = "all"  # None / [] = skip downstream
    shots: list[int] = field(default_factory=lambda: [0, 5])
    limit: int | None = None  # items per task, and validation windows
    batch_size: int = 8  # validation windows per forward
    batch_tokens: int = 8192  # padded tokens per forward when scoring tasks
    samples_dir: Path | None = None  # write each scored item (requests, loglikelihoods, metrics)
    # here
    verbose: bool = False
    suite: str = "auto"  # "text", "reasoning" (task data's test set) or "auto": reasoning for task
    # data
    include_path: list[str] = field(default_factory=list)  # folders of lm-eval task YAMLs
    # (--include-path)
    task_loops: int | None = None  # loop steps while scoring and decoding lm-eval tasks (None:
    # trained K)
    task_exit: ExitRule | None = None  # per-token adaptive exit while scoring and decoding them
    speculate: Speculation | None = None  # self-speculative decoding for generate_until tasks
    dtype: str = ""  # the precision scores are computed in (recorded beside them)


def evaluate(loaded: Opened, options: EvalOptions, log: Callable[[str], None] = print,
             save: Callable[[EvalResult], Any] | None = None) -> EvalResult:
    """Every stage in turn; `save(result)` after each one ("complete": false until the last), so a
    failure or an interrupt later keeps what finished."""
    start = time.perf_counter()
    save = save or (lambda partial: None)
    check_task_data(loaded.folder.data_source(), options.data, options.suite)
    data = loaded.held_out(options.data)
    suite = suite_for(options.suite, options.data or loaded.folder.data_source())
    seq_len = window_length(data.manifest, 0) or loaded.seq_len  # task data: one example per window
    common = dict(batch_size=options.batch_size, max_sequences=options.limit)
    ppl = Perplexity(**mean_loss(loaded.model, data, seq_len, **common), data=str(data.dir),
                     split=data.split, seq_len=seq_len)
    result = EvalResult(checkpoint=str(loaded.path), step=loaded.meta.get("step"), perplexity=ppl,
                        model=loaded.model.config.to_dict(),
                        accounting=account(loaded.model).to_dict())
    log(f"validation perplexity {ppl.ppl:.3f} (loss {ppl.loss:.4f}, {ppl.tokens:,} tokens"
        f"{' (answers only)' if data.masks is not None else ''}"
        f"{' (labels only)' if data.labels is not None else ''})")
    save(result)
    depth_stages(loaded.model, data, seq_len, options, common, result, log)
    save(result)
    if suite == "reasoning":
        log("reasoning suite (" + ("accuracy per labelled position, one forward a loop count"
                                   if data.labels is not None
                                   else "exact match, greedy cached decoding") + "):")
        reasoning = evaluate_reasoning(
            loaded.model, loaded.tokenizer, read_test(data.dir), data.manifest["task"]["levels"],
            None if options.loops is None else [k for k in options.loops if k >= 1], options.exits,
            options.exit_loops, options.limit, log=log)
        reasoning["train_loops"] = loaded.train.get("loops", "fixed")  # how depth was trained
        result.reasoning = Reasoning.from_dict(reasoning)
        save(result)
    elif options.tasks:
        downstream(loaded, options, log, into=result.downstream, save=lambda: save(result))
    result.seconds = time.perf_counter() - start
    result.complete = True
    save(result)
    return result


def depth_stages(model, data, seq_len: int, options: EvalOptions, common: dict, result: EvalResult,
                 log: Callable[[str], None]) -> None:
    """Loss vs. loop count and the adaptive-exit frontier into `result` (a study's --loops and
    --exit pass over vanilla runs: they have one depth)."""
    looped = is_looped(model)
    counts = default_loop_counts(model) if options.loops is None or not looped else options.loops
    rows = loss_vs_loops(model, data, seq_len, counts, **common)
    result.loops = [DepthRow(**row) for row in rows]
    for row in result.loops:
        log(f"  loops={row.loops}{' (trained)' if row.trained else ''}: loss {row.loss:.4f}, "
            f"ppl {row.ppl:.3f}")
    rules = options.exits if looped else []
    rows = exit_frontier(model, data, seq_len, rules, options.exit_loops, **common)
    result.exit = [ExitRow(**row) for row in rows]
    for row in result.exit:
        log(f"  exit {row.exit} (at most {row.max_loops} loops): loss {row.loss:.4f}, "
            f"avg loops/token {row.avg_loops:.3f}, coda probes/token {row.avg_probes:.3f}, "
            f"FLOPs x{row.flops_ratio:.3f}")


def suite_for(suite: str, data: str) -> str:
    """--suite resolved for the data evaluated on (a folder or a train.data value): "reasoning"
    when asked, or under "auto" for task data; else "text"."""
    return ("reasoning" if suite == "reasoning"
            or (suite == "auto" and holds_tasks(data)) else "text")


def check_task_data(trained_on: str, override: str | None, suite: str) -> None:
    """Before any compute (ConfigError): the reasoning suite asked of text data, or a checkpoint
    trained on task data evaluated on data of tasks it was not trained on. `trained_on` is the run's
    train.data."""
    data = override or trained_on
    if suite == "reasoning" and not holds_tasks(data):
        raise ConfigError(f"--suite reasoning needs task data, and {data} holds text; pass --data "
                          "with a folder written by `meshlm prepare task:NAME`")
    learned, given = task_names(trained_on), task_names(data)
    if learned and given and not set(given) <= set(learned):
        raise ConfigError(f"this checkpoint was trained on task(s) {', '.join(learned)}, and "
                          f"--data {override} holds {', '.join(given)}; evaluate on data of the "
                          "tasks it learned (or train one)")


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
               into: dict[str, Suite] | None = None, save: Callable[[], Any] = lambda: None
               ) -> dict[str, Suite]:
    """{shots: suite summary}, filled into `into` one few-shot setting at a time (`save()` after
    each)."""
    # imports lm-eval: only when downstream tasks run
    from meshlm.evaluation.harness import MeshLMEval

    lm = MeshLMEval(loaded.model, loaded.tokenizer, batch_tokens=options.batch_tokens,
                    loops=options.task_loops,
                    exit=options.task_exit, speculate=options.speculate, log=log)
    out = {} if into is None else into
    for shots in options.shots:
        log(f"{shots}-shot: running {options.tasks} ...")
        summary = run_suite(lm, options.tasks, shots=shots, limit=options.limit,
                            verbose=options.verbose,
                            log_samples=options.samples_dir is not None,
                            include_path=options.include_path)
        summary["dtype"] = options.dtype
        if options.samples_dir is not None:
            write_samples(summary.pop("samples"), Path(options.samples_dir) / f"{shots}-shot.jsonl")
        out[str(shots)] = Suite.from_dict(summary)
        save()
        log(format_suite(out[str(shots)]))
    return out


SAMPLE_FIELDS = ("doc_id", "target", "arguments", "resps", "acc", "acc_norm", "perplexity")


def write_samples(samples: dict[str, list[dict]], path: Path) -> Path:
    """One JSON line per scored item: its lm-eval task, requests, (loglikelihood, greedy) answers,
    metrics."""
    lines = (json.dumps({"task": task, **{k: item[k] for k in SAMPLE_FIELDS if k in item}},
                        ensure_ascii=False,
                        default=str) + "\n" for task, items in samples.items() for item in items)
    return atomic.write_text(path, "".join(lines))


def format_suite(summary: Suite) -> str:
    """A few lines: each task's paper metric (and the other), then the average and the speed."""
    precision = f", {summary.dtype}" if summary.dtype else ""
    lines = [f"{summary.shots}-shot ({summary.items:,} items, {summary.seconds:.0f} s, "
             f"{1000 * summary.seconds / max(summary.items, 1):.1f} s per 1,000 items{precision}):"]
    for name, t in summary.tasks.items():
        value = "{:.4f}".format if t.external else "{:6.2f}".format  # lm-eval's: as it prints
        scale = 1 if t.external else 100
        error = f" ± {value(scale * t.stderr).strip()}" if t.stderr is not None else ""
        other = "acc_norm" if t.metric == "acc" else "acc"
        second = getattr(t, other)
        extra = f", {other} {100 * second:.2f}" if second is not None else ""
        lines.append(f"  {name:<15} {t.metric:<8} {value(scale * t.score)}{error}{extra}  "
                     f"(n={t.items})")
    if summary.average is not None:
        lines.append(f"  {'average':<15} {'':<8} {100 * summary.average:6.2f}  "
                     f"({summary.coverage})")
    return "\n".join(lines)
