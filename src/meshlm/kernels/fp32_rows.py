"""fp32 products for decoding through a kernel compiled on this machine (fp32_rows.c).

A decoded token is a matrix-vector product per layer, bound by streaming the weights. With the
weight in column blocks up to WIDTH columns wide (`as_blocks`), a plain C loop reads four blocks
from four places at once, front to back, into accumulators held in registers (two rows a pass
against two of them): with one 128-wide block at a time, over a 12-layer d = 768 stack with a
50,304-word head, 1.5-1.75x torch.bmm's speed over meshlm.runtime.split_linear's per-thread blocks
at one row, and faster at every row count up to 64 (docs/quantize.md). Each output is one in-order
sum, the same operations for a row whatever else is in the call, so a row's outputs do not depend on
the batch, bit for bit; they are F.linear's fp32 product to rounding. Whether torch's own ops keep
rows apart depends on the BLAS and the CPU (`rows_apart` tells: on an Intel Xeon with AMX, F.linear
computes one row differently from two).

`fp32_rows_kernel()` is the product where this process has it (KERNEL: checked against a float64
product, and each row alone against the same row in a batch, bit for bit), else None, and
`unavailable()` says why. Whether it pays is split_linear's probe (paying_kernel).
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshlm.kernels.kernel import Kernel, close_to_float64

CPU = torch.device("cpu")
WIDTH = 32  # the widest block the kernel takes (fp32_rows.c's TILE)

# (rows (M, in) fp32, blocks (P, in, w ≤ WIDTH) fp32, bias (out,) or None, out) -> (M, out)
Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]


def as_blocks(weight: torch.Tensor, width: int) -> torch.Tensor:
    """An (out, in) weight as (P, in, width) column blocks, as the kernel and torch.bmm read it:
    block p holds output columns p·width …, the last zero-padded, each block contiguous."""
    parts = -(-len(weight) // width)
    padded = F.pad(weight, (0, 0, 0, parts * width - len(weight)))  # (P·width, in)
    return padded.reshape(parts, width, -1).transpose(1, 2).contiguous()


def _product(function) -> Product:
    """The bound C function as a Product."""
    def product(rows, blocks, bias, out_features: int) -> torch.Tensor:
        rows = rows.contiguous()  # no copy when it is, as C reads it
        parts, in_features, width = blocks.shape
        # fp32 on the CPU, whatever torch's default dtype and device: C writes floats there
        y = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=CPU)
        if function(rows.data_ptr(), blocks.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    y.data_ptr(), rows.shape[0], parts, in_features, width, out_features,
                    torch.get_num_threads()):
            raise ValueError(f"fp32 row product: blocks {width} wide, at most {WIDTH}")
        return y

    return product


def _agrees(product: Product) -> bool:
    """Whether `product` gives x Wᵀ + b to fp32 rounding (against float64) on full, padded and
    narrow blocks, and each row alone exactly what it gives in a batch of five."""
    g = torch.Generator(device=CPU).manual_seed(0)
    # full blocks, a padded last one, one narrow block
    for out_features, in_features in ((256, 768), (300, 64), (37, 5)):
        weight = torch.randn(out_features, in_features, generator=g, device=CPU)
        bias = torch.randn(out_features, generator=g, device=CPU)
        blocks = as_blocks(weight, min(WIDTH, out_features))
        x = torch.randn(5, in_features, generator=g, device=CPU)
        if not close_to_float64(product(x, blocks, bias, out_features), x, weight, bias):
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


KERNEL = Kernel("fp32_rows.c", "fp32_rows_product",
                [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int], _product, _agrees,
                "a float64 product",
                "fp32_rows(Tensor rows, Tensor blocks, Tensor? bias, SymInt out_features) "
                "-> Tensor",
                lambda rows, blocks, bias, out_features: rows.new_empty(
                    rows.shape[0], out_features, dtype=torch.float32))
fp32_rows_kernel = KERNEL.product  # () -> Product | None, once per process (.cache_clear())
unavailable = KERNEL.unavailable
