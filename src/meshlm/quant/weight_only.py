"""What the weight-only layers' compiled kernels (meshlm.quant.int4_bf16_kernel, .int8_bf16_kernel)
share: which layers of a model take one, and how it is given. Each kernel serves every row count
(a row's bits must not depend on the batch), so it is given where its probe found it at least
kernel.MIN_SPEEDUP times torch's kernel at one row and not much slower at a served batch's rows
(`floor`: batch_kernel_over_torch)."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from meshlm.kernels.kernel import Kernel
from meshlm.quant.linear import QuantizedLinear


def cpu_layers(model: nn.Module, bits: int) -> list[QuantizedLinear]:
    """`model`'s weight-only (bf16-activation) layers of `bits`-bit weights on the CPU."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == bits
            and m.activations == "bf16" and m.qweight.is_cpu]


def give(kernel: Kernel, model: nn.Module, bits: int, speedup: Callable[[Callable], dict],
         floor: float) -> float:
    """Give `model`'s `bits`-bit weight-only layers on the CPU `kernel`'s product where this
    process has it and its probe (`speedup`, the module's kernel_speedup) found it the faster.
    Returns its one-row speed over torch's kernel where given, else 0.0."""
    layers = cpu_layers(model, bits)
    product = kernel.paying(speedup, {"batch_kernel_over_torch": floor}) if layers else None
    for layer in layers if product else ():
        layer.row_kernel = product
    return speedup(product)["kernel_over_torch"] if product else 0.0


def unavailable(kernel: Kernel, model: nn.Module, bits: int) -> str | None:
    """Why `model`'s `bits`-bit weight-only layers on the CPU go without `kernel` because this
    process could not have it (Kernel.unavailable: one line, the problem and its fix); None where
    it has it or has no such layer."""
    return kernel.unavailable() if cpu_layers(model, bits) else None
