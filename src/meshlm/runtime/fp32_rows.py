"""fp32 products for decoding through a kernel compiled on this machine (fp32_rows.c).

A decoded token is a matrix-vector product per layer, bound by streaming the weights. With the
weight in split_linear's column blocks, TILE columns wide, a plain C loop reads each block front
to back into accumulators held in registers, two rows per pass: over the 49 weights of a 12-layer
d = 768 stack with a 50,304-word head it ran 1.5-1.75x torch.bmm's speed over split_linear's
per-thread blocks at one row and two threads, 1.6x at one thread, and faster than bmm at every
row count up to 64 (docs/quantize.md). Each output is one in-order sum, the same operations for a
row whatever else is in the call, so a row's outputs do not depend on the batch, bit for bit; they
are F.linear's fp32 product to rounding. Decoding (split_linear.split_linears) gives it every
nn.Linear of a model, MeSH's routers and MoE gates included; a tied head, OLMoE's experts and
per-loop LoRA keep torch's ops, whose rows stay apart or not depending on the BLAS and the CPU
(`rows_apart` tells: on an Intel Xeon with AMX, F.linear computes one row differently from two).

`fp32_rows_kernel()` builds it (meshlm.runtime.native: once per machine, cached, loaded only if
this user alone could have written it), checks it (against a float64 product, and each row alone
against the same row in a batch, bit for bit) and returns the product, or None: no compiler, a
failed build or check, or MESHLM_NATIVE=0 (`unavailable()` says which, for the precision line).
`paying_kernel()` returns it only where a probe found it
at least MIN_SPEEDUP times split_linear's bmm and F.linear's one-row speed (measured once per
machine, CPU, torch version and threads, cached in machine.json): whether a plain loop beats the
BLAS depends on the CPU.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from meshlm.runtime import machine, native
from meshlm.runtime.split_linear import KERNEL_WIDTH, SplitLinear, width_for

SOURCE = Path(__file__).with_name("fp32_rows.c")
CPU = torch.device("cpu")
# the probe's weights: LAYERS decoder layers of width D (query-key-value, output, the MLP's two),
# 144 MB, more than a CPU's caches (decoding streams from memory); and its threshold. Per shape
# the gain differs (on a 2-core Zen 5 bmm reads 768-column layers slowly, wide ones nearly as fast
# as the kernel): so a whole layer's mix
PROBE_D, PROBE_LAYERS, MIN_SPEEDUP = 1024, 3, 1.05
PROBE_SHAPES = ((3 * PROBE_D, PROBE_D), (PROBE_D, PROBE_D), (4 * PROBE_D, PROBE_D),
                (PROBE_D, 4 * PROBE_D)) * PROBE_LAYERS

# (rows (M, in) fp32, blocks (P, in, w ≤ KERNEL_WIDTH) fp32, bias (out,) or None, out) -> (M, out)
Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]


@functools.cache
def fp32_rows_kernel() -> Product | None:
    """The compiled product, checked; None where it cannot be had (module docstring)."""
    library = native.library(SOURCE)
    if library is None:
        return None
    function = library.fp32_rows_product
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    function.restype = ctypes.c_int

    def product(rows, blocks, bias, out_features: int) -> torch.Tensor:
        rows = rows.contiguous()  # no copy when it is, as C reads it
        parts, in_features, width = blocks.shape
        # fp32 on the CPU, whatever torch's default dtype and device: C writes floats there
        y = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=CPU)
        if function(rows.data_ptr(), blocks.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    y.data_ptr(), rows.shape[0], parts, in_features, width, out_features,
                    torch.get_num_threads()):
            raise ValueError(f"fp32 row product: blocks {width} wide, at most {KERNEL_WIDTH}")
        return y

    return product if _agrees(product) else None


def unavailable() -> str | None:
    """Why this process has no fp32_rows_kernel(), in one line naming the problem and its fix (the
    source missing from the install, no compiler, a failed build or check, MESHLM_NATIVE=0); None
    where it has it. The precision line prints it: the fallback is never silent."""
    if fp32_rows_kernel() is not None:
        return None
    return native.why_not(SOURCE) or (
        f"the kernel built from {SOURCE.name} failed its check against a float64 product; set $CC "
        "to another C compiler (gcc or clang)")


def paying_kernel() -> Product | None:
    """fp32_rows_kernel() where this machine's probe found it the faster, else None."""
    kernel = fp32_rows_kernel()
    if kernel is None:
        return None
    figures = kernel_speedup(kernel)
    paid = min(figures["kernel_over_split"], figures["kernel_over_linear"]) >= MIN_SPEEDUP
    return kernel if paid else None


def kernel_speedup(kernel: Product) -> dict:
    """This machine's one-row speed of `kernel` over split_linear's bmm and over F.linear, from
    the cache or measured now."""
    threads = torch.get_num_threads()
    method = (f"best of 5 one-row passes over the fp32 weights of {PROBE_LAYERS} decoder layers "
              f"of width {PROBE_D}")
    return machine.lookup(machine.cpu_key("fp32-rows-kernel", threads),
                          lambda: _probe(kernel, threads), method)["value"]


def _probe(kernel: Product, threads: int, reps: int = 5) -> dict:
    # the values do not matter to the speed (fp32, no denormals): filled, not drawn, to be quick
    weights = [torch.full(shape, 0.01, device=CPU) for shape in PROBE_SHAPES]
    split = [SplitLinear(w, None, width_for(len(w), threads)) for w in weights]
    tiled = [SplitLinear(w, None, KERNEL_WIDTH).blocks for w in weights]
    x = {w.shape[1]: torch.full((1, w.shape[1]), 0.5, device=CPU) for w in weights}
    with torch.no_grad():
        seconds = {
            "linear": machine.best_seconds(
                lambda: [F.linear(x[w.shape[1]], w) for w in weights], reps),
            "split": machine.best_seconds(lambda: [m(x[m.in_features]) for m in split], reps),
            "kernel": machine.best_seconds(
                lambda: [kernel(x[b.shape[1]], b, None, len(w)) for b, w in zip(tiled, weights)],
                reps)}
    return {"kernel_over_split": seconds["split"] / seconds["kernel"],
            "kernel_over_linear": seconds["linear"] / seconds["kernel"],
            **{f"{name}_ms": value * 1e3 for name, value in seconds.items()}}


def _agrees(product: Product) -> bool:
    """Whether `product` gives x Wᵀ + b to fp32 rounding (against float64) on full, padded and
    narrow blocks, and each row alone exactly what it gives in a batch of five."""
    g = torch.Generator(device=CPU).manual_seed(0)
    # full blocks, a padded last one, one narrow block
    for out_features, in_features in ((256, 768), (300, 64), (37, 5)):
        weight = torch.randn(out_features, in_features, generator=g, device=CPU)
        bias = torch.randn(out_features, generator=g, device=CPU)
        blocks = SplitLinear(weight, None, min(KERNEL_WIDTH, out_features)).blocks
        x = torch.randn(5, in_features, generator=g, device=CPU)
        y = product(x, blocks, bias, out_features)
        exact = (x.double() @ weight.double().t() + bias.double()).float()
        bound = 1e-5 * (x.abs().double() @ weight.abs().double().t()).float() + 1e-6
        if not ((y - exact).abs() <= bound).all():
            return False
        if not rows_apart(functools.partial(product, blocks=blocks, bias=bias,
                                            out_features=out_features), x):
            return False
    return True


def rows_apart(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> bool:
    """Whether `function` gives each row r of its inputs (their first dimension) alone the bits it
    gives row r in one call over them all: what the kernel makes true by construction, and what
    torch's ops (F.linear, bmm) hold or not depending on the BLAS and the CPU (on an Intel Xeon
    with AMX oneDNN computes one row differently from two or more)."""
    together = function(*inputs)
    return all(torch.equal(function(*(x[r:r + 1] for x in inputs))[0], together[r])
               for r in range(len(inputs[0])))
