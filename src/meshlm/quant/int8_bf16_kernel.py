"""The int8-weight, bf16-activation product (int8 weight-only) compiled on this machine
(meshlm/kernels/int8_bf16_rows.c), and the layers given it.

An int8 layer with bf16 activations multiplies by torch._weight_int8pack_mm; at one row (a decoded
token) that kernel read a 12-layer d = 768 stack's weights at ~5 GB/s on a 2-core Zen 3 EPYC, a
fifth of its read bandwidth (docs/quantize.md). meshlm's reads the stored (out, in) int8 weight
where it lies (no second copy), widens each weight and each bf16 activation to fp32 (exactly) and
sums with fused multiply-adds. Its sums are in its own order, not torch's: it is checked against
the float64 product (kernel.close_to_float64), like the fp32, bf16 and int4 weight-only kernels,
and a row takes exactly the same steps alone or in a batch, at every row count, so a row's outputs
do not depend on the batch.

KERNEL is it; `give` hands it to a model's int8 weight-only layers on the CPU where a probe over
PROBE_MB of weights found it faster than torch's kernel at one row and not much slower at
BATCH_ROWS (that depends on the CPU); `unavailable` names why a layer goes without it. Defined
here: meshlm.quant.linear, which a Hugging Face export carries, imports no kernel code.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from meshlm import machine
from meshlm.kernels.fp32_rows import rows_apart
from meshlm.kernels.kernel import Kernel, close_to_float64
from meshlm.quant import weight_only
from meshlm.quant.linear import QuantizedLinear, quantize_weight

CPU = torch.device("cpu")
# the probe's weights (more than a CPU's caches: decoding streams from memory)
PROBE_MB, PROBE_SHAPE = 64, (3072, 768)
# the kernel serves every row count (a row's bits must not depend on the batch), so besides its
# one-row gain (kernel.MIN_SPEEDUP) it must not lose much at BATCH_ROWS rows, a served batch
BATCH_ROWS, BATCH_FLOOR = 16, 0.85
# (rows (M, K), the (N, K) int8 weight, its (N,) bf16 scales) -> (M, N) fp32
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _product(function) -> Product:
    """The bound C function as a Product: the rows rounded to bf16, as torch's kernel takes them."""
    def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()  # no copies when they are, as C reads them
        weight, scales = weight.contiguous(), scales.contiguous()
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=CPU)
        if function(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), y.data_ptr(), x.shape[0],
                    weight.shape[0], weight.shape[1], torch.get_num_threads()):
            raise MemoryError(f"int8 weight-only product: no memory for {x.shape[0]} rows")
        return y

    return product


def _close(product: Product) -> bool:
    """Whether `product` is within fp32 rounding of the float64 product of the bf16-rounded rows
    and the dequantized weights (ragged widths past every vector step, 1 to 9 rows of very
    different scales, an all-zero row, the extreme weights), each row alone what it gives among
    the others, bit for bit."""
    g = torch.Generator(device=CPU).manual_seed(0)
    for (n, k), rows in zip(((37, 200), (64, 768), (16, 71), (5, 1)), (1, 3, 9, 2)):
        x = torch.randn(rows, k, generator=g, dtype=torch.float32, device=CPU)
        x *= torch.logspace(-3, 2, rows, device=CPU)[:, None]
        if rows > 2:
            x[1] = 0.0
        stored = quantize_weight(torch.randn(n, k, generator=g, device=CPU), 8, 64)
        stored["qweight"][0] = -128  # the extreme weights (quantize_weight gives -127 at most)
        stored["qweight"][-1] = 127
        layer = QuantizedLinear(k, n, False, 8).to(CPU)
        for name, value in stored.items():
            getattr(layer, name).copy_(value)
        rounded = x.to(torch.bfloat16).float()
        y = product(x, layer.qweight, layer.scales)
        if not close_to_float64(y, rounded, layer.weight_fp32(), None) or \
                not rows_apart(lambda r, w=layer.qweight, s=layer.scales: product(r, w, s), x):
            return False
    return True


KERNEL = Kernel("int8_bf16_rows.c", "int8_bf16_rows_product",
                [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], _product, _close,
                "the float64 product",
                "int8_bf16_rows(Tensor x, Tensor weight, Tensor scales) -> Tensor",
                lambda x, weight, scales: x.new_empty(x.shape[0], weight.shape[0],
                                                      dtype=torch.float32))
int8_bf16_rows_kernel = KERNEL.product  # () -> Product | None, once per process (.cache_clear())


def give(model: nn.Module) -> float:
    """Give every int8 weight-only layer of `model` on the CPU the compiled kernel where this
    process has it and its probe found it the faster (kernel_speedup, weight_only.give). Returns
    its speed over torch's kernel where given, else 0.0."""
    return weight_only.give(KERNEL, model, 8, kernel_speedup, BATCH_FLOOR)


def unavailable(model: nn.Module) -> str | None:
    """Why `model`'s int8 weight-only layers on the CPU go without the kernel because this process
    could not have it (one line: the problem and its fix); None where it has it or has no such
    layer."""
    return weight_only.unavailable(KERNEL, model, 8)


def kernel_speedup(kernel: Product) -> dict:
    """This machine's speed of `kernel` over torch._weight_int8pack_mm at one row
    (kernel_over_torch) and at BATCH_ROWS (batch_kernel_over_torch), from the cache or measured
    now."""
    method = (f"best of 5 passes of 1 and of {BATCH_ROWS} rows over {PROBE_MB} MB of "
              f"{PROBE_SHAPE} int8 weights, {machine.COLD}")
    return machine.measured("int8-bf16-kernel", KERNEL.probed_by(method),
                            lambda threads: _probe(kernel))["value"]


def _probe(kernel: Product, reps: int = 5) -> dict:
    out, k = PROBE_SHAPE
    count = max(1, PROBE_MB * 2**20 // (out * k))
    # the values do not matter to the speed: the layers' zeros, each its own copy
    layers = [QuantizedLinear(k, out, False, 8).to(CPU) for _ in range(count)]
    theirs = [layer._int8pack_operands()[:2] for layer in layers]

    def steps(rows: int) -> dict:
        x = torch.full((rows, k), -0.5, dtype=torch.bfloat16, device=CPU)
        return {"torch": lambda: [torch._weight_int8pack_mm(x, w, s) for w, s in theirs],
                "kernel": lambda: [kernel(x, m.qweight, m.scales) for m in layers]}
    return machine.race_rows(steps, BATCH_ROWS, reps)
