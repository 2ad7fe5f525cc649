"""Command-line options of the run policy, importable without torch (`meshlm --help` imports every
command)."""
from __future__ import annotations

import argparse

DTYPE_CHOICES = ("auto", "fp32", "bf16")


def add_dtype_argument(parser: argparse.ArgumentParser, decoding: bool = False) -> None:
    """The `--dtype` option of the inference commands (eval, probe, generate, serve);
    meshlm.runtime.precision. Decoding commands resolve auto to fp32
    (precision.choose_for_decoding)."""
    auto = ("fp32, where greedy decoding is exact under batching and speculation; bf16 autocast "
            "on request"
            if decoding else "bf16 autocast where the CPU/GPU multiplies bf16 natively, else fp32")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help=f"auto (default): {auto}")


def add_tokenizer_arguments(parser: argparse.ArgumentParser,
                            default: str = "the folder's own, else the one its "
                                            "training config names") -> None:
    """`--tokenizer` and `--force-tokenizer` of every command that opens a model folder
    (meshlm.loading): a tokenizer that encodes unlike the folder's own is refused unless forced."""
    parser.add_argument("--tokenizer", default=None,
                        help=f"'default', 'pythia' or a tokenizer.json (default: {default}); it "
                             "must encode like the folder's own tokenizer (compared by "
                             "vocabulary, merges, normalisation and special tokens, not file "
                             "bytes)")
    parser.add_argument("--force-tokenizer", action="store_true",
                        help="use --tokenizer even though it encodes unlike the folder's own (the "
                             "model then reads ids it was not trained on)")
