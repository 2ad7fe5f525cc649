"""`meshlm tasks export DIR`: the paper's suite as lm-eval task YAMLs plus their data, for lm-eval's
own CLI.

    meshlm tasks export lm-eval-tasks/
    meshlm convert runs/small-mesh out/mesh-hf --to hf
    lm_eval --model hf --model_args pretrained=out/mesh-hf,trust_remote_code=True \\
        --include_path lm-eval-tasks/ --tasks meshlm_suite --num_fewshot 0 --seed 1234 --device cpu

No network: the data are the sets `meshlm fetch` extracted (copied into DIR/data), addressed by
absolute path. `meshlm fetch` also writes the same YAMLs (pointing at the cache) to
<cache>/lm-eval-tasks.
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("export",),
                   help="export: write the task YAMLs and data to OUT")
    p.add_argument("out", metavar="OUT", help="folder for the YAMLs (data go to OUT/data): new, "
                                              "empty, or an earlier export with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier `meshlm tasks export` in OUT (never other files)")
    p.add_argument("--tasks", default="all", help="comma-separated suite tasks or 'all' (default)")
    p.add_argument("--cache-dir", default=None,
                   help="cache folder (default: $MESHLM_CACHE or ~/.cache/meshlm)")


def run(args: argparse.Namespace) -> int:
    from meshlm import outputs
    from meshlm.evaluation.tasks import resolve_tasks
    from meshlm.evaluation.tasks.export import export_tasks, usage

    outputs.claim(args.out, "tasks export", args.overwrite, label="output")
    names = export_tasks(args.out, resolve_tasks(args.tasks), args.cache_dir)
    outputs.mark(args.out, "tasks export")
    print(usage(args.out, names))
    return 0
