"""`meshlm eval CKPT`: validation perplexity, loss vs. loop count, and the paper's downstream suite
through lm-evaluation-harness (0- and 5-shot by default); writes <run>/eval.json.

    meshlm eval runs/mesh-small-mesh                     # everything (minutes to hours on a CPU)
    meshlm eval runs/mesh-small-mesh --limit 50          # a quick look: 50 items per task, 50
                                                           windows
    meshlm eval runs/mesh-small-mesh --tasks piqa,arc_easy --shots 0 --loops 1,2,3,4,6,8
    meshlm eval runs/mesh-small-mesh --tasks none --loops 1,2,4,8,16 --exit state:0.05,kl:1e-4
    --exit-loops 8
    meshlm eval runs/chase --loops 1,2,4,8,16 --exit state:0.1    # a run trained on task data: the
                                                                    reasoning suite
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from meshlm.errors import ConfigError
from meshlm.runtime.options import add_dtype_argument, add_tokenizer_arguments


def int_list(text: str) -> list[int]:
    """"0,5" -> [0, 5]; "none" or "" -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, "
                                         "e.g. 0,5") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: values must be >= 0")
    return values


def exit_list(text: str) -> list:
    """"state:0.05,kl:1e-4" -> the ExitRules, each checked (a bad one is a one-line error)."""
    from meshlm.model.exit import ExitRule

    try:
        return [ExitRule.parse(rule) for rule in text.split(",") if rule.strip()]
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_input_arguments(p)
    _add_task_arguments(p)
    _add_depth_arguments(p)
    _add_scope_arguments(p)
    _add_run_arguments(p)


def _add_input_arguments(p: argparse.ArgumentParser) -> None:
    """The model to evaluate, its tokenizer and its validation data."""
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a run folder (its latest checkpoint), a step-NNNNNN folder, a converted "
                        "or retrofitted folder, or a Hugging Face folder (meshlm.loading)")
    add_tokenizer_arguments(p)
    p.add_argument("--data", help="prepared-data folder for perplexity (default: what the model "
                                  "was trained on)")


def _add_task_arguments(p: argparse.ArgumentParser) -> None:
    """The downstream tasks: which, at what depth or exit, with what decoding and shots."""
    p.add_argument("--tasks", default="all",
                   help="comma-separated tasks, 'all' (default) or 'none': the paper's suite "
                        "(lambada_openai, piqa, hellaswag, winogrande, arc_easy, arc_challenge, "
                        "sciq, mmlu, lambada_standard: only from the local HF datasets cache; "
                        "'all' includes it when it is there), and any other lm-eval task or group "
                        "name, or task YAML file, generative ones included")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of lm-eval task YAMLs whose names --tasks may use (as lm_eval "
                        "--include_path)")
    p.add_argument("--task-loops", type=int, default=None,
                   help="loop steps while scoring and decoding the tasks (default: the trained K)")
    p.add_argument("--task-exit", default=None,
                   help="per-token adaptive exit while scoring and decoding the tasks, e.g. "
                        "state:0.05")
    p.add_argument("--speculate", default=None,
                   help="decode generative tasks by lossless self-speculation: auto, K_d or K_d:γ "
                        "(same tokens)")
    p.add_argument("--shots", type=int_list, default=[0, 5],
                   help="few-shot settings, e.g. 0,5 (default)")


def _add_depth_arguments(p: argparse.ArgumentParser) -> None:
    """Validation loss against loop count and under adaptive exit."""
    p.add_argument("--loops", type=int_list, default=None,
                   help="loop counts for loss vs. depth, e.g. 1,2,3,4, or none (default: 1 … 2K "
                        "for looped models)")
    p.add_argument("--exit", default="", type=exit_list,
                   help="per-token adaptive exit rules to evaluate, e.g. state:0.05,kl:1e-4 (loss "
                        "and average loops per token for each)")
    p.add_argument("--exit-loops", type=int, default=None,
                   help="the most loop steps a token may run under --exit (default: the trained K)")


def _add_scope_arguments(p: argparse.ArgumentParser) -> None:
    """Which suite is scored and on how many items."""
    p.add_argument("--suite", choices=("auto", "text", "reasoning"), default="auto",
                   help="reasoning: exact-match accuracy on task data's test set by difficulty x "
                        "loops (and --exit), instead of the lm-eval tasks; auto (default): "
                        "reasoning for a run trained on task data (`meshlm prepare task:NAME`)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most N items per task (each MMLU subject counts as a task; per task "
                        "and difficulty in the reasoning suite) and N validation windows")


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Batching, device, precision and what is written."""
    p.add_argument("--batch-size", type=int, default=8,
                   help="validation windows per forward (default 8)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per forward when scoring tasks")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    add_dtype_argument(p)
    p.add_argument("--out", help="where to write the JSON (default: <run>/eval.json, unless that "
                                 "holds an evaluation this one does not cover: then "
                                 "eval-<hash>.json beside it, and a line says so)")
    p.add_argument("--log-samples", action="store_true",
                   help="also write every scored item (requests, answers, metrics) to "
                        "eval-samples/<k>-shot.jsonl")
    p.add_argument("--verbose", action="store_true",
                   help="show lm-eval's own logging and progress bars")


def run(args: argparse.Namespace) -> int:
    from meshlm.folders import hub

    # first: importing meshlm.evaluation switches the Hub off (for lm-eval's data)
    hub.prefetch(args.checkpoint)
    from meshlm.evaluation.results import write
    from meshlm.evaluation.run import EvalOptions, evaluate
    from meshlm.evaluation.scope import choose, scope_of
    from meshlm.loading import open_model
    from meshlm.runtime import precision

    tasks = check_inputs(args)
    loaded = open_model(args.checkpoint, args.device, tokenizer=args.tokenizer,
                        force_tokenizer=args.force_tokenizer)
    scope = scope_of(args.data, args.suite, tasks, args.shots, args.limit, args.loops, args.exit,
                     args.exit_loops)
    # never narrowed unsaid
    out, note = (Path(args.out), None) if args.out else choose(loaded.run_dir, scope)
    if note:
        print(note, flush=True)
    options = EvalOptions(data=args.data, loops=args.loops, exits=args.exit,
                          exit_loops=args.exit_loops,
                          tasks=tasks, shots=args.shots, limit=args.limit, suite=args.suite,
                          batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                          verbose=args.verbose,
                          samples_dir=out.parent / "eval-samples" if args.log_samples else None,
                          include_path=args.include_path, task_loops=args.task_loops,
                          task_exit=args.task_exit,
                          speculate=args.speculate)
    device, chosen = precision.for_model(args.dtype, loaded.model)
    options.dtype = chosen.name
    print(f"evaluating {loaded.path} ({loaded.model.config.spec} {loaded.model.config.scheme}) in "
          f"{chosen.describe()}{precision_note(chosen.name)}", flush=True)

    def save(partial) -> None:  # after every stage, so what finished is kept
        write(dataclasses.replace(partial, dtype=chosen.name, scope=scope), out)

    with precision.autocast(device, chosen):
        result = evaluate(loaded, options, save=save)
    print(f"results: {out} ({result.seconds:.0f} s)")
    return 0


def check_inputs(args: argparse.Namespace) -> str | None:
    """Every argument, the model folder, the device, the task names and their fetched data, before
    any compute (all problems in one error). Returns the tasks to run (None = none)."""
    from meshlm.errors import Problems
    from meshlm.evaluation.run import check_task_data, suite_for
    from meshlm.folders import hub
    from meshlm.folders.locate import locate
    from meshlm.generate.speculative import Speculation
    from meshlm.model.exit import ExitRule
    from meshlm.runtime.devices import resolve_device

    p = Problems()
    p.need(args.limit is None or args.limit >= 1,
           f"--limit {args.limit} must be >= 1 (omit it to evaluate everything)")
    p.need(min(args.batch_size, args.batch_tokens) >= 1,
           "--batch-size and --batch-tokens must be >= 1")
    p.need(all(k >= 1 for k in args.loops or []), f"--loops {args.loops}: loop counts must be >= 1")
    p.need(args.exit_loops is None or args.exit_loops >= 1,
           f"--exit-loops {args.exit_loops} must be >= 1")
    p.need(args.task_loops is None or args.task_loops >= 1,
           f"--task-loops {args.task_loops} must be >= 1")
    # parsed once, here: the settings travel typed from now on
    args.task_exit = p.check(ExitRule.parse, args.task_exit) if args.task_exit else None
    args.speculate = p.check(Speculation.parse, args.speculate) if args.speculate else None
    p.check(resolve_device, args.device)
    reasoning = args.suite == "reasoning"
    if p.need(hub.exists(args.checkpoint), f"{args.checkpoint} does not exist; pass a run folder, "
                                           "a step-NNNNNN folder, a model folder or a Hugging "
                                           "Face Hub name org/name[@revision]"):
        folder = p.check(locate, args.checkpoint)
        if folder is not None:
            p.need(not (args.out and Path(args.out).is_dir()),
                   f"--out {args.out} is a folder; name the JSON file to write, e.g. "
                   f"{Path(args.out or '.') / 'eval.json'}")
            p.writable(Path(args.out).parent if args.out else folder.run_dir, "output folder")
            if args.tokenizer:
                p.check(folder.chosen_tokenizer, args.tokenizer, args.force_tokenizer)
            reasoning = suite_for(args.suite, args.data or folder.data_source()) == "reasoning"
            p.check(check_task_data, folder.data_source(), args.data, args.suite)
    if args.data is not None:
        p.need(Path(args.data).expanduser().is_dir(),
               f"--data {args.data} does not exist; pass a folder written by `meshlm prepare`")
    # reasoning: its own
    tasks = None if reasoning or args.tasks.strip().lower() in ("none", "") else args.tasks
    if tasks is not None:
        p.need(bool(args.shots), "--shots none with tasks to run: pass --shots 0,5 or --tasks none")
        check_tasks(tasks, p, args.include_path)
    p.raise_if_any()
    return tasks


def precision_note(dtype: str) -> str:
    """What to pass to compare with lm-eval's own runs of an export, which load it in its saved
    fp32."""
    if dtype == "fp32":
        return ""
    return ("; `lm_eval --model hf` runs a meshlm export in fp32 (up to ~0.1 nats per item apart "
            "from bf16): pass --dtype fp32 to compare item for item")


def check_tasks(tasks: str, p, include_path: list[str] = ()) -> None:
    """Known task names (the suite's, or lm-eval's: meshlm.evaluation.tasks.external), and the
    suite's evaluation sets fetched (`meshlm fetch`) and extracted."""
    from meshlm.evaluation.tasks import external, partition, resolve_tasks, task_specs

    ours, others = partition(tasks)
    chosen = p.check(resolve_tasks, ours) if ours else None
    if chosen:
        # DataError naming `meshlm fetch` when the wheel is not in the cache
        p.check(task_specs, chosen)
    if others:
        p.check(external.task_configs, others, include_path)
