"""The int4-weight, bf16-activation product (int4 weight-only) compiled on this machine
(meshlm/kernels/int4_bf16_rows.c), and the layers given it.

An int4 layer with bf16 activations multiplies by torch._weight_int4pack_mm_for_cpu; at one row
(a decoded token) that kernel read a 12-layer d = 768 stack's weights at ~2/3 of the speed of
meshlm's own (docs/quantize.md). meshlm's reads the packed layout the w4a8 kernel reads
(QuantizedLinear._int4_rows_operands: one packed copy serves both), looks each 4-bit weight up as
a bf16 number and sums pairs of products into fp32 with vdpbf16ps where the CPU has AVX512_BF16,
else unpacks it into a float and sums with fused multiply-adds. Its sums are in its own order, not
torch's: it is checked against the float64 product (kernel.close_to_float64), like the fp32 and
bf16 kernels, and a row takes exactly the same steps alone or in a batch, at every row count, so a
row's outputs do not depend on the batch.

KERNEL is it; `give` hands it to a model's int4 weight-only layers on the CPU where a probe over
PROBE_MB of weights found it faster than torch's kernel at one row and not much slower at
BATCH_ROWS (that depends on the CPU; without AVX512 its plain C loop may lose); `unavailable`
names why a layer goes without it. Defined here:
meshlm.quant.linear, which a Hugging Face export carries, imports no kernel code.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from meshlm import machine
from meshlm.kernels.kernel import Kernel, close_to_float64
from meshlm.quant import weight_only
from meshlm.quant.int4_kernel import ARGTYPES, CPU, Product, fake, packed_product
from meshlm.quant.linear import QuantizedLinear

# the probe's weights (more than a CPU's caches: decoding streams from memory)
PROBE_MB, PROBE_SHAPE, PROBE_GROUP = 64, (3072, 768), 64
# the kernel serves every row count (a row's bits must not depend on the batch), so besides its
# one-row gain (kernel.MIN_SPEEDUP) it must not lose much at BATCH_ROWS rows, a served batch
BATCH_ROWS, BATCH_FLOOR = 16, 0.85  # a 2-core Zen 5: 0.88-0.94 multiply-adding, 2.0-2.1 with
# vdpbf16ps (docs/quantize.md)


def _close(product: Product) -> bool:
    """Whether `product` is within fp32 rounding of the float64 product of the bf16-rounded rows
    and the dequantized weights: ragged widths, 1 to 9 rows of very different scales, an all-zero
    row, the extreme weights, every group size's layout."""
    g = torch.Generator(device=CPU).manual_seed(0)
    for (n, k, group), rows in zip(((37, 128, 32), (64, 768, 64), (16, 256, 256), (5, 72, 8)),
                                   (1, 3, 9, 2)):
        x = torch.randn(rows, k, generator=g, dtype=torch.float32, device=CPU)
        x *= torch.logspace(-3, 2, rows, device=CPU)[:, None]
        if rows > 2:
            x[1] = 0.0
        layer = QuantizedLinear.from_linear(nn.Linear(k, n, bias=False), 4, group).to(CPU)
        layer.qweight[0] = 0xFF  # q = 15 throughout: the largest sums
        packed, sz = layer._int4_rows_operands()
        rounded = x.to(torch.bfloat16).float()
        if not close_to_float64(product(x, packed, sz, n, group), rounded, layer.weight_fp32(),
                                None):
            return False
    return True


KERNEL = Kernel("int4_bf16_rows.c", "int4_bf16_rows_product", ARGTYPES,
                functools.partial(packed_product, dtype=torch.bfloat16), _close,
                "the float64 product",
                "int4_bf16_rows(Tensor x, Tensor packed, Tensor sz, int n, int group) -> Tensor",
                fake)
int4_bf16_rows_kernel = KERNEL.product  # () -> Product | None, once per process (.cache_clear())


def give(model: nn.Module) -> float:
    """Give every int4 weight-only layer of `model` on the CPU the compiled kernel where this
    process has it and its probe found it the faster (kernel_speedup, weight_only.give). Returns
    its speed over torch's kernel where given, else 0.0."""
    return weight_only.give(KERNEL, model, 4, kernel_speedup, BATCH_FLOOR)


def unavailable(model: nn.Module) -> str | None:
    """Why `model`'s int4 weight-only layers on the CPU go without the kernel because this process
    could not have it (one line: the problem and its fix); None where it has it or has no such
    layer."""
    return weight_only.unavailable(KERNEL, model, 4)


def kernel_speedup(kernel: Product) -> dict:
    """This machine's speed of `kernel` over torch._weight_int4pack_mm_for_cpu at one row
    (kernel_over_torch) and at BATCH_ROWS (batch_kernel_over_torch), from the cache or measured
    now."""
    method = (f"best of 5 passes of 1 and of {BATCH_ROWS} rows over {PROBE_MB} MB of "
              f"{PROBE_SHAPE} int4 weights in groups of {PROBE_GROUP}, {machine.COLD}")
    return machine.measured("int4-bf16-kernel", KERNEL.probed_by(method),
                            lambda threads: _probe(kernel))["value"]


def _probe(kernel: Product, reps: int = 5) -> dict:
    out, k = PROBE_SHAPE
    layer = QuantizedLinear(k, out, False, 4, PROBE_GROUP).to(CPU)  # the values do not matter
    count = max(1, PROBE_MB * 2**20 // (out * k // 2))
    ours = [tuple(t.clone() for t in layer._int4_rows_operands()) for _ in range(count)]
    packed, scales_zeros, _ = layer._int4pack_operands()
    theirs = [(packed.clone(), scales_zeros.clone()) for _ in range(count)]

    def steps(rows: int) -> dict:
        x = torch.full((rows, k), -0.5, dtype=torch.bfloat16, device=CPU)
        return {"torch": lambda: [torch._weight_int4pack_mm_for_cpu(x, p, PROBE_GROUP, s)
                                  for p, s in theirs],
                "kernel": lambda: [kernel(x, p, s, out, PROBE_GROUP) for p, s in ours]}
    return machine.race_rows(steps, BATCH_ROWS, reps)
