"""What every benchmark shares: the model-shape and timing options, and interleaved median timing.

Benchmarks run as scripts (`python benchmarks/x.py`), so this module is imported from the script's
folder.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The compared models' shape: a layout spec, width, heads, vocabulary."""
    p.add_argument("--spec", default="2+4R2+2")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)


def add_timing_arguments(p: argparse.ArgumentParser, rounds: int,
                         rounds_help: str | None = None) -> None:
    p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or this process's CPU time")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def timing_setup(args: argparse.Namespace) -> Callable[[], float]:
    """Apply --threads; return the --clock (CPU time ignores the time other jobs hold the cores)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return time.process_time if args.clock == "cpu" else time.perf_counter


def interleaved_medians(steps: dict[str, Callable[[], None]], rounds: int, clock) -> dict[str,
                                                                                          float]:
    """Median seconds per call of each step: one warm-up each, then `rounds` rounds that run every
    step once, so machine noise hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = clock()
            step()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    """A decoder stack's linear layers (stack_shapes) and the row counts to time them at."""
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rows", default="1,2,4,8,16,64,256")


def stack_shapes(d: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    """(out, in) of every matmul a GPT-NeoX layer stack and its head run per token."""
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers + [(vocab, d)]


def decoding_copy(model: torch.nn.Module, dtype: str,
                  huge: bool = False) -> tuple[torch.nn.Module, object]:
    """(a copy of `model` with the weights `meshlm generate --dtype DTYPE` decodes with, the
    precision it decodes in): meshlm.decoding.for_decoding's (fp32 split for one-token products
    where that pays, bf16 stored in bf16; `huge`: on 2 MB pages where Linux can, as a server's
    and a long generation's are)."""
    import copy

    from meshlm.decoding import for_decoding

    model = copy.deepcopy(model)
    return model, for_decoding(dtype, model, huge)[1]


def bf16_without_kernel(model: torch.nn.Module) -> tuple[torch.nn.Module, object]:
    """(a copy of `model` as bf16 decoding is without the kernel meshlm.kernels.bf16_rows compiles:
    the weights stored in bf16, every product by F.linear, what the kernel buys; its precision)."""
    import copy

    from meshlm.runtime import precision

    model = copy.deepcopy(model)
    return model, precision.store_weights(model, precision.Precision(torch.bfloat16,
                                                                     "as requested"))


def corpus_prompts(tok, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the openings of held-out documents of the embedded corpus
    (validation split), so decoding is measured on real text."""
    from meshlm.data.corpus import split_documents

    prompts = []
    for doc in split_documents("val"):
        ids = tok.encode(doc["text"][5000:20000])
        if not ids:  # a document shorter than 5,000 characters
            continue
        prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    return prompts


def corpus_windows(tok, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens cut at evenly spaced places of the held-out documents
    (validation split, joined): more prompts than `corpus_prompts` finds documents for."""
    from meshlm.data.corpus import split_documents

    ids = [t for doc in split_documents("val") for t in tok.encode(doc["text"])]
    stride = max((len(ids) - length) // max(count, 1), 1)
    return [ids[i * stride:i * stride + length] for i in range(count)
            if i * stride + length <= len(ids)]


def read_sum(megabytes: int = 256) -> tuple[Callable[[], object], int]:
    """(a sum over a `megabytes` tensor, the bytes it reads): its time gives the read bandwidth
    (reads only, with every torch thread), the ceiling of batch-1 decoding, which reads every
    weight once per token and writes next to nothing."""
    a = torch.ones(megabytes * 2**20 // 4)
    return a.sum, a.numel() * a.element_size()


def read_bandwidth(megabytes: int = 256, reps: int = 5) -> float:
    """Bytes/s of the best of `reps` read_sum calls."""
    from meshlm import machine

    read, size = read_sum(megabytes)
    return size / machine.best_seconds(read, reps)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoded token reads: everything but the input embedding table (one row
    of it)."""
    # meshlm's "embed_in.weight", transformers' "gpt_neox.embed_in.weight"
    state = model.state_dict()
    table = next(t for name, t in state.items() if name.endswith("embed_in.weight"))
    total = sum(t.numel() * t.element_size() for t in state.values())
    return total - table.numel() * table.element_size() + table[0].nbytes
