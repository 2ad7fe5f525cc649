"""`meshlm prepare`: tokenise text files, folders, JSONL or a save_to_disk dataset into token
shards, or generate reasoning-task data.

Writes <out>/manifest.json plus <split>-NNNNN.bin shards (see meshlm.data.shards) that `meshlm train
--data` reads. Heavy imports happen in run(), so building the CLI parser stays fast.

    meshlm prepare corpus/ --out data/mine
    meshlm prepare task:chase --out data/chase --train-difficulty 1-4 --test-difficulty 1-8
    meshlm prepare task:chase,dag --out data/mix --train-examples 100000
        # a mixture, each task's defaults
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+",
                        help="text/markdown/JSONL files, folders (recursive) or "
                        "datasets.save_to_disk folders")
    parser.add_argument("-o", "--out", required=True,
                        help="output folder for shards and manifest.json")
    parser.add_argument("--tokenizer", default="default",
                        help="'default' (shipped 8192 BPE), 'pythia' (after `meshlm fetch`) or a "
                             "tokenizer.json")
    parser.add_argument("--text-field", default="text",
                        help="JSONL field / dataset column holding the text")
    # None = the library default (meshlm.data.prepare), kept in one place
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="share of documents held out for validation, chosen by document hash "
                             "(default 0.02)")
    parser.add_argument("--shard-tokens", type=int, default=None,
                        help="tokens per shard file (default 100M)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace data already prepared in --out (a folder holding other files "
                             "is refused, --overwrite or not)")
    parser.add_argument("--allow-binary", action="store_true",
                        help="read files that look binary (NUL bytes, >30%% invalid UTF-8) as "
                             "text anyway")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    tasks = parser.add_argument_group("reasoning tasks (input task:NAME[,NAME], meshlm.reasoning; "
                                      "docs/reasoning.md)")
    tasks.add_argument("--task-option", action="append", default=[], metavar="TASK.KNOB=N",
                       help="a generator's size knob, e.g. chase.statements=8 or modsum.width=8 "
                            "(repeatable)")
    tasks.add_argument("--train-difficulty", default="", metavar="LO-HI",
                       help="difficulties to train on (default: each task's own, e.g. chase 1-4)")
    tasks.add_argument("--test-difficulty", default="", metavar="LO-HI",
                       help="difficulties of the test set (default: each task's own, beyond "
                            "training)")
    tasks.add_argument("--train-examples", type=int, default=50_000,
                       help="training problems (default 50000)")
    tasks.add_argument("--val-examples", type=int, default=512,
                       help="validation problems (default 512)")
    tasks.add_argument("--test-per-level", type=int, default=200,
                       help="test problems per difficulty (default 200)")
    tasks.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    tasks.add_argument("--disjoint", action="store_true",
                       help="refuse a test range that overlaps the training range")


def run(args: argparse.Namespace) -> int:
    from meshlm.data.prepare import prepare, split_warnings
    from meshlm.data.tasks import is_task_source

    if any(is_task_source(i) for i in args.inputs):
        return prepare_tasks(args)
    check_inputs(args)
    given = {"val_fraction": args.val_fraction, "shard_tokens": args.shard_tokens}
    manifest = prepare(args.inputs, args.out, args.tokenizer, text_field=args.text_field,
                       overwrite=args.overwrite,
                       progress=not args.quiet, allow_binary=args.allow_binary,
                       **{k: v for k, v in given.items() if v is not None})
    if manifest["replaced_bytes"]:
        print(f"warning: {manifest['replaced_bytes']} bytes were not valid UTF-8 and became U+FFFD "
              f"(count recorded in manifest.json)", file=sys.stderr)
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['documents']} documents, {info['tokens']:,} tokens in "
              f"{len(info['shards'])} {manifest['dtype']} shard(s)")
    for warning in split_warnings(manifest):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out} (tokenizer {manifest['tokenizer']['name']}, vocab "
          f"{manifest['tokenizer']['vocab_size']})")
    return 0


def check_inputs(args: argparse.Namespace) -> None:
    """Inputs, output folder, tokenizer and numbers, all before reading any text (every problem at
    once)."""
    from pathlib import Path

    from meshlm import outputs
    from meshlm.data.tokenizer import load_tokenizer
    from meshlm.errors import Problems

    p = Problems()
    missing = [path for path in args.inputs if not Path(path).expanduser().exists()]
    p.need(not missing, f"input{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        f"do{'' if len(missing) > 1 else 'es'} not exist; check the path")
    # a file, a folder of other files, earlier data without --overwrite, an input: refused
    p.check(outputs.claim, args.out, "prepare", args.overwrite, args.inputs)
    p.need(args.val_fraction is None or 0 <= args.val_fraction < 1,
           f"--val-fraction {args.val_fraction} must be in [0, 1), e.g. 0.02")
    p.need(args.shard_tokens is None or args.shard_tokens >= 1,
           f"--shard-tokens {args.shard_tokens} must be >= 1")
    p.need(bool(args.text_field.strip()),
           "--text-field must name a JSONL field / dataset column, e.g. text")
    p.check(load_tokenizer, args.tokenizer)
    p.raise_if_any()


def prepare_tasks(args: argparse.Namespace) -> int:
    from meshlm import outputs
    from meshlm.data.tasks import PREFIX, TaskData
    from meshlm.data.tasks import prepare_tasks as generate
    from meshlm.errors import ConfigError

    if len(args.inputs) != 1:
        raise ConfigError("task data is one input, task:NAME[,NAME] (got "
                          f"{' '.join(args.inputs)}); prepare text and tasks separately")
    spec = TaskData(tasks=args.inputs[0][len(PREFIX):], options=",".join(args.task_option),
                    train_levels=args.train_difficulty,
                    test_levels=args.test_difficulty, train_examples=args.train_examples,
                    val_examples=args.val_examples, test_per_level=args.test_per_level,
                    seed=args.seed,
                    disjoint=args.disjoint)
    outputs.claim(args.out, "prepare", args.overwrite)
    manifest = generate(spec, args.out, overwrite=args.overwrite)
    task = manifest["task"]
    for name, levels in task["levels"].items():
        print(f"{name}: train difficulties {levels['train']}, test {levels['test']}")
    splits = manifest["splits"]
    print(f"train: {splits['train']['documents']:,} problems, val: {splits['val']['documents']:,}, "
          f"test: {task['test_problems']:,}; one example per window of {task['block']} tokens "
          f"(train.seq_len={task['block']}, model.context_length >= "
          f"{max(task['block'], task['longest_test'])})")
    print(f"wrote {args.out} (character tokenizer, vocab {manifest['tokenizer']['vocab_size']})")
    return 0
