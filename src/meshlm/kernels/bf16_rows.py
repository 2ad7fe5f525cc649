"""bf16 products for decoding through a kernel compiled on this machine (bf16_rows.c).

Decoding in bf16 stores every nn.Linear's weight in bf16 (meshlm.runtime.precision.store_weights),
and a decoded token is then a matrix-vector product per layer, bound by streaming those weights.
oneDNN's F.linear reads them slower than AVX512-BF16's dot-product instruction does at one or two
rows (1.5-1.7x at one row on a 2-core Intel Xeon with AMX); the kernel multiplies the weight where
it lies, (out, in) row-major, so the one bf16 copy serves it and F.linear alike (longer calls: a
prefill). Its arithmetic is F.linear's under bf16 autocast to rounding: bf16 inputs, fp32 sums, then
bf16; each output is one dot product in a fixed order, so a row's outputs do not depend on the
batch, bit for bit (F.linear's do on some CPUs: meshlm.kernels.fp32_rows.rows_apart).

`bf16_rows_kernel()` is the product where this process has it (KERNEL: checked against a float64
product, and each row alone against the same row in a batch, bit for bit), else None, and
`unavailable()` says why. Whether it pays is meshlm.runtime.bf16_linear's probe.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from meshlm.kernels.fp32_rows import rows_apart
from meshlm.kernels.kernel import Kernel, close_to_float64

CPU = torch.device("cpu")
MULTIPLE = 32  # the kernel takes in_features in multiples of this (bf16_rows.c)

# (rows (M, in), weight (out, in) bf16, bias (out,) fp32 or None) -> (M, out) fp32
Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _product(function) -> Product:
    """The bound C function as a Product."""
    def product(rows, weight, bias) -> torch.Tensor:
        rows = rows.to(torch.bfloat16).contiguous()  # no copy when it is, as C reads it
        out_features, in_features = weight.shape
        y = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=CPU)
        if function(rows.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    y.data_ptr(), rows.shape[0], in_features, out_features,
                    torch.get_num_threads()):
            raise ValueError(f"bf16 row product: in_features {in_features} is not a multiple of "
                             f"{MULTIPLE}")
        return y

    return product


def _agrees(product: Product) -> bool:
    """Whether `product` gives x Wᵀ + b to fp32 rounding (against float64 over the same bf16
    numbers) on full and ragged tiles, and each row alone exactly what it gives in a batch of
    five."""
    g = torch.Generator(device=CPU).manual_seed(0)
    # full tiles; a ragged edge (39 weight rows: the last three go one output at a time)
    for out_features, in_features in ((256, 768), (39, 64)):
        weight = torch.randn(out_features, in_features, generator=g, device=CPU).bfloat16()
        bias = torch.randn(out_features, generator=g, device=CPU)
        x = torch.randn(5, in_features, generator=g, device=CPU).bfloat16()
        if not close_to_float64(product(x, weight, bias), x, weight, bias):
            return False
        if not rows_apart(functools.partial(product, weight=weight, bias=bias), x):
            return False
    return True


KERNEL = Kernel("bf16_rows.c", "bf16_rows_product",
                [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], _product, _agrees,
                "a float64 product",
                "bf16_rows(Tensor rows, Tensor weight, Tensor? bias) -> Tensor",
                lambda rows, weight, bias: rows.new_empty(rows.shape[0], weight.shape[0],
                                                          dtype=torch.float32))
bf16_rows_kernel = KERNEL.product  # () -> Product | None, once per process (.cache_clear())
unavailable = KERNEL.unavailable
