"""The int4-weight, int8-activation product (w4a8) compiled on this machine
(meshlm/kernels/int4_rows.c), and the layers given it.

A w4a8 layer rounds each activation row to int8 and multiplies it by int4 weights: each group's
sums are exact integers, scaled in fp32 (meshlm.quant.linear.int4_int8_products). With torch ops
that takes a loop over the groups; the kernel reads the weights once, half a byte each, and sums
with the CPU's int8 dot-product instruction (AVX512-VNNI) where it has one. Its outputs are the
torch ops' numbers bit for bit, at every row count, so a row's outputs do not depend on the batch.

KERNEL is it, checked against int4_int8_products; `give` hands it to a model's w4a8 layers on the
CPU. There is no race to win: the torch ops are its reference, many times slower, so the layers
take it wherever this process has it; `unavailable` names why not (the layers then keep the torch
ops, correct and slow: the precision line says so). Defined here, beside the arithmetic it
repeats: meshlm.quant.linear, which a Hugging Face export carries, imports no kernel code.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from meshlm.kernels.kernel import Kernel
from meshlm.quant.linear import (
    QuantizedLinear,
    cpu_int8_activation_layers,
    int4_int8_products,
    quantize_weight,
)

CPU = torch.device("cpu")
LANES = 16  # outputs per block (int4_rows.c's LANES)
# (rows (M, K) fp32, packed weights, (B, G, 2, 16) bf16 scales and zeros, out features, group)
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


# the C functions of both int4 kernels (this and meshlm.quant.int4_bf16_kernel): (x, packed, sz,
# y, rows, k, blocks, group, threads) -> 0, or 1 without memory
ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]


def packed_product(function, dtype: torch.dtype = torch.float32) -> Product:
    """A bound int4 C function on a layer's packed operands (QuantizedLinear._int4_rows_operands),
    the rows in `dtype` (fp32 for this kernel, which rounds them to int8 itself), fp32 out: here a
    drop-in for int4_int8_products."""
    def product(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, n: int,
                group: int) -> torch.Tensor:
        x = x.to(dtype).contiguous()
        blocks = sz.shape[0]
        y = torch.empty(x.shape[0], blocks * LANES, dtype=torch.float32, device=CPU)
        if function(x.data_ptr(), packed.data_ptr(), sz.data_ptr(), y.data_ptr(), x.shape[0],
                    x.shape[1], blocks, group, torch.get_num_threads()):
            raise MemoryError(f"int4 product: no memory for {x.shape[0]} rows")
        return y if n == blocks * LANES else y[:, :n].contiguous()

    return product


def fake(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, n: int,
         group: int) -> torch.Tensor:
    """An int4 operator's output as a compiled graph traces it."""
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def _same_numbers(product: Product) -> bool:
    """Whether `product` gives int4_int8_products' numbers bit for bit: ragged widths, 1 to 9 rows,
    rows of very different scales, rounding ties, an all-zero row, the extreme weights (against a
    constant row: every activation −127, the largest sums) and a width past the last 16 (the
    rounding's plain tail)."""
    g = torch.Generator(device=CPU).manual_seed(0)
    for (n, k, group), rows in zip(((37, 128, 32), (64, 768, 64), (16, 256, 256), (5, 72, 8)),
                                   (1, 3, 9, 2)):
        x = torch.randn(rows, k, generator=g, dtype=torch.float32, device=CPU)
        x *= torch.logspace(-3, 2, rows, device=CPU)[:, None]
        x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5], device=CPU)
        if rows > 2:
            x[1], x[2] = 0.0, -0.75
        layer = QuantizedLinear(k, n, False, 4, group, activations="int8").to(CPU)
        stored = quantize_weight(torch.randn(n, k, generator=g, device=CPU), 4, group)
        stored["qweight"][0] = 0xFF  # q = 15 throughout: the largest sums
        for name, value in stored.items():
            getattr(layer, name).copy_(value)
        packed, sz = layer._int4_rows_operands()
        if not torch.equal(product(x, packed, sz, n, group),
                           int4_int8_products(x, layer.stored(), group)):
            return False
    return True


KERNEL = Kernel("int4_rows.c", "int4_rows_product", ARGTYPES, packed_product, _same_numbers,
                "int4_int8_products",
                "int4_rows(Tensor x, Tensor packed, Tensor sz, int n, int group) -> Tensor", fake)
int4_rows_kernel = KERNEL.product  # () -> Product | None, once per process (.cache_clear())


def give(model: nn.Module) -> int:
    """Give every w4a8 layer of `model` on the CPU the compiled kernel where this process has it.
    Returns how many layers got it."""
    layers = _cpu_w4a8_layers(model)
    kernel = int4_rows_kernel() if layers else None
    for layer in layers if kernel else ():
        layer.row_kernel = kernel
    return len(layers) if kernel else 0


def unavailable(model: nn.Module) -> str | None:
    """Why `model`'s w4a8 layers on the CPU go without the kernel (one line: the problem and its
    fix); None where it has no such layer or the kernel is here."""
    return KERNEL.unavailable() if _cpu_w4a8_layers(model) else None


def _cpu_w4a8_layers(model: nn.Module) -> list[QuantizedLinear]:
    return cpu_int8_activation_layers(model, 4)
