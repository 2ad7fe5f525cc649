"""bf16 linear layers for decoding on a CPU.

Under bf16 decoding every nn.Linear holds its weight in bf16 (precision.store_weights), and a
decoded token is a matrix-vector product per layer, bound by streaming those weights. oneDNN's
F.linear reads bf16 weights at one row slower than meshlm's compiled kernel
(meshlm.kernels.bf16_rows: AVX512-BF16's dot-product instruction); from a few rows on, oneDNN's
AMX and blocked kernels win. So `Bf16Linear` multiplies calls of up to KERNEL_ROWS rows (decode
steps, small served batches) by the kernel and longer ones (prefill chunks, speculation's verify,
large batches) by F.linear, both over the one bf16 weight, which stays where it is: no second copy,
the same parameters and state dict as the nn.Linear it replaces. On a CPU without bf16 arithmetic
oneDNN's bf16 F.linear has no blocked kernel either (a 2-core Zen 3 EPYC, AVX2: 0.2 GB/s of
weights at 64 rows, 4.3x slower than meshlm's kernel, 3.8x at 16 rows; a 32-token prefill took 0.5
s, twice fp32's), and there the kernel takes every row count.

`lay_out_for_decoding(model)` swaps every plain bf16 nn.Linear on CPU for one where the kernel's
probe, measured once per machine (meshlm.machine), found it at least meshlm.kernels.kernel
.MIN_SPEEDUP times F.linear's one-row speed over the bf16 weights of a few decoder layers, taking
every row count where it was that much faster at BATCH_ROWS too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm import machine
from meshlm.kernels import bf16_rows
from meshlm.kernels.kernel import MIN_SPEEDUP
from meshlm.runtime.split_linear import KERNEL_PROBE_D, KERNEL_PROBE_LAYERS, KERNEL_PROBE_SHAPES

# the most rows a call multiplies by the kernel. On a 2-core Intel Xeon with AMX, over the bf16
# weights of a 12-layer d = 768 stack and a 50,304-word head (benchmarks/split_linear.py --bf16,
# the kernel prefetching the next tile): 1.70x F.linear's speed at one row with two threads (1.55x
# with one), 1.66x (1.50x) at two rows, 1.54x (1.45x) at four, 1.10x (1.05x) at eight, 0.75x
# (0.71x) at sixteen
KERNEL_ROWS = 4
BATCH_ROWS = 16  # the probe's second row count (a served batch's, a prefill chunk's order)


class Bf16Linear(nn.Linear):
    """An nn.Linear over the same bf16 weight and bias, whose calls of up to KERNEL_ROWS rows (of
    any number, `every_row`) on CPU without autograd go through `kernel` (meshlm.kernels.
    bf16_rows' product) and return bf16, as F.linear under bf16 autocast does; every other call
    is nn.Linear's own."""

    def __init__(self, linear: nn.Linear, kernel: bf16_rows.Product, every_row: bool = False):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None,
                         device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters, not copies
        self.kernel, self.every_row = kernel, every_row
        # fp32 for the kernel's sums (exact from bf16); derived, so not in the state dict
        self.register_buffer("bias_fp32", None if linear.bias is None else
                             linear.bias.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if (rows.shape[0] > KERNEL_ROWS and not self.every_row or not rows.is_cpu
                or not self.weight.is_cpu
                or self.weight.dtype != torch.bfloat16
                or torch.is_grad_enabled() and (rows.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        y = self.kernel(rows, self.weight, self.bias_fp32)
        return y.to(torch.bfloat16).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = "every row" if self.every_row else f"up to {KERNEL_ROWS} rows"
        return f"{super().extra_repr()}, compiled kernel at {rows}"


def takes(module: nn.Module) -> bool:
    """Whether `module` is a plain bf16 nn.Linear on CPU of a width the kernel takes."""
    return (type(module) is nn.Linear and module.weight.dtype == torch.bfloat16
            and module.weight.device.type == "cpu"
            and module.in_features % bf16_rows.MULTIPLE == 0)


def lay_out_for_decoding(model: nn.Module) -> tuple[int, float]:
    """Swap `model`'s plain bf16 nn.Linear layers on CPU for Bf16Linear where the kernel's probe
    found it at least MIN_SPEEDUP times F.linear's one-row speed, at every row count where it
    found that at BATCH_ROWS too. Returns (layers swapped, the one-row speed-up; 0.0 where this
    process has no kernel)."""
    kernel = bf16_rows.bf16_rows_kernel()
    figures = kernel_speedup(kernel) if kernel else {"kernel_over_linear": 0.0}
    if figures["kernel_over_linear"] < MIN_SPEEDUP:
        return 0, figures["kernel_over_linear"]
    every_row = figures["batch_kernel_over_linear"] >= MIN_SPEEDUP
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if takes(child):
                setattr(parent, name, Bf16Linear(child, kernel, every_row))
                swapped += 1
    return swapped, figures["kernel_over_linear"]


def every_row(model: nn.Module) -> bool:
    """Whether `model`'s Bf16Linear layers take the kernel at every row count."""
    return any(isinstance(m, Bf16Linear) and m.every_row for m in model.modules())


def kernel_speedup(kernel: bf16_rows.Product) -> dict:
    """This machine's speed of `kernel` over bf16 F.linear at one row (kernel_over_linear) and at
    BATCH_ROWS (batch_kernel_over_linear), from the cache or measured now."""
    method = (f"best of 5 passes of 1 and of {BATCH_ROWS} rows over the bf16 weights of "
              f"{KERNEL_PROBE_LAYERS} decoder layers of width {KERNEL_PROBE_D}, {machine.COLD}")
    return machine.measured("bf16-rows-kernel", bf16_rows.KERNEL.probed_by(method),
                            lambda threads: _probe(kernel))["value"]


def _probe(kernel: bf16_rows.Product, reps: int = 5) -> dict:
    # the values do not matter to the speed (no denormals): filled, not drawn, to be quick
    weights = [torch.full(shape, 0.01, dtype=torch.bfloat16) for shape in KERNEL_PROBE_SHAPES]

    def steps(rows: int) -> dict:
        x = {w.shape[1]: torch.full((rows, w.shape[1]), 0.5, dtype=torch.bfloat16)
             for w in weights}
        return {"linear": lambda: [F.linear(x[w.shape[1]], w) for w in weights],
                "kernel": lambda: [kernel(x[w.shape[1]], w, None) for w in weights]}
    return machine.race_rows(steps, BATCH_ROWS, reps)
