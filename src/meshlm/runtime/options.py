"""Command-line options of the run policy, importable without torch (`meshlm --help` imports every command)."""
from __future__ import annotations

import argparse

DTYPE_CHOICES = ("auto", "fp32", "bf16")


def add_dtype_argument(parser: argparse.ArgumentParser, decoding: bool = False) -> None:
    """The `--dtype` option of the inference commands (eval, probe, generate, serve); meshlm.runtime.precision.
    Decoding commands resolve auto to fp32 (precision.for_decoding)."""
    auto = ("fp32, where greedy decoding is exact under batching and speculation; bf16 autocast on request"
            if decoding else "bf16 autocast where the CPU/GPU multiplies bf16 natively, else fp32")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=f"auto (default): {auto}")
