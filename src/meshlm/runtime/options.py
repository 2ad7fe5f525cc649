"""Command-line options of the run policy, importable without torch (`meshlm --help` imports every command)."""
from __future__ import annotations

import argparse

DTYPE_CHOICES = ("auto", "fp32", "bf16")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """The `--dtype` option of the inference commands (eval, probe, generate); meshlm.runtime.precision."""
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto (default): bf16 autocast where the CPU/GPU multiplies bf16 natively, else fp32")
